"""The events of an EVENTS message that carries several (`apps.bus.events.event_parts`), each as
a message of its own that the recorder handles like any other, settled together.

A part has the subject, reply and headers of the message it came in, and its own event's bytes
as `data` (so a dead letter keeps the one event that failed). Its replies settle the message:
- `ack` or `term`: this part is done; once every part is, the message is acked (terminated when
  every part was: none of its events was recorded);
- `nak`: the message is nak'ed at once, and its later replies are ignored: it comes back whole,
  and the events of it already recorded are recorded again as no-ops (inserts are idempotent);
- `in_progress`: passed on, so the message is not redelivered while a part waits out an outage.
"""

from __future__ import annotations

from nats.aio.msg import Msg


class _Shared:
    """One message's settlement across its parts."""

    __slots__ = ("left", "msg", "nakd", "recorded")

    def __init__(self, msg: Msg, parts: int) -> None:
        self.msg, self.left, self.recorded, self.nakd = msg, parts, False, False

    async def done(self, recorded: bool) -> None:
        if self.nakd or self.left == 0:
            return
        self.left -= 1
        self.recorded = self.recorded or recorded
        if self.left == 0:
            await (self.msg.ack() if self.recorded else self.msg.term())

    async def nak(self) -> None:
        if not self.nakd and self.left:
            self.nakd = True
            await self.msg.nak()


class Part(Msg):
    """One event of a message that carries several."""

    _shared: _Shared

    async def ack(self) -> None:
        await self._shared.done(recorded=True)

    async def term(self) -> None:
        await self._shared.done(recorded=False)

    async def nak(self, delay: float | None = None) -> None:
        await self._shared.nak()

    async def in_progress(self) -> None:
        await self._shared.msg.in_progress()


def split(msg: Msg, events: list[bytes]) -> list[Msg]:
    """`msg` as one message per encoded event: itself when it carries one."""
    if len(events) == 1:
        return [msg]
    shared = _Shared(msg, len(events))
    parts: list[Msg] = []
    for data in events:
        part = Part(msg._client, subject=msg.subject, reply=msg.reply, data=data, headers=msg.headers,
                    _metadata=msg._metadata)
        part._shared = shared
        parts.append(part)
    return parts
