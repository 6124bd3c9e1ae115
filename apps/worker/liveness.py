"""The worker's side of liveness: how a held request, its requester and JetStream keep track of
each other, and how a cancellation reaches a generation.

The protocol (the gateway's side answers it; any NATS client may):

- **Heartbeats.** While a worker holds a request it sends a `Heartbeat` frame on the request's
  reply subject and an in-progress ack to JetStream every `HELEXA_HEARTBEAT_S` (`keep_alive`).
  The requester's idle timeout and the consumer's ack wait both watch this: a worker that stops
  touching its request is taken for dead, and JetStream delivers the request to another worker.
- **Attempts.** A request's attempt number is `GenerateRequest.attempt - 1 + delivery number`
  (`attempt_of`): JetStream's redeliveries of one message count up from the attempt its requester
  gave it, and a requester that migrates a request publishes a new message whose `attempt` is
  past every attempt the old message can reach (old `attempt` + max_deliver). Frames, events and
  probes carry it.
- **Alive probe.** A requester that sets `liveness_probe` answers every request on
  `<reply subject>.alive` while it listens. During a run the worker asks every `PROBE_S` with its
  attempt number (`RequesterProbe.watch`). For a gateway's reply subject it asks on the gateway
  connection's home instead (`HomeProbes`, `apps.bus.bundles`): one message per home per interval
  for every attempt the worker runs for it, answered per token (`gone` for a token the gateway no
  longer holds: its request ended there). `ATTEMPT_TAKEN` means another attempt serves the client
  (this one lost, e.g. it was silent past the ack wait and another worker took over, or the
  request was migrated): the run stops at once, sends nothing more, leaves the message to the
  attempt that holds it now (an ack from here would settle it under that attempt: acks name a
  message by its stream sequence) and records `served=False`. *No responders* means nobody
  listens: only when that lasts `HELEXA_REQUESTER_GRACE_S` is the requester gone (its gateway
  died) and the generation aborted, so its KV is freed; a shorter spell is a requester
  reconnecting through a NATS outage, and a timeout or our own reconnect is only slowness.
- **Attempt taken.** Before running a redelivered or migrated attempt (attempt > 1) the worker asks
  the same subject with its attempt number (`still_wanted`). The requester answers `ATTEMPT_TAKEN`
  when another attempt serves the client: then this attempt must not run (its text would be
  repeated) and the message is terminated. No responders there too means nobody waits for it.
  A redelivery that reaches the worker still running the first attempt (its in-progress acks came
  late) is not an attempt at all: the model loop leaves the message to the running one, whose acks
  still count (JetStream names a message by its stream sequence), and touches it.
- **Cancel.** The requester publishes `helexa.cancel.<request id>` when its client leaves or a
  deadline passes. Every worker listens (`Cancellations`): the one holding the request aborts it
  (idempotently); the others remember the id, boundedly, so a later pull of it is dropped unserved.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus import bundles, topology, wire
from apps.bus.connection import one_per_connection
from apps.worker.replies import Replier

log = logging.getLogger("helexa.worker")

# How often a running request checks that its requester still listens.
PROBE_S = 1.0
# Running attempts named in one home probe (a message of about 32 bytes each).
MAX_ASKS_PER_PROBE = 1024
# How long a redelivered attempt waits for the requester to say whether it may run.
ATTEMPT_CHECK_S = 2.0
# Cancellations of requests not pulled yet that a worker keeps; a flood cannot grow it forever.
REMEMBERED_CANCELS = 10_000


async def keep_alive(replier: Replier, interval_s: float, touch: Callable[[], Awaitable[None]]) -> None:
    """Heartbeats for the requester and in-progress acks (`touch`) for JetStream while a run goes."""
    while True:
        await asyncio.sleep(interval_s)
        await replier.heartbeat()
        await touch()


def attempt_of(request: wire.GenerateRequest, num_delivered: int | None) -> int:
    """The attempt a delivery of `request`'s message is (see the module docstring)."""
    return max(request.attempt, 1) - 1 + (num_delivered or 1)


class Verdict(enum.Enum):
    """Why a requester probe ended."""

    # Nobody has listened on the alive subject for the whole grace period.
    GONE = "gone"
    # The requester serves its client from another attempt.
    TAKEN = "taken"


@dataclass(slots=True, frozen=True)
class RequesterProbe:
    """The periodic alive probe of one running attempt's requester."""

    nc: NatsClient
    reply_subject: str
    attempt: int
    grace_s: float
    interval_s: float = PROBE_S

    async def watch(self) -> Verdict:
        """Probe until the requester says this attempt lost, or has not listened for `grace_s`."""
        home_and_token = bundles.split_reply_subject(self.reply_subject)
        if home_and_token is not None:
            return await home_probes_of(self.nc).watch(*home_and_token, self.attempt, self.grace_s)
        subject = topology.alive_subject(self.reply_subject)
        unanswered_since: float | None = None
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                answer = await self.nc.request(subject, str(self.attempt).encode(),
                                               timeout=max(self.interval_s, 1.0))
            except nats.errors.NoRespondersError:
                now = time.monotonic()
                if unanswered_since is None:
                    unanswered_since = now
                    # Not the reply subject: it is the request's secret (`apps.bus.roles`).
                    log.info("requester not listening; waiting for it",
                             extra={"attempt": self.attempt, "grace_s": self.grace_s})
                if now - unanswered_since >= self.grace_s:
                    return Verdict.GONE
                continue  # its gateway may be reconnecting through a NATS outage
            except (TimeoutError, nats.errors.Error):
                continue  # slow, or our own connection reconnecting: it says nothing of the requester
            unanswered_since = None
            if answer.data == topology.ATTEMPT_TAKEN:
                return Verdict.TAKEN


