"""One streamed chat completion against any OpenAI-compatible server, timed from the client's side:
time to first generated token, gaps between generated chunks, usage and the optional
`helexa_timing` split our gateway adds to the final usage chunk."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from apps.bench.stats import decode_rate, is_generated, prefill_rate

# Statuses with which a server sheds load on purpose (admission), counted apart from failures.
SHED_STATUSES = (429, 503)


class StreamFailed(Exception):
    """The request failed: an HTTP error status (`status`), a broken stream, or no output."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def shed(self) -> bool:
        return self.status in SHED_STATUSES


@dataclass(slots=True)
class StreamResult:
    ttft_s: float
    total_s: float
    generated_chunks: int
    completion_tokens: int
    prompt_tokens: int | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    prefill_tokens: int | None = None
    last_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None

    @property
    def decode_tok_s(self) -> tuple[float | None, str | None]:
        return decode_rate(self.completion_tokens, self.decode_ms, self.generated_chunks, self.ttft_s, self.last_s)

    @property
    def prefill_tok_s(self) -> tuple[float | None, str | None]:
        return prefill_rate(self.prefill_tokens, self.prefill_ms, self.prompt_tokens, self.ttft_s)

    @property
    def queue_ms(self) -> float | None:
        """Time waiting before prefill began, approximated as TTFT − the server's prefill time."""
        if self.prefill_ms is None:
            return None
        return max(self.ttft_s * 1000 - self.prefill_ms, 0.0)

    def metrics(self) -> dict[str, Any]:
        """The per-sample numbers kept in a bench run's results."""
        decode, decode_source = self.decode_tok_s
        prefill, prefill_source = self.prefill_tok_s
        return {
            "ttft_ms": self.ttft_s * 1000,
            "e2e_ms": self.total_s * 1000,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "generated_chunks": self.generated_chunks,
            "decode_tok_s": decode,
            "decode_source": decode_source,
            "prefill_tok_s": prefill,
            "prefill_source": prefill_source,
            "queue_ms": self.queue_ms,
            "itl_ms_max": max(self.itl_s) * 1000 if self.itl_s else None,
            "finish_reason": self.finish_reason,
        }


def chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Streamed, greedy, with usage in the last chunk: the request every bench scenario sends."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(http: httpx.AsyncClient, body: dict[str, Any], timeout_s: float) -> StreamResult:
    """Send `body` to `/chat/completions` under `http`'s base URL and time the stream; `timeout_s`
    bounds the whole request, not each read."""
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    chunks = 0
    itl: list[float] = []
    text: list[str] = []
    reasoning: list[str] = []
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    try:
        async with (
            asyncio.timeout(timeout_s),
            http.stream("POST", "chat/completions", json=body, timeout=timeout_s) as response,
        ):
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:500]
                raise StreamFailed(f"HTTP {response.status_code}: {detail}", response.status_code)
            lines = response.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if chunk.get("error"):
                    raise StreamFailed(f"error in stream: {chunk['error']}")
                now = time.perf_counter() - start
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if is_generated(delta):
                        if last is not None:
                            itl.append(now - last)
                        first = now if first is None else first
                        last = now
                        chunks += 1
                        text.append(delta.get("content") or "")
                        reasoning.append(delta.get("reasoning_content") or "")
                    finish_reason = choice.get("finish_reason") or finish_reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        raise StreamFailed(f"{type(exc).__name__}: {exc}") from exc
    except TimeoutError:
        raise StreamFailed(f"no complete answer within {timeout_s:g} s") from None
    total = time.perf_counter() - start
    if first is None or last is None:
        raise StreamFailed("the stream ended without any generated content or reasoning")
    timing = (usage or {}).get("helexa_timing") or {}
    completion = (usage or {}).get("completion_tokens") or chunks
    return StreamResult(
        ttft_s=first,
        total_s=total,
        generated_chunks=chunks,
        completion_tokens=completion,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        prefill_ms=timing.get("prefill_ms"),
        decode_ms=timing.get("decode_ms"),
        prefill_tokens=timing.get("prefill_tokens"),
        last_s=last,
        itl_s=itl,
        text="".join(text),
        reasoning="".join(reasoning),
        finish_reason=finish_reason,
    )


def http_client(base_url: str, api_key: str | None, concurrency: int = 64) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, limits=limits)
