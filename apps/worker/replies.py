"""Frames from a worker to the client waiting on one request's reply subject."""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

from apps.bus import wire


class Replier:
    """Numbers frames per attempt, so the gateway can drop repeats and spot a fresh attempt."""

    def __init__(self, nc: NatsClient, subject: str, attempt: int, node: str) -> None:
        self.nc = nc
        self.subject = subject
        self.attempt = attempt
        self.node = node
        self._seq = 0
        self.sent_tokens = False

    async def _send(self, frame: wire.ReplyFrame) -> None:
        self._seq += 1
        await self.nc.publish(self.subject, wire.encode(frame))

    def _next(self) -> dict[str, int]:
        return {"seq": self._seq, "attempt": self.attempt}

    async def accepted(self, prompt_tokens: int) -> None:
        await self._send(wire.Accepted(**self._next(), node=self.node, prompt_tokens=prompt_tokens))

    async def delta(
        self,
        text: str,
        num_tokens: int,
        index: int = 0,
        finish_reason: str | None = None,
        reasoning: str = "",
        tool_calls: list[wire.ToolCallDelta] | None = None,
        logprobs: list[wire.TokenLogprobs] | None = None,
        stop_sequence: str | None = None,
    ) -> None:
        self.sent_tokens = self.sent_tokens or bool(text or reasoning or tool_calls)
        await self._send(
            wire.Delta(
                **self._next(), text=text, num_tokens=num_tokens, index=index, finish_reason=finish_reason,
                reasoning=reasoning, tool_calls=tool_calls or [], logprobs=logprobs, stop_sequence=stop_sequence,
            )
        )

    async def heartbeat(self) -> None:
        await self._send(wire.Heartbeat(**self._next()))

    async def final(self, finish_reason: str, usage: wire.Usage) -> None:
        await self._send(wire.Final(**self._next(), finish_reason=finish_reason, usage=usage))

    async def error(self, status: int, code: str, message: str) -> None:
        await self._send(wire.ErrorFrame(**self._next(), status=status, code=code, message=message))
