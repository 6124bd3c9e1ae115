"""An engine that replies from a script instead of a model: for testing clients and parsers.

The script is a JSON file: `{"rules": [{"match": "text in the prompt", "reply": "..."}],
"default": "..."}`. The first rule whose `match` occurs in the decoded prompt gives the reply,
which is tokenized with the model's real tokenizer and emitted one token per step, then EOS; a
resumed request (`resumed_token_ids`) goes on from where those tokens leave the reply.

A rule may also set `first_token_delay_s` and `token_delay_s` (a slow model, so tests can act
mid-request) and `fault`: fault injection for delivery tests, `"exit"` kills the worker process
as a crash would, `"device"` raises DeviceFault as a failing accelerator would, `"error"` ends
that request alone with an engine error (a bad row, as the sampler reports one), whose text is the
rule's `error_text` when given (e.g. as long as a grammar an engine's error might quote).
`preempt` (a reason, e.g. `"interactive_waiting"`) reports, after the first token, that the
scheduler preempted the request (it keeps its tokens and goes on), as `engine.core` does.
Output-side features (detokenization, stop strings, reasoning and tool-call parsing, usage)
therefore behave exactly as with a model, without running one.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from engine.frontend.protocol import (
    CoreInfo,
    CoreStats,
    DeviceFault,
    EngineOutput,
    EngineRequest,
    FinishReason,
    PreemptionReason,
    ServiceClass,
)
from engine.frontend.tokenizer import Tokenizer


@dataclass(slots=True, frozen=True)
class Rule:
    match: str
    reply: str
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fault: str | None = None
    error_text: str = "injected request error"
    preempt: PreemptionReason | None = None


class ScriptedEngine:
    def __init__(self, script_path: str | Path, tokenizer: Tokenizer, model_id: str,
                 max_model_len: int = 8192, max_num_seqs: int = 16) -> None:
        script = json.loads(Path(script_path).read_text(encoding="utf-8"))
        self.rules = [Rule(**r) for r in script.get("rules", [])]
        self.default_rule = Rule(match="", reply=script.get("default", ""))
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # Each running request's abort signal: an abort ends it at once, even mid-delay.
        self._running: dict[str, asyncio.Event] = {}
        self._batch: set[str] = set()  # the batch-class requests among them
        self._preemptions = dict.fromkeys(PreemptionReason, 0)
        # No KV pool: no blocks, and stats that only count what runs (and the preemptions reported).
        self.info = CoreInfo(model_id=model_id, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             num_blocks=0, block_size=0, eos_token_ids=tokenizer.all_stop_token_ids,
                             max_position_embeddings=max_model_len)

    @property
    def stats(self) -> CoreStats:
        return CoreStats(num_running=len(self._running), num_preemptions=sum(self._preemptions.values()),
                         preemptions_by_reason=dict(self._preemptions))

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        # As the real engine: interactive work may take the seats batch work holds (it is preempted).
        taken = len(self._running) - (len(self._batch) if service_class == ServiceClass.INTERACTIVE else 0)
        return max(self.max_num_seqs - taken, 0)

    def rule_for(self, prompt: str) -> Rule:
        return next((rule for rule in self.rules if rule.match in prompt), self.default_rule)

    def reply_for(self, prompt: str) -> str:
        return self.rule_for(prompt).reply

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if request.request_id in self._running:
            # As the real engine does: a second stream under a live id is refused, the first goes on.
            yield EngineOutput(request.request_id, [], finished=True, finish_reason=FinishReason.ERROR,
                               error=f"duplicate request id {request.request_id!r}: a request with that id is running")
            return
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        rule = self.rule_for(prompt)
        if rule.fault == "exit":
            os._exit(70)  # a crash: no cleanup, no goodbye, exactly like kill -9
        if rule.fault == "device":
            raise DeviceFault("injected device fault")
        if rule.fault == "error":
            yield EngineOutput(request.request_id, [], finished=True, finish_reason=FinishReason.ERROR,
                               num_prompt_tokens=len(request.prompt_token_ids), error=rule.error_text)
            return
        tokens = self.tokenizer.encode(rule.reply, add_special_tokens=False)
        if self.tokenizer.eos_token_id is not None:
            tokens.append(self.tokenizer.eos_token_id)
        # A resumed request goes on after the tokens it already had (they count towards max_tokens).
        start = len(request.resumed_token_ids)
        limit = min(len(tokens), request.sampling.max_tokens or len(tokens))
        if start >= limit:
            yield EngineOutput(request.request_id, [], finished=True,
                               finish_reason=FinishReason.STOP if start >= len(tokens) else FinishReason.LENGTH,
                               num_prompt_tokens=len(request.prompt_token_ids))
            return
        aborted = self._running[request.request_id] = asyncio.Event()
        if request.service_class == ServiceClass.BATCH:
            self._batch.add(request.request_id)
        try:
            for i in range(start, limit):
                token = tokens[i]
                # one "step": let others run, as a real engine would
                await _pause(aborted, rule.first_token_delay_s if i == start else rule.token_delay_s)
                if aborted.is_set():
                    yield EngineOutput(request.request_id, [], finished=True, finish_reason=FinishReason.ABORT,
                                       num_prompt_tokens=len(request.prompt_token_ids))
                    return
                last = i + 1 == len(tokens) or i + 1 == request.sampling.max_tokens
                reason = None
                if last:
                    reason = FinishReason.STOP if i + 1 == len(tokens) else FinishReason.LENGTH
                yield EngineOutput(request.request_id, [token], finished=last, finish_reason=reason,
                                   num_prompt_tokens=len(request.prompt_token_ids),
                                   prefill_ms=0.0 if i == start else None)
                if rule.preempt is not None and i == start and not last:
                    preempted = PreemptionReason(rule.preempt)
                    self._preemptions[preempted] += 1
                    yield EngineOutput(request.request_id, [], preempted=preempted, tokens_kept=i + 1)
        finally:
            self._running.pop(request.request_id, None)
            self._batch.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._running[request_id].set()

    async def shutdown(self) -> None:
        self._running.clear()


async def _pause(aborted: asyncio.Event, delay_s: float) -> None:
    """A step's delay, cut short by an abort."""
    if delay_s <= 0:
        await asyncio.sleep(0)
        return
    try:
        await asyncio.wait_for(aborted.wait(), delay_s)
    except TimeoutError:
        pass
