"""One request's run on a worker: template, tokenize, check limits, generate, stream frames, record.

`run_request` is the whole life of one attempt once the model loop has taken it: a poisoned model
refuses at once; the prompt is rendered and tokenized and max_tokens resolved against the context
(a refusal is the request's own 4xx; any other failure there is an error frame and the message is
terminated, never left to be redelivered); then the `Accepted` frame and the `run.started` event, the
generation of every choice with its text streamed as it comes, and the final (or error) frame.
It returns a `RunOutcome`: the `run.finished` event, which the model loop publishes before it
settles the message, and whether to terminate the message rather than ack it.

A migrated request (`GenerateRequest.resume`) continues each choice after the tokens its client
already has: the engine recomputes them after the prompt, and the text pipeline (`ChoiceText`) is
fed them first without sending anything, so the client gets no text twice and none is missing.

This is the worker's asyncio side: the engine does the torch work elsewhere and hands back token
ids; here they become text (incrementally, stop strings held back) and frames, each delta naming
the token ids it accounts for (`Delta.token_ids`), so a requester can resume from them. A device fault is
the only failure that changes shared state: it poisons the model through its `ModelHealth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from apps.bus import wire
from apps.bus.codes import ErrorCode, RunStatus, ServingError
from apps.bus.publish import publish_event
from apps.worker import liveness
from apps.worker.context_limit import ContextLimit
from apps.worker.parsers import Parsed
from apps.worker.prompt import Prompt, build_prompt, check_resume, resolve_sampling
from apps.worker.replies import Replier
from apps.worker.stop_strings import StopStringMatcher
from engine.protocol import (
    DeviceFault,
    Engine,
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenLogprob,
    is_device_fault,
)
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("helexa.worker")


def poisoned_message(model: str) -> str:
    return (f"The model '{model}' hit a device fault on this worker and is out of service; "
            f"reload it (helexa models load {model}).")


@dataclass(slots=True)
class ModelHealth:
    """Whether a model may serve. Only a device fault takes it out of service, until it is
    reloaded; `changed` is set so the worker refreshes its node entry now, not at the next tick."""

    model_id: str
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    poisoned: str | None = None

    def poison(self, detail: str) -> None:
        """Out of service until reloaded: the device's state can no longer be trusted."""
        if self.poisoned is None:
            log.error("device fault: model poisoned", extra={"model": self.model_id, "error": detail})
            self.poisoned = detail
            self.changed.set()


@dataclass(slots=True, frozen=True)
class ServedModel:
    """What a run uses of the model it runs on."""

    model_id: str
    engine: Engine
    tokenizer: Tokenizer
    context: ContextLimit
    health: ModelHealth
    reasoning_parser: str = "auto"


@dataclass(slots=True, frozen=True)
class RunOutcome:
    """How a run ended: the ledger's event (`finished.served` False: this attempt lost its
    request to another, whose message it must leave alone), and whether the message must be
    terminated rather than acked (a request no worker could prepare: it must not come back, nor
    wait for it)."""

    finished: wire.RunFinished
    terminate: bool = False


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
    reasoning_tokens: int = 0
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
            reasoning_tokens=self.reasoning_tokens,
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

    def finished_event(self, status: RunStatus, finish_reason: FinishReason,
                       error: str | None = None, served: bool = True) -> wire.RunFinished:
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
            reasoning_tokens=self.reasoning_tokens,
            served=served,
        )


# Prompts longer than this (in characters) are prepared in a thread.
LARGE_PROMPT_CHARS = 1 << 18


