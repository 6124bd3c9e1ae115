"""Client-side load for the CPU peer benchmark: streamed greedy completions through the OpenAI SDK.

One request: `/v1/completions` with the prompt as token ids (so every server sees exactly the same
128 tokens), `max_tokens`, temperature 0, `ignore_eos`, streamed with a usage chunk. Timing is the
client's: time to the first chunk with text, gaps between chunks with text, the end. The same code
drives vLLM and helexa, so neither gets a different clock.

TTFT is taken twice: from the SDK call (what a caller waits) and from the moment the request's
body goes to the socket (httpcore's `trace` extension, "send_request_body.started": the write
follows it with no await in between; the headers went out before, and a server can do nothing
with them alone). Sixteen streams on one event loop queue behind each other's ~2 ms of request
building: each writes its headers, yields, and writes its body only after the other streams have
built theirs. So the first TTFT includes the client's own queue; the second is the server's share,
from the whole request being on the wire to its first text arriving.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient


@dataclass(slots=True)
class StreamTiming:
    prompt_index: int
    start: float = 0.0
    sent: float | None = None  # when the request's body went to the socket
    first: float | None = None
    end: float = 0.0
    gaps: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    response_id: str = ""  # the server's id of the completion (helexa's ledger keys runs by it)

    @property
    def first_text_at(self) -> float:
        """When the first text came (the end, for a stream that had none)."""
        return self.first if self.first is not None else self.end

    @property
    def sent_at(self) -> float:
        """When the body went to the socket (the call, where the trace did not report it)."""
        return self.sent or self.start

    @property
    def ttft(self) -> float:
        return self.first_text_at - self.start

    @property
    def ttft_from_sent(self) -> float:
        return self.first_text_at - self.sent_at


# The stream whose request this task is sending (each stream runs in its own task).
_sending: ContextVar[StreamTiming | None] = ContextVar("sending", default=None)


async def _clock_send(request: httpx.Request) -> None:
    """httpx request hook: ask httpcore to report this request's writes to its stream's timing."""
    timing = _sending.get()
    if timing is None:
        return

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.started" and timing.sent is None:
            timing.sent = time.perf_counter()

    request.extensions["trace"] = trace


@dataclass(slots=True)
class LoadResult:
    streams: list[StreamTiming]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_ms_median(self) -> float:
        return statistics.median(s.ttft for s in self.streams) * 1000

    @property
    def ttft_from_sent_ms_median(self) -> float:
        return statistics.median(s.ttft_from_sent for s in self.streams) * 1000

    @property
    def ttft_from_last_sent_ms_median(self) -> float:
        """TTFT from the moment the run's last request body went to the socket: the whole burst in
        the server's hands, as the in-process engine has it at its clock's start. What the client
        takes to send the burst (`send_spread_ms`) is left out; any server that prefills the burst
        as one batch waits for it."""
        last_sent = max(s.sent_at for s in self.streams)
        return statistics.median(s.first_text_at - last_sent for s in self.streams) * 1000

    @property
    def send_spread_ms(self) -> float:
        """From the first request body on the socket to the last."""
        sent = [s.sent_at for s in self.streams]
        return (max(sent) - min(sent)) * 1000

    @property
    def client_wait_ms_median(self) -> float:
        """From the SDK call to the request's body going to the socket."""
        return statistics.median(s.sent_at - s.start for s in self.streams) * 1000

    @property
    def itl_ms_median(self) -> float:
        gaps = [g for s in self.streams for g in s.gaps]
        return statistics.median(gaps) * 1000 if gaps else 0.0


async def one_stream(client: AsyncOpenAI, model: str, index: int, prompt: list[int],
                     max_tokens: int) -> StreamTiming:
    timing = StreamTiming(prompt_index=index, start=time.perf_counter())
    _sending.set(timing)
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    last = None
    parts = []
    async for chunk in stream:
        now = time.perf_counter()
        timing.response_id = timing.response_id or chunk.id
        if chunk.usage is not None:
            timing.completion_tokens = chunk.usage.completion_tokens
        text = "".join(choice.text or "" for choice in chunk.choices)
        if not text:
            continue
        parts.append(text)
        if last is None:
            timing.first = now
        else:
            timing.gaps.append(now - last)
        last = now
    timing.end = time.perf_counter()
    timing.text = "".join(parts)
    return timing


async def _sequential(client: AsyncOpenAI, model: str, prompts: list[list[int]],
                      max_tokens: int) -> LoadResult:
    start = time.perf_counter()
    streams = [await one_stream(client, model, i, p, max_tokens) for i, p in enumerate(prompts)]
    return LoadResult(streams, time.perf_counter() - start)


async def _concurrent(client: AsyncOpenAI, model: str, prompts: list[list[int]],
                      max_tokens: int) -> LoadResult:
    start = time.perf_counter()
    streams = await asyncio.gather(*(one_stream(client, model, i, p, max_tokens)
                                     for i, p in enumerate(prompts)))
    return LoadResult(list(streams), max(s.end for s in streams) - start)


class OpenAILoad:
    """Load on one server through one SDK client, kept from the warm-up through every measured
    run, as a long-lived client is: a fresh `AsyncOpenAI` spends ~35 ms before its first request
    leaves (measured here, on its first call; then ~2 ms a request), and every TTFT of a run with
    a fresh client paid that, whichever server it measured. One event loop runs all of it: the
    client's connections belong to it."""

    def __init__(self, base_url: str, model: str, keep_alive: bool = True) -> None:
        self.base_url, self.model = base_url, model
        # Without keep-alive every request asks for its own connection (`Connection: close`).
        self._headers = {} if keep_alive else {"Connection": "close"}
        self._runner = asyncio.Runner()
        self._client: AsyncOpenAI | None = None

    def __enter__(self) -> OpenAILoad:
        async def connect() -> AsyncOpenAI:
            return AsyncOpenAI(base_url=self.base_url, api_key="unused", timeout=600.0, max_retries=0,
                               default_headers=self._headers,
                               http_client=DefaultAsyncHttpxClient(event_hooks={"request": [_clock_send]}))

        self._client = self._runner.run(connect())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._client is not None:
                self._runner.run(self._client.close())
        finally:
            self._runner.close()

    def run(self, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> LoadResult:
        """All prompts at once (`concurrent`: one streaming request each) or one after another."""
        assert self._client is not None, "use OpenAILoad as a context manager"
        runner = _concurrent if concurrent else _sequential
        return self._runner.run(runner(self._client, self.model, prompts, max_tokens))
