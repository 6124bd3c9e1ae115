"""Generating the choices of one run and streaming their text: for each choice, an engine request
whose token ids become text (incremental detokenizing, stop strings held back and never sent,
reasoning and tool calls split out, `ChoiceText`) and delta frames, each naming the token ids it
accounts for (`Delta.token_ids`).

A migrated choice (its client already has some of it, `GenerateRequest.resume`) continues after
those tokens: the engine recomputes them after the prompt, and `ChoiceText` is fed them first
without sending anything, so the client gets no text twice and none is missing; a choice that had
already finished is not run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from apps.bus import wire
from apps.bus.codes import ErrorCode
from apps.worker.parsers import Parsed
from apps.worker.prompt import Prompt
from apps.worker.replies import Replier
from apps.worker.run_record import RunRecord
from apps.worker.stop_strings import StopStringMatcher
from engine.frontend.protocol import (
    Engine,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenLogprob,
    holdable,
)
from engine.frontend.tokenizer import IncrementalDetokenizer, Tokenizer


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """One engine request per choice; a single choice keeps the bus request's id."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


async def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    prompt: Prompt,
    sampling: SamplingParams,
) -> tuple[list[FinishReason], str | None]:
    """Run every choice and stream its text; returns (finish reason per choice, error).

    Every choice that runs is sent to the engine before anything here awaits: each await lets the
    worker's other requests (a burst's) take their turns first, which had spread their arrivals at
    the engine over milliseconds and past the batch window's gaps."""
    request = record.request
    ids = engine_request_ids(request.request_id, request.sampling.n)
    resume = request.resume or [wire.ResumedChoice() for _ in ids]
    primed = [await prime_choice(tokenizer, prompt, record, resumed) for resumed in resume]
    streams: list[EngineOutputs | None] = []
    try:
        for i, (rid, (_, ended)) in enumerate(zip(ids, primed, strict=True)):
            # The other choices follow at once; requests the gateway was still reading, soon.
            more_arriving = request.arriving > 0 or i < len(ids) - 1
            streams.append(None if ended else engine.generate(
                EngineRequest(rid, prompt.token_ids, sampling.for_choice(i), resume[i].token_ids, more_arriving,
                              request.service_class, request.priority, cache_salt=request.principal or "")))
        tasks = [asyncio.ensure_future(generate_choice(tokenizer, replier, record, choice, ended, outputs, i))
                 for i, ((choice, ended), outputs) in enumerate(zip(primed, streams, strict=True))]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # One choice raised (or the run was cancelled): the others stop too, none is left
            # waiting on a stream the `finally` below closes.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    finally:
        for outputs in streams:
            if outputs is not None:
                await outputs.aclose()  # a no-op for a stream its choice closed
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
        """New tokens in; (what may be sent now, whether the choice has ended: a stop string, or
        the one tool call a single-call reply may hold) out."""
        text, hit_stop = self.stops.feed(self.detokenizer.step(token_ids))
        parsed = self.parser.feed(text)
        return parsed, hit_stop or self.parser.done

    def feed_counting_reasoning(self, token_ids: list[int]) -> tuple[Parsed, bool, int]:
        """`feed`, and how many of the tokens were reasoning (fed while the parser was in it, as
        `prime` counts them). Where reasoning may start or end, several tokens that came merged in
        one output are fed one at a time, so the count never depends on how they were grouped."""
        parser = self.parser
        if len(token_ids) == 1 or not (parser.parse_reasoning or parser.in_reasoning):
            reasoning = len(token_ids) if parser.in_reasoning else 0
            return *self.feed(token_ids), reasoning
        parsed, reasoning = Parsed(), 0
        for token_id in token_ids:
            reasoning += parser.in_reasoning
            step, hit_stop = self.feed([token_id])
            parsed = _joined(parsed, step)
            if hit_stop:
                return parsed, True, reasoning
        return parsed, False, reasoning

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


