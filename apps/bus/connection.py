"""Connecting an app to NATS: the URLs of `NATS_URL` (one server or a cluster's, credentials in
the URL), the connection each app holds (reconnecting forever, quiet while NATS is away, replies
under its role's inbox) and the administrator's one-off connection that declares the topology.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client as NatsClient

from apps.bus.declaration import Stopped, ensure_topology
from apps.bus.reconnects import Reconnects, told_on_reconnect
from apps.bus.topology import BusLimits, inbox_prefix
from apps.waiting import done_unless

log = logging.getLogger("helexa.bus")

T = TypeVar("T")


def one_per_connection(make: Callable[[NatsClient], T]) -> Callable[[NatsClient], T]:
    """`of(nc)`: what `make(nc)` made the first time it was asked for `nc`, shared by every user of
    that connection (and gone with it)."""
    made: weakref.WeakKeyDictionary[NatsClient, T] = weakref.WeakKeyDictionary()

    def of(nc: NatsClient) -> T:
        thing = made.get(nc)
        if thing is None:
            thing = made[nc] = make(nc)
        return thing

    return of


async def reached_server(nc: NatsClient, timeout_s: float = 10.0) -> None:
    """Until the server has taken everything `nc` sent so far: its subscriptions are in place (a
    message another connection publishes from now on reaches them) and its publishes arrived.

    One `nc.flush()` is not that: nats-py writes the flush's PING straight to the socket, ahead of
    the commands (SUB, PUB) still queued for its flusher task, so the PONG can come back before
    the server saw them. The first flush wakes the flusher, which hands the queue to the socket
    before the PONG can be read; the second PING follows the queue, and its PONG comes after it.
    """
    for _ in range(2):
        await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # a float works: wait_for


def _credentials(servers: list[str]) -> dict[str, str]:
    """The first credentials found in the server URLs, as connect options, so they also apply to
    the servers a cluster announces later (whose URLs carry none)."""
    for server in servers:
        parsed = urlsplit(server if "://" in server else f"nats://{server}")
        if parsed.username and parsed.password is not None:
            return {"user": unquote(parsed.username), "password": unquote(parsed.password)}
        if parsed.username:
            return {"token": unquote(parsed.username)}
    return {}


def server_urls(url: str) -> list[str]:
    """The servers of a NATS_URL: one URL, or several of a cluster, comma-separated."""
    return [u.strip() for u in url.split(",") if u.strip()]


def without_password(url: str) -> str:
    """`url` (or a comma-separated list of them) as it may be shown: host, port and path, no credentials."""
    shown = []
    for one in url.split(","):
        parts = urlsplit(one.strip() if "://" in one else f"nats://{one.strip()}")
        host = parts.hostname or ""
        where = f"[{host}]" if ":" in host else host
        if parts.port:
            where += f":{parts.port}"
        shown.append(f"{where}{parts.path if parts.path not in ('', '/') else ''}")
    return ",".join(shown)


def _quiet_errors(url: str, name: str) -> Callable[[Exception], Awaitable[None]]:
    """nats-py's default error callback logs a traceback per failed attempt (two a second while a
    server is away); this one says what is wrong in one line, again only when it changes."""
    last: list[str] = [""]

    async def note(exc: Exception) -> None:
        said = f"{type(exc).__name__}: {exc}"[:300]
        if is_permission_violation(exc):
            # Not an outage: this app's role may not do what it tried (its NATS user's permissions).
            log.error("NATS refused this app's role a publish or subscribe",
                      extra={"client": name, "error": said})
        elif said != last[0]:
            last[0] = said
            log.warning("cannot reach NATS, retrying", extra={"client": name, "servers": without_password(url),
                                                              "error": said})

    return note


def is_permission_violation(exc: BaseException) -> bool:
    """Whether an error the server sent says the user may not publish or subscribe there."""
    return "permissions violation" in str(exc).lower()


def user_of(url: str) -> str | None:
    """The NATS user a URL connects as (None: no user, or a token, which is never shown)."""
    found = _credentials(server_urls(url))
    return found.get("user")


async def connect(url: str, name: str, *, role: str | None = None, max_reconnect_attempts: int = -1,
                  error_cb: Callable[[Exception], Awaitable[None]] | None = None,
                  closed_cb: Callable[[], Awaitable[None]] | None = None,
                  stop: asyncio.Event | None = None) -> NatsClient:
    """Connect, by default with reconnects forever: the apps ride out a NATS restart instead of exiting.

    `url` may list several servers of a cluster, comma-separated; any of them will do. Credentials
    come in the URL (`nats://user:password@host:port`, or `nats://token@host:port`). The connection
    is closed for good only by us or by a server's `-ERR` (nats-py never reconnects then);
    `closed_cb` hears of both. While no server answers, one line says why (not a traceback per
    attempt); an app asked to stop meanwhile (`stop` set) gets `Stopped` instead of waiting on.
    An app of a `role` (`apps.bus.roles`) gets its replies under that role's inbox prefix, the one
    its NATS user may subscribe to (`inbox_prefix`).
    """
    servers = server_urls(url)
    reconnects = Reconnects()
    options: dict[str, Any] = {"error_cb": error_cb or _quiet_errors(url, name),
                               "reconnected_cb": reconnects.reconnected}
    if role is not None:
        options["inbox_prefix"] = inbox_prefix(role, user_of(url))
    if closed_cb is not None:
        options["closed_cb"] = closed_cb
    options.update(_credentials(servers))
    connecting = asyncio.ensure_future(nats.connect(
        servers,
        name=name,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        **options,
    ))
    if stop is None:
        return told_on_reconnect(await connecting, reconnects)
    if await done_unless(connecting, stop):
        return told_on_reconnect(connecting.result(), reconnects)
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    raise Stopped(f"{name} stopped before NATS answered")


async def setup(url: str, limits: BusLimits) -> None:
    """Declare (or converge) the topology with `limits`, as the administrator whose `url` it is."""
    nc = await connect(url, "helexa-bus-setup", max_reconnect_attempts=3)
    try:
        await ensure_topology(nc.jetstream(), limits)
    finally:
        await nc.close()