def _prompt_chars(request: wire.GenerateRequest) -> int:
    return len(request.prompt or "") + sum(len(m.content) for m in request.messages or [])


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """One engine request per choice; a single choice keeps the bus request's id."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


async def abort_request(engine: Engine, request: wire.GenerateRequest) -> None:
    """Abort every choice of `request` (idempotent: a finished or unknown id is no-op)."""
    for engine_request_id in engine_request_ids(request.request_id, request.sampling.n):
        await engine.abort(engine_request_id)


async def run_request(model: ServedModel, request: wire.GenerateRequest, replier: Replier, *, attempt: int,
                      node: str, js: JetStreamContext, probe: liveness.RequesterProbe | None = None) -> RunOutcome:
    """Serve one request through `replier` and say how it ended, for the ledger and the message.

    With `probe`, the requester is probed while the run goes: the run is aborted when it is gone,
    and stopped and silenced when another attempt serves its client. A run whose replier was
    silenced (that, or the worker handed it back) records that it did not serve (`served=False`).
    """
    record = RunRecord(request=request, node=node, attempt=attempt, received_at=time.time())
    if model.health.poisoned is not None:
        await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(model.model_id))
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, ErrorCode.MODEL_POISONED))
    try:
        if _prompt_chars(request) > LARGE_PROMPT_CHARS:
            # Templating and tokenizing megabytes takes seconds: off the loop, so the other
            # streams' frames and every request's heartbeats keep going meanwhile.
            prompt = await asyncio.to_thread(build_prompt, model.tokenizer, request, model.reasoning_parser)
        else:
            prompt = build_prompt(model.tokenizer, request, model.reasoning_parser)
        record.prompt_tokens = len(prompt.token_ids)
        sampling = resolve_sampling(request, len(prompt.token_ids), model.context.derive().context)
        check_resume(request, model.tokenizer.vocab_size)
    except ServingError as exc:
        await replier.error(exc.status, exc.code or ErrorCode.INVALID_REQUEST, exc.message)
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, exc.code))
    except Exception as exc:  # a template or tokenizer that breaks on this request: its own failure
        log.exception("preparing the request failed", extra={"request_id": request.request_id})
        await replier.error(500, ErrorCode.INTERNAL_ERROR, "The worker could not prepare a prompt from this request.")
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, type(exc).__name__),
                          terminate=True)
    await replier.accepted(len(prompt.token_ids))
    await publish_event(js, record.started_event())
    watcher = None
    if probe is not None:
        watcher = asyncio.create_task(_follow_requester(probe, model.engine, request, replier))
    error: str | None
    try:
        reasons, error = await generate(model.engine, model.tokenizer, replier, record, prompt, sampling)
        finish_reason = reasons[0]
        if is_device_fault(error):
            model.health.poison(error or "device fault")
            error = ErrorCode.DEVICE_FAULT
    except DeviceFault as exc:
        model.health.poison(str(exc) or "device fault")
        finish_reason, error = FinishReason.ERROR, ErrorCode.DEVICE_FAULT
        await abort_request(model.engine, request)
    except Exception as exc:  # the run fails, the worker goes on
        log.exception("generation failed", extra={"request_id": request.request_id})
        finish_reason, error = FinishReason.ERROR, type(exc).__name__
        await abort_request(model.engine, request)
    finally:
        if watcher is not None:
            watcher.cancel()
    record.finished_at = time.time()
    model.context.observe_prefill(record.prompt_tokens - record.cached_tokens, record.prefill_ms)
    if replier.silenced is not None:
        # Another attempt serves the client, or the worker handed the request back before any text
        # (a cancellation); a stream the stopping worker cut short is a failed one.
        cut_short = replier.silenced == ErrorCode.WORKER_STOPPING and replier.sent_tokens
        status = RunStatus.ERROR if cut_short else RunStatus.CANCELLED
        return RunOutcome(record.finished_event(status, finish_reason, error or replier.silenced, served=False))
    if error == ErrorCode.DEVICE_FAULT:
        await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(model.model_id))
        return RunOutcome(record.finished_event(RunStatus.ERROR, finish_reason, error))
    if error is not None:
        await replier.error(500, ErrorCode.GENERATION_FAILED, "The generation failed on the worker.")
        return RunOutcome(record.finished_event(RunStatus.ERROR, finish_reason, error))
    await replier.final(finish_reason, record.usage())
    status = RunStatus.CANCELLED if finish_reason == FinishReason.ABORT else RunStatus.OK
    return RunOutcome(record.finished_event(status, finish_reason))


async def _follow_requester(probe: liveness.RequesterProbe, engine: Engine, request: wire.GenerateRequest,
                            replier: Replier) -> None:
    verdict = await probe.watch()
    if verdict is liveness.Verdict.TAKEN:
        log.info("another attempt serves this request; this one stops",
                 extra={"request_id": request.request_id, "attempt": probe.attempt})
        replier.silence(ErrorCode.ATTEMPT_TAKEN)
    else:
        log.info("requester gone; aborting", extra={"request_id": request.request_id})
    await abort_request(engine, request)


async def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    prompt: Prompt,
    sampling: SamplingParams,
) -> tuple[list[FinishReason], str | None]:
    """Run every choice and stream its text; returns (finish reason per choice, error)."""
    request = record.request
    ids = engine_request_ids(request.request_id, request.sampling.n)
    resume = request.resume or [wire.ResumedChoice() for _ in ids]
    choices = [
        generate_choice(engine, tokenizer, replier, record, prompt,
                        EngineRequest(rid, prompt.token_ids, sampling.for_choice(i), resume[i].token_ids),
                        i, resume[i].finish_reason)
        for i, rid in enumerate(ids)
    ]
    results = await asyncio.gather(*choices)
    errors = [error for _, error in results if error]
    return [reason for reason, _ in results], (errors[0] if errors else None)


def wire_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> list[wire.TokenLogprobs]:
    def described(token_id: int) -> tuple[str, list[int]]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    out = []
    for entry in entries:
        token, raw = described(entry.token_id)
        top = [(t, round(lp, 6), b) for t, b, lp in ((*described(i), lp) for i, lp in entry.top)]
        out.append(wire.TokenLogprobs(token=token, logprob=round(entry.logprob, 6), bytes=raw, top=top))
    return out


class ChoiceText:
    """One choice's token ids becoming what its client is sent: incremental detokenizing, stop
    strings held back, reasoning and tool calls split out. Each stage's output is a function of
    the tokens fed so far, however they were chunked, so feeding a migrated answer's tokens
    (`prime`) puts a new worker exactly where the first one was."""

    def __init__(self, tokenizer: Tokenizer, prompt: Prompt, stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt.token_ids)
        self.stops = StopStringMatcher(stop)
        self.parser = prompt.output_parser()

    def feed(self, token_ids: list[int]) -> tuple[Parsed, bool]:
        """New tokens in; (what may be sent now, whether a stop string ended the choice) out."""
        text, hit_stop = self.stops.feed(self.detokenizer.step(token_ids))
        return self.parser.feed(text), hit_stop

    def end(self) -> tuple[Parsed, bool]:
        """The generation ended: the detokenizer's held-back tail (a stop string may end inside
        it), then whatever stop strings held back when none matched."""
        text, hit_stop = self.stops.feed(self.detokenizer.flush())
        return self.parser.feed(text if hit_stop else text + self.stops.flush()), hit_stop

    def prime(self, token_ids: list[int]) -> tuple[int, bool]:
        """Feed tokens the client already has, one at a time as a generation would, sending
        nothing; returns (how many were reasoning, whether they had hit a stop string)."""
        reasoning = 0
        for token_id in token_ids:
            reasoning += self.parser.in_reasoning
            _, hit_stop = self.feed([token_id])
            if hit_stop:
                return reasoning, True
        return reasoning, False


async def generate_choice(
    engine: Engine,
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    prompt: Prompt,
    engine_request: EngineRequest,
    index: int,
    resumed_finish: FinishReason | None = None,
) -> tuple[FinishReason, str | None]:
    """One choice: stream its text as it comes and close it. A migrated choice (its
    `resumed_token_ids` already sent) goes on after them; one already finished is not run again."""
    choice = ChoiceText(tokenizer, prompt, record.request.sampling.stop)
    pending_logprobs: list[wire.TokenLogprobs] = []
    # Tokens fed since the last delta: the next delta names them, so the requester knows what it has.
    pending_ids: list[int] = []

    async def send(parsed: Parsed, finish_reason: FinishReason | None = None) -> None:
        nonlocal pending_logprobs, pending_ids
        if not (parsed or finish_reason or pending_logprobs):
            return
        await replier.delta(parsed.content, len(pending_ids), index=index, finish_reason=finish_reason,
                            reasoning=parsed.reasoning, tool_calls=parsed.tool_calls,
                            logprobs=pending_logprobs or None,
                            stop_sequence=choice.stops.matched if finish_reason else None,
                            token_ids=pending_ids)
        pending_logprobs, pending_ids = [], []

    resumed = engine_request.resumed_token_ids
    record.completion_tokens += len(resumed)
    resumed_reasoning, hit_stop = choice.prime(resumed)
    record.reasoning_tokens += resumed_reasoning
    if resumed_finish is not None:
        return resumed_finish, None  # its client has its whole text and its finish already
    # Its first worker may have died right after a stop string came: then it is over.
    reason = FinishReason.STOP if hit_stop else FinishReason.ABORT
    if not hit_stop:
        async with contextlib.aclosing(engine.generate(engine_request)) as outputs:
            async for out in outputs:
                if out.prefill_ms is not None and index == 0:
                    record.prefill_ms = out.prefill_ms
                    # What the prefix cache held beyond the prompt (a resumed answer's tokens) is not prompt.
                    record.cached_tokens = min(out.num_cached_tokens, record.prompt_tokens)
                if out.new_token_ids:
                    record.first_token_at = record.first_token_at or time.time()
                    record.completion_tokens += len(out.new_token_ids)
                    if choice.parser.in_reasoning:
                        record.reasoning_tokens += len(out.new_token_ids)
                    if out.logprobs:
                        pending_logprobs += wire_logprobs(tokenizer, out.logprobs)
                    pending_ids += out.new_token_ids
                    parsed, hit_stop = choice.feed(out.new_token_ids)
                    await send(parsed)
                    if hit_stop:
                        reason = FinishReason.STOP
                        break
                if out.finished:
                    if out.finish_reason is FinishReason.ERROR:
                        return FinishReason.ERROR, out.error or "engine error"
                    reason = out.finish_reason or FinishReason.STOP
                    # The detokenizer may still hold the tail back (a character cut off by the
                    # end, or text it could not yet tell apart); it belongs to the answer, and a
                    # stop string may even end inside it.
                    parsed, hit_stop = choice.end()
                    if hit_stop:
                        reason = FinishReason.STOP
                    await send(parsed)
    if choice.parser.num_tool_calls and reason == FinishReason.STOP:
        reason = FinishReason.TOOL_CALLS
    await send(choice.parser.finish(), finish_reason=reason)
    return reason, None
