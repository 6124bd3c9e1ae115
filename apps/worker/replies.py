"""Frames from a worker to the client waiting on one request's reply subject (or, for the
one-shot `generate` endpoint, kept in memory and answered at once).

Every frame is measured before it is sent (`apps.bus.publish.publish_core`): one the server would
refuse (a tool call's arguments past max_payload) is replaced by an error frame, so the client
learns its answer could not be delivered and the worker keeps its connection. Error messages are
bounded (`wire.bounded_text`).
"""

from __future__ import annotations

import logging

from nats.aio.client import Client as NatsClient

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason
from apps.bus.publish import TooLarge, publish_core

log = logging.getLogger("helexa.worker")


class Replier:
    """Numbers frames per attempt, so the gateway can drop repeats and spot a fresh attempt.

    An attempt that no longer speaks for its request (another attempt serves the client, or the
    worker handed the request back) is `silence`d: nothing more reaches the reply subject, and
    the run records that it did not serve.
    """

    def __init__(self, nc: NatsClient, subject: str, attempt: int, node: str) -> None:
        self.nc = nc
        self.subject = subject
        self.attempt = attempt
        self.node = node
        self._seq = 0
        # Whether the client has had text (content, reasoning or a tool call) from this attempt.
        self.sent_tokens = False
        # Why this attempt went silent (None: it still speaks to the client).
        self.silenced: ErrorCode | None = None

    def silence(self, reason: ErrorCode) -> None:
        if self.silenced is None:
            self.silenced = reason

    async def _send(self, frame: wire.ReplyFrame) -> None:
        if self.silenced is not None:
            return
        self._seq += 1
        try:
            await publish_core(self.nc, self.subject, wire.encode(frame))
        except TooLarge as exc:
            log.warning("reply frame too large for the bus; the client gets an error instead",
                        extra={"subject": self.subject, "size": exc.size, "max_payload": exc.limit})
            error = wire.ErrorFrame(seq=frame.seq, attempt=self.attempt, status=500, code=ErrorCode.GENERATION_FAILED,
                                    message=f"A part of the answer ({exc.size} bytes) is larger than the message "
                                            f"bus carries ({exc.limit} bytes).")
            # In the refused frame's place in the sequence; the gateway ends the answer and cancels the run.
            await publish_core(self.nc, self.subject, wire.encode(error))

    def _next(self) -> dict[str, int]:
        return {"seq": self._seq, "attempt": self.attempt}

    async def accepted(self, prompt_tokens: int) -> None:
        await self._send(wire.Accepted(**self._next(), node=self.node, prompt_tokens=prompt_tokens))

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
        self.sent_tokens = self.sent_tokens or bool(text or reasoning or tool_calls)
        await self._send(
            wire.Delta(
                **self._next(), text=text, num_tokens=num_tokens, index=index, finish_reason=finish_reason,
                reasoning=reasoning, tool_calls=tool_calls or [], logprobs=logprobs, stop_sequence=stop_sequence,
                token_ids=token_ids or [],
            )
        )

    async def heartbeat(self) -> None:
        await self._send(wire.Heartbeat(**self._next()))

    async def final(self, finish_reason: FinishReason, usage: wire.Usage) -> None:
        await self._send(wire.Final(**self._next(), finish_reason=finish_reason, usage=usage))

    async def error(self, status: int, code: ErrorCode, message: str) -> None:
        await self._send(wire.ErrorFrame(**self._next(), status=status, code=code, message=wire.bounded_text(message)))


class CollectingReplier(Replier):
    """Frames kept in memory: for the request-reply `generate` endpoint, which answers once."""

    def __init__(self, attempt: int, node: str) -> None:
        super().__init__(None, "", attempt, node)  # type: ignore[arg-type]  # no bus: frames stay here
        self.frames: list[wire.ReplyFrame] = []

    async def _send(self, frame: wire.ReplyFrame) -> None:
        if self.silenced is not None:
            return
        self._seq += 1
        self.frames.append(frame)
