"""Frames from a worker to the client waiting on one request's reply subject (or, for the
one-shot `generate` endpoint, kept in memory and answered at once).

Text frames coalesce by design (`frame_window`: `apps.worker.frame_window`, paced by the engine's
steps, at least the worker's `HELEXA_FRAME_WINDOW_MS`): a
choice's first delta goes out at once, and after any frame the next deltas of the window are merged
into one frame (text, reasoning, token ids and logprobs joined in order, token counts summed) and
sent when the window closes (or sooner, with other streams' frames). A choice's last delta, a
tool call, the final and error frames and heartbeats first flush what is held, so nothing waits
longer than one window and no frame is reordered. At 100 tokens/s per stream and a 20 ms window
that is about one frame for every two or three tokens instead of one per token; an SSE chunk then
carries those tokens together, as OpenAI's own streams do.

Frames leave through the connection's `FrameOutbox` (`apps.worker.frame_outbox`): the windows of
all streams close together, and the frames one flush makes for one gateway share a message.

Every frame is measured before it is handed on (`apps.bus.publish.fits`): one the server would
refuse (a tool call's arguments past max_payload) is replaced by an error frame, so the client
learns its answer could not be delivered and the worker keeps its connection. That error frame
ends the attempt (`undeliverable`): nothing follows it, the run stops its choices and the ledger
records an error, not an answer. Error messages are bounded (`wire.bounded_text`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client as NatsClient

from apps.bus import bundles, wire
from apps.bus.codes import ErrorCode, FinishReason
from apps.bus.publish import fits, message_size
from apps.worker.frame_outbox import outbox_of
from apps.worker.frame_window import FrameWindow
from engine.frontend.protocol import HoldableOutputs

log = logging.getLogger("helexa.worker")


class Replier:
    """Numbers frames per attempt, so the gateway can drop repeats and spot a fresh attempt.

    An attempt that no longer speaks for its request (another attempt serves the client, or the
    worker handed the request back) is `silence`d: nothing more reaches the reply subject, and
    the run records that it did not serve.
    """

    def __init__(self, nc: NatsClient, subject: str, attempt: int, node: str,
                 frame_window: FrameWindow | float = 0.0) -> None:
        self.nc = nc
        self.subject = subject
        self.attempt = attempt
        self.node = node
        # The window (seconds, or the model's paced `FrameWindow`, read at each delta).
        self.frame_window = frame_window if isinstance(frame_window, FrameWindow) else FrameWindow(frame_window)
        self._seq = 0
        # Looked up once, not per frame: the connection's outbox (none for a CollectingReplier) and
        # where this subject's frames go in a bundle.
        self._outbox = outbox_of(nc) if nc is not None else None
        self._bundle_key = bundles.split_reply_subject(subject)
        # Whether the outbox is to wake this Replier when its window closes.
        self._waking = False
        # Choices' engine outputs held until the window closes (`hold_outputs`), by index, and the
        # choices whose held outputs were released when it closed: their next delta is sent at once.
        self._sources: dict[int, HoldableOutputs] = {}
        self._due: set[int] = set()
        # Deltas held for the window, merged per choice; when the last text frame went. The
        # connection's outbox wakes this Replier when the window closes.
        self._held: dict[int, _HeldDelta] = {}
        self._last_text_at: float | None = None
        # Whether the client has had text (content, reasoning or a tool call) from this attempt.
        self.sent_tokens = False
        # Why this attempt went silent (None: it still speaks to the client).
        self.silenced: ErrorCode | None = None
        # Whether the attempt's last frame (final or error) has gone: nothing follows it, not even
        # a heartbeat that raced the end.
        self.ended = False
        # Whether a frame was too large for the bus: an error frame went in its place and ended
        # the attempt, so the client's answer is incomplete.
        self.undeliverable = False

    def silence(self, reason: ErrorCode) -> None:
        if self.silenced is None:
            self.silenced = reason
            self._held.clear()
            self._stop_waking()

    def _speaks(self) -> bool:
        return self.silenced is None and not self.ended

    def _send(self, frame: wire.ReplyFrame) -> None:
        if not self._speaks():
            return
        self._seq += 1
        data = wire.encode(frame)
        if not fits(self.nc, data):
            size, limit = message_size(data, None), self.nc.max_payload
            log.warning("reply frame too large for the bus; the client gets an error instead",
                        extra={"subject": self.subject, "size": size, "max_payload": limit})
            # In the refused frame's place in the sequence, and the attempt's last frame.
            data = wire.encode(wire.ErrorFrame(
                seq=frame.seq, attempt=self.attempt, status=500, code=ErrorCode.GENERATION_FAILED,
                message=f"A part of the answer ({size} bytes) is larger than the message bus carries ({limit} bytes)."))
            self.undeliverable = self.ended = True
            self._held.clear()
            self._stop_waking()
        assert self._outbox is not None
        self._outbox.put(self.subject, data, self._bundle_key)

    def _next(self) -> dict[str, int]:
        return {"seq": self._seq, "attempt": self.attempt}

    async def accepted(self, prompt_tokens: int) -> None:
        self._send(wire.Accepted(**self._next(), node=self.node, prompt_tokens=prompt_tokens))
        await self._sent()

    async def delta(
        self,
        text: str,
        num_tokens: int,
        index: int = 0,
        finish_reason: FinishReason | None = None,
        reasoning: str = "",
        tool_calls: list[wire.ToolCallDelta] | None = None,
        logprobs: list[wire.TokenLogprobs] | None = None,
        stop_sequence: str | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        if self.silenced is not None or self.ended:  # `_speaks`, inline: once per token of every stream
            return
        now = time.monotonic()
        window_s = self.frame_window.at(now)
        window_open = (self._last_text_at is not None and now - self._last_text_at < window_s
                       and index not in self._due)
        if finish_reason is None and not tool_calls and window_open:
            held = self._held.get(index)
            if held is None:
                held = self._held[index] = _HeldDelta()
            held.add(text, num_tokens, reasoning, logprobs, token_ids)
            if not self._waking:  # once per window: the window closes when it closes
                assert self._last_text_at is not None and self._outbox is not None
                self._waking = True
                closes_in = self._last_text_at + window_s - now
                self._outbox.wake_at(self, asyncio.get_running_loop().time() + closes_in)
            return
        held = self._held.get(index)
        if held is not None:
            held.add(text, num_tokens, reasoning, logprobs, token_ids)
            self._flush(index, finish_reason=finish_reason, tool_calls=tool_calls, stop_sequence=stop_sequence)
        else:  # nothing held: this delta is the frame (most deltas, when the window is past)
            if not self._held:
                self._stop_waking()
            self._send_delta(index, text, reasoning, num_tokens, token_ids or [], logprobs,
                             finish_reason, tool_calls, stop_sequence)
        # A delta is on its way once put (the outbox sends it this loop turn); the run waits for
        # the connection only when the outbox falls behind. A frame lost on the bus is a gap the
        # gateway reports, and the run's final frame waits and learns of the error.
        if self._outbox is not None and self._outbox.backlogged:
            await self._outbox.send_now()

    def hold_outputs(self, index: int, outputs: HoldableOutputs) -> None:
        """Called after each of choice `index`'s engine outputs is fed: while this Replier's window
        is open, the choice's next outputs wait in the engine's queue instead of waking its run at
        every step, and come merged when the window closes (`window_closed`). Its run then wakes
        once a window and its text leaves, in the outbox's one flush, beside every other stream's."""
        if index in self._due:  # woken for the closed window, and its outputs made no delta
            self._due.discard(index)
            if index in self._held:
                self._flush(index)
        if self._outbox is None or self._last_text_at is None or not self._speaks():
            return
        now = time.monotonic()
        closes_in = self._last_text_at + self.frame_window.at(now) - now
        if closes_in <= 0:
            return
        outputs.hold()
        self._sources[index] = outputs
        if not self._waking:
            self._waking = True
            self._outbox.wake_at(self, asyncio.get_running_loop().time() + closes_in)

    def window_closed(self) -> None:
        """The outbox's timer (this window's close, or an earlier one's: windows close together).
        Held outputs are released: a choice that had more waiting wakes and sends its held text with
        them at once (`_due`), in the outbox's same flush; held text of a choice with nothing
        waiting goes now."""
        self._waking = False
        sources, self._sources = self._sources, {}
        for index, outputs in sources.items():
            if outputs.release():
                self._due.add(index)
        for index in sorted(self._held):
            if index not in self._due:
                self._flush(index)

    async def flush(self) -> None:
        """Send every held delta now (before a frame that must not overtake them)."""
        self.flush_held()
        await self._sent()

    async def _sent(self) -> None:
        if self._outbox is not None:
            await self._outbox.send_now()

    def flush_held(self) -> None:
        self._stop_waking()
        for index in sorted(self._held):
            self._flush(index)

    def _flush(self, index: int, finish_reason: FinishReason | None = None,
               tool_calls: list[wire.ToolCallDelta] | None = None, stop_sequence: str | None = None) -> None:
        held = self._held.pop(index, None)
        if not self._held:
            self._stop_waking()
        if held is None:
            return
        self._send_delta(index, "".join(held.text), "".join(held.reasoning), held.num_tokens, held.token_ids,
                         held.logprobs, finish_reason, tool_calls, stop_sequence)

    def _send_delta(self, index: int, text: str, reasoning: str, num_tokens: int, token_ids: list[int],
                    logprobs: list[wire.TokenLogprobs] | None, finish_reason: FinishReason | None = None,
                    tool_calls: list[wire.ToolCallDelta] | None = None, stop_sequence: str | None = None) -> None:
        """One Delta frame, unless it would carry nothing at all."""
        if not (num_tokens or token_ids or logprobs or text or reasoning or finish_reason or tool_calls):
            return
        self.sent_tokens = True  # any delta sent counts: its token ids are the client's too
        self._due.discard(index)
        self._last_text_at = time.monotonic()
        self._send(
            wire.Delta(
                **self._next(), text=text, num_tokens=num_tokens, index=index, finish_reason=finish_reason,
                reasoning=reasoning, tool_calls=tool_calls or [], logprobs=logprobs, stop_sequence=stop_sequence,
                token_ids=token_ids,
            )
        )

    def _stop_waking(self) -> None:
        if self._sources:  # their outputs must not wait for a wake-up that will not come
            sources, self._sources = self._sources, {}
            for outputs in sources.values():
                outputs.release()
        if self._waking:
            self._waking = False
            assert self._outbox is not None
            self._outbox.forget(self)

    async def heartbeat(self) -> None:
        self.flush_held()
        self._send(wire.Heartbeat(**self._next()))
        await self._sent()

    async def final(self, finish_reason: FinishReason, usage: wire.Usage) -> None:
        self.flush_held()
        self._send(wire.Final(**self._next(), finish_reason=finish_reason, usage=usage))
        self.ended = True
        await self._sent()

    async def error(self, status: int, code: ErrorCode, message: str) -> None:
        self.flush_held()
        self._send(wire.ErrorFrame(**self._next(), status=status, code=code, message=wire.bounded_text(message)))
        self.ended = True
        await self._sent()


class _HeldDelta:
    """One choice's deltas within a window, to be sent as one."""

    __slots__ = ("logprobs", "num_tokens", "reasoning", "text", "token_ids")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[wire.TokenLogprobs] | None = None

    def add(self, text: str, num_tokens: int, reasoning: str, logprobs: list[wire.TokenLogprobs] | None,
            token_ids: list[int] | None) -> None:
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.num_tokens += num_tokens
        self.token_ids.extend(token_ids or ())
        if logprobs is not None:
            self.logprobs = [*(self.logprobs or ()), *logprobs]

    def __bool__(self) -> bool:
        return bool(self.num_tokens or self.token_ids or self.logprobs or any(self.text) or any(self.reasoning))


class CollectingReplier(Replier):
    """Frames kept in memory: for the request-reply `generate` endpoint, which answers once."""

    def __init__(self, attempt: int, node: str) -> None:
        super().__init__(None, "", attempt, node)  # type: ignore[arg-type]  # no bus: frames stay here
        self.frames: list[wire.ReplyFrame] = []

    def _send(self, frame: wire.ReplyFrame) -> None:
        if not self._speaks():
            return
        self._seq += 1
        self.frames.append(frame)