def _joined(first: Parsed, then: Parsed) -> Parsed:
    if not first:
        return then
    return Parsed(first.content + then.content, first.reasoning + then.reasoning, first.tool_calls + then.tool_calls)


@dataclass(frozen=True, slots=True)
class Ended:
    """How a migrated choice ended before this attempt: `sent` when its client has its finish too."""

    reason: FinishReason
    sent: bool


# Resumed tokens fed to a choice's text between turns of the event loop (~16 µs a token: a
# choice resumed near a long context would otherwise hold the loop for seconds).
PRIME_CHUNK_TOKENS = 512


async def prime_choice(tokenizer: Tokenizer, prompt: Prompt, record: RunRecord,
                       resumed: wire.ResumedChoice) -> tuple[ChoiceText, Ended | None]:
    """A choice's text with what its client already has fed in (`resumed`: a migrated choice's
    tokens), and how it ended if it did: then it is not run again. Up to `PRIME_CHUNK_TOKENS` go
    in without an await; more are fed a chunk at a time, letting the loop go between chunks."""
    choice = ChoiceText(tokenizer, prompt, record.request.sampling.stop)
    record.completion_tokens += len(resumed.token_ids)
    resumed_reasoning, hit_stop = 0, False
    for start in range(0, len(resumed.token_ids), PRIME_CHUNK_TOKENS):
        if start:
            await asyncio.sleep(0)
        reasoning, hit_stop = choice.prime(resumed.token_ids[start:start + PRIME_CHUNK_TOKENS])
        resumed_reasoning += reasoning
        if hit_stop:
            break
    record.reasoning_tokens += resumed_reasoning
    if resumed.finish_reason is not None:
        return choice, Ended(resumed.finish_reason, sent=True)
    # Its first worker may have died right after a stop string came: then it is over.
    return choice, Ended(FinishReason.STOP, sent=False) if hit_stop else None


async def generate_choice(
    tokenizer: Tokenizer,
    replier: Replier,
    record: RunRecord,
    choice: ChoiceText,
    ended: Ended | None,
    outputs: EngineOutputs | None,
    index: int,
) -> tuple[FinishReason, str | None]:
    """One choice: stream its text from `outputs` as it comes and close it; one that `ended`
    already runs no engine request (`outputs` is None)."""
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

    if ended is not None and ended.sent:
        return ended.reason, None  # its client has its whole text and its finish already
    reason = ended.reason if ended is not None else FinishReason.ABORT
    # The core's outputs wait out the frame window in its queue (`Replier.hold_outputs`).
    held_outputs = holdable(outputs) if outputs is not None else None
    if outputs is not None:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.prefill_ms is not None and index == 0:
                    record.prefill_ms = out.prefill_ms
                    # What the prefix cache held beyond the prompt (a resumed answer's tokens) is not prompt.
                    record.cached_tokens = min(out.num_cached_tokens, record.prompt_tokens)
                    resumed = len(record.request.resume[0].token_ids) if record.request.resume else 0
                    record.prefilled_tokens = max(record.prompt_tokens + resumed - out.num_cached_tokens, 0)
                if out.preempted is not None:
                    record.preempted(out.preempted, out.tokens_kept)
                if out.new_token_ids:
                    record.first_token_at = record.first_token_at or time.time()
                    record.completion_tokens += len(out.new_token_ids)
                    if out.logprobs:
                        pending_logprobs += wire_logprobs(tokenizer, out.logprobs)
                    pending_ids += out.new_token_ids
                    parsed, hit_stop, reasoning = choice.feed_counting_reasoning(out.new_token_ids)
                    record.reasoning_tokens += reasoning
                    await send(parsed)
                    if replier.undeliverable:  # the attempt ended with an error frame: stop the choice
                        return FinishReason.ERROR, ErrorCode.REPLY_TOO_LARGE
                    if hit_stop:
                        reason = FinishReason.STOP
                        break
                    if held_outputs is not None and not out.finished:
                        replier.hold_outputs(index, held_outputs)
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
