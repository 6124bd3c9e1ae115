"""Serving one bus request: template, tokenize, check limits, generate, stream frames, record.

This is the worker's asyncio side: the engine does the torch work elsewhere and hands back
token ids; here they become text (incrementally, stop strings held back) and frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

from jinja2 import TemplateError

from apps.bus import wire
from apps.worker.replies import Replier
from apps.worker.stop_strings import StopStringMatcher
from engine.api import Engine, EngineRequest, FinishReason, SamplingOptions
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("helexa.worker")


class RequestRejected(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True)
class RunRecord:
    """What the ledger learns about one run, filled in as it goes."""

    request: wire.GenerateRequest
    node: str
    attempt: int
    received_at: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def queue_ms(self) -> float:
        return max(self.received_at - self.request.created_at, 0.0) * 1000.0

    def usage(self) -> wire.Usage:
        decode_ms = ((self.finished_at or time.time()) - self.first_token_at) * 1000.0 if self.first_token_at else 0.0
        return wire.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            queue_ms=round(self.queue_ms, 3),
            prefill_ms=round(self.prefill_ms, 3),
            decode_ms=round(decode_ms, 3),
        )

    def started_event(self) -> wire.RunStarted:
        return wire.RunStarted(
            model=self.request.model,
            node=self.node,
            request_id=self.request.request_id,
            api=self.request.api,
            principal=self.request.principal,
            prompt_tokens=self.prompt_tokens,
            attempt=self.attempt,
            queue_ms=round(self.queue_ms, 3),
        )

    def finished_event(self, status: str, finish_reason: str, error: str | None = None) -> wire.RunFinished:
        end = self.finished_at or time.time()
        usage = self.usage()
        ttft = (self.first_token_at - self.request.created_at) * 1000.0 if self.first_token_at else None
        return wire.RunFinished(
            model=self.request.model,
            node=self.node,
            request_id=self.request.request_id,
            api=self.request.api,
            principal=self.request.principal,
            status=status,
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            attempt=self.attempt,
            queue_ms=usage.queue_ms,
            ttft_ms=round(ttft, 3) if ttft is not None else None,
            prefill_ms=usage.prefill_ms,
            decode_ms=usage.decode_ms,
            e2e_ms=round((end - self.request.created_at) * 1000.0, 3),
            error=error,
        )


def prompt_token_ids(tokenizer: Tokenizer, request: wire.GenerateRequest) -> list[int]:
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except TemplateError as exc:
            raise RequestRejected(400, "invalid_messages", f"The messages do not fit the model's chat template: {exc}")
        # The template already places any BOS the model expects.
        return tokenizer.encode(text, add_special_tokens=False)
    if request.prompt is not None:
        return tokenizer.encode(request.prompt, add_special_tokens=True)
    raise RequestRejected(400, "invalid_request", "The request has neither messages nor a prompt.")


def sampling_options(request: wire.GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingOptions:
    room = max_model_len - num_prompt_tokens
    wanted = request.sampling.max_tokens
    if room <= 0 or (wanted is not None and wanted > room):
        requested = num_prompt_tokens + (wanted or 1)
        raise RequestRejected(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the messages, {wanted or 1} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    s = request.sampling
    return SamplingOptions(
        max_tokens=wanted if wanted is not None else room,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=min(s.min_tokens, wanted if wanted is not None else room),
        logprobs=s.logprobs,
    )


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """One engine request per choice; a single choice keeps the bus request's id."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


def choice_sampling(sampling: SamplingOptions, index: int) -> SamplingOptions:
    # Each choice draws from its own seed, so n choices differ yet each stays reproducible.
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


async def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    prompt_ids: list[int],
    sampling: SamplingOptions,
) -> tuple[list[str], str | None]:
    """Run every choice and stream its text; returns (finish reason per choice, error)."""
    ids = engine_request_ids(record.request.request_id, record.request.sampling.n)
    choices = [
        generate_choice(engine, tokenizer, replier, record, EngineRequest(rid, prompt_ids, choice_sampling(sampling, i)), i)
        for i, rid in enumerate(ids)
    ]
    results = await asyncio.gather(*choices)
    errors = [error for _, error in results if error]
    return [reason for reason, _ in results], (errors[0] if errors else None)


async def generate_choice(
    engine: Engine,
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    engine_request: EngineRequest,
    index: int,
) -> tuple[str, str | None]:
    """One choice: detokenize incrementally, hold back possible stop strings, close with its reason."""
    detokenizer = IncrementalDetokenizer(tokenizer, engine_request.prompt_token_ids)
    stops = StopStringMatcher(record.request.sampling.stop)
    reason, error = FinishReason.ABORT.value, None
    async with contextlib.aclosing(engine.generate(engine_request)) as outputs:
        async for out in outputs:
            if out.prefill_ms is not None and index == 0:
                record.prefill_ms = out.prefill_ms
                record.cached_tokens = out.num_cached_tokens
            if out.new_token_ids:
                record.first_token_at = record.first_token_at or time.time()
                record.completion_tokens += len(out.new_token_ids)
                text, hit_stop = stops.feed(detokenizer.step(out.new_token_ids))
                if text:
                    await replier.delta(text, len(out.new_token_ids), index=index)
                if hit_stop:
                    reason = FinishReason.STOP.value
                    break
            if out.finished:
                if out.finish_reason is FinishReason.ERROR:
                    return FinishReason.ERROR.value, out.error or "engine error"
                tail = stops.flush()
                if tail:
                    await replier.delta(tail, 0, index=index)
                reason = (out.finish_reason or FinishReason.STOP).value
    await replier.delta("", 0, index=index, finish_reason=reason)
    return reason, error


async def keep_alive(replier: Replier, interval_s: float, touch: object) -> None:
    """Heartbeats for the gateway and in-progress acks for JetStream while a run is going."""
    while True:
        await asyncio.sleep(interval_s)
        await replier.heartbeat()
        await touch()  # type: ignore[operator]