class _Watch:
    """One running attempt's probe in `HomeProbes`: its verdict comes through `verdict`."""

    __slots__ = ("attempt", "grace_s", "token", "unanswered_since", "verdict")

    def __init__(self, token: str, attempt: int, grace_s: float) -> None:
        self.token, self.attempt, self.grace_s = token, attempt, grace_s
        self.unanswered_since: float | None = None
        self.verdict: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()

    def decide(self, verdict: Verdict) -> None:
        if not self.verdict.done():
            self.verdict.set_result(verdict)


class HomeProbes:
    """The alive probes of one connection's running attempts whose requesters are gateway
    connections: every `PROBE_S`, one request per home naming all of them (in chunks of
    `MAX_ASKS_PER_PROBE`), instead of one per attempt. Verdicts as `RequesterProbe.watch`'s: taken
    at once, gone at once when the gateway says it no longer holds the token, or after `grace_s`
    of no responders (the gateway connection itself gone, or reconnecting)."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self._watching: dict[str, dict[_Watch, None]] = {}
        self._task: asyncio.Task[None] | None = None

    async def watch(self, home: str, token: str, attempt: int, grace_s: float) -> Verdict:
        watch = _Watch(token, attempt, grace_s)
        self._watching.setdefault(home, {})[watch] = None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe_forever())
            self._task.add_done_callback(_note_probe_failure)
        try:
            return await watch.verdict
        finally:
            watches = self._watching.get(home)
            if watches is not None:
                watches.pop(watch, None)
                if not watches:
                    del self._watching[home]

    async def _probe_forever(self) -> None:
        while self._watching:
            await asyncio.sleep(PROBE_S)
            homes = [(home, list(watches)) for home, watches in self._watching.items()]
            await asyncio.gather(*(self._probe(home, watches[i:i + MAX_ASKS_PER_PROBE])
                                   for home, watches in homes for i in range(0, len(watches), MAX_ASKS_PER_PROBE)))

    async def _probe(self, home: str, watches: list[_Watch]) -> None:
        asks = bundles.encode_probe([(watch.token, watch.attempt) for watch in watches])
        try:
            answer = await self.nc.request(bundles.home_alive_subject(home), asks, timeout=max(PROBE_S, 1.0))
            verdicts = bundles.decode_verdicts(answer.data)
        except nats.errors.NoRespondersError:
            now = time.monotonic()
            newly = [watch for watch in watches if watch.unanswered_since is None]
            if newly:
                log.info("requester not listening; waiting for it", extra={"attempts": len(newly)})
            for watch in watches:
                watch.unanswered_since = watch.unanswered_since or now
                if now - watch.unanswered_since >= watch.grace_s:
                    watch.decide(Verdict.GONE)
            return  # its gateway may be reconnecting through a NATS outage
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError):
            return  # slow, our own connection reconnecting, or not an answer: nothing of the requester
        for watch, verdict in zip(watches, verdicts, strict=False):
            watch.unanswered_since = None
            if verdict == bundles.TAKEN:
                watch.decide(Verdict.TAKEN)
            elif verdict == bundles.GONE:
                watch.decide(Verdict.GONE)


def _note_probe_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("alive probes stopped", exc_info=task.exception())


# The one `HomeProbes` of a connection (every run on it shares it).
home_probes_of = one_per_connection(HomeProbes)


async def still_wanted(nc: NatsClient, reply_subject: str, attempt: int) -> bool:
    """Ask the requester whether this redelivered attempt may run (another may have sent text)."""
    try:
        answer = await nc.request(topology.alive_subject(reply_subject), str(attempt).encode(),
                                  timeout=ATTEMPT_CHECK_S)
    except nats.errors.NoRespondersError:
        return False  # the requester is gone
    except (TimeoutError, nats.errors.Error):
        return True  # slow is not gone
    return answer.data != topology.ATTEMPT_TAKEN


class Cancellations:
    """The node's cancellation listener: a held request is aborted at once through `abort_held`
    (which says whether some model held it); any other id is remembered, so a request cancelled
    before it was pulled is dropped when it is (`request_id in cancellations`)."""

    def __init__(self, abort_held: Callable[[str], Awaitable[bool]], remember: int = REMEMBERED_CANCELS) -> None:
        self._abort_held = abort_held
        self._remember = remember
        self._unpulled: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def subscribe(self, nc: NatsClient) -> Subscription:
        return await nc.subscribe(topology.cancel_wildcard(), cb=self._on_cancel)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._unpulled

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = topology.request_id_from_cancel(msg.subject)
        if await self._abort_held(request_id):
            log.info("cancelling", extra={"request_id": request_id})
            return
        self._unpulled[request_id] = None
        while len(self._unpulled) > self._remember:
            self._unpulled.popitem(last=False)
