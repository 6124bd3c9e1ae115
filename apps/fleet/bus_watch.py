"""`helexa bus sub [SUBJECT]`: the messages on the bus as they pass, one line each, no NATS tools needed.

A line is the subject, the headers where a message has any (`Nats-Msg-Id` names the request a
queued message is), and the body: helexa's bodies are JSON and are shown as sent; anything else
is shown as a JSON string, or as its size when it is not text. The default subject, `helexa.>`,
covers requests, events, cancellations and the workers' endpoints; reply frames travel on inboxes
(`_INBOX.>`), which can be asked for by name.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TextIO

import msgspec
from nats.aio.msg import Msg

from apps.bus.connection import reached_server
from apps.fleet import operator


def format_message(subject: str, headers: dict[str, str] | None, data: bytes) -> str:
    """One line for one message: subject, headers (if any), body."""
    try:
        text = data.decode("utf-8")
        msgspec.json.decode(data)
        body = text if "\n" not in text else json.dumps(json.loads(text), ensure_ascii=False)
    except UnicodeDecodeError:
        body = f"<{len(data)} bytes, not text>"
    except msgspec.DecodeError:
        body = json.dumps(text, ensure_ascii=False)
    parts = [subject]
    if headers:
        parts.append(json.dumps(headers, ensure_ascii=False))
    parts.append(body)
    return " ".join(parts)


async def watch(url: str, subject: str, stop: asyncio.Event, out: TextIO = sys.stdout) -> None:
    """Print every message on `subject` until `stop` is set; Unreachable if NATS cannot be reached
    or goes away for good."""
    lost = asyncio.Event()

    async def closed() -> None:
        lost.set()

    nc = await operator.connect_nats(url, "helexa-bus-sub", closed_cb=closed)
    try:
        async def show(msg: Msg) -> None:
            out.write(format_message(msg.subject, msg.headers, msg.data) + "\n")
            out.flush()

        await nc.subscribe(subject, cb=show)
        await reached_server(nc)
        # On stderr, so that stdout holds only messages: from here on nothing on `subject` is missed.
        print(f"watching {subject} on {operator.without_password(url)} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        stopping, closing = asyncio.create_task(stop.wait()), asyncio.create_task(lost.wait())
        await asyncio.wait({stopping, closing}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        closing.cancel()
        if lost.is_set() and not stop.is_set():
            raise operator.Unreachable(f"helexa bus sub: lost NATS at {operator.without_password(url)}")
    finally:
        if not nc.is_closed:
            await nc.close()
