"""A migrated request continues where its first worker died: the client's text, token ids and
usage are those of one uninterrupted run (issue 14, request migration, the worker's half).

A "death" is what a client sees of a worker killed mid-stream: the frames it had sent up to some
point, and nothing after. The first attempt runs for real behind a replier that stops passing
frames on at that point (and aborts the engine request, as the death would free it); the second
attempt gets `resume` built from the delivered deltas' `token_ids`, as a requester would build it.
Runs go through the worker's `run_request` on a real NATS server (its events) with the real
SmolLM2 engine in its own process, and with the scripted engine for the text-shaping cases
(reasoning, tool calls, stop strings, characters split across tokens).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js import JetStreamContext

from apps.bus import declaration, wire
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.settings import WorkerSettings
from apps.worker.context_limit import ContextLimit
from apps.worker.model_loop import ModelLoop
from apps.worker.replies import CollectingReplier
from apps.worker.run import ServedModel, abort_request, run_request
from engine.frontend.core_client import AsyncEngine
from engine.frontend.protocol import Engine, FinishReason, SamplingParams
from engine.frontend.scripted import ScriptedEngine
from engine.frontend.tokenizer import Tokenizer
from engine.loading.default_model import default_model_path

MODEL = "resume-model"


class DyingReplier(CollectingReplier):
    """Frames reach the client until `alive(frames)` says no: then the worker is dead to it."""

    def __init__(self, alive: Callable[[list[wire.ReplyFrame]], bool], on_death: Callable[[], None]) -> None:
        super().__init__(attempt=1, node="first")
        self.alive = alive
        self.on_death = on_death
        self.dead = False

    def _send(self, frame: wire.ReplyFrame) -> None:
        if self.dead:
            return
        if not self.alive([*self.frames, frame]):
            self.dead = True
            self.on_death()
            return
        super()._send(frame)


class Answer:
    """What a client holds of one attempt: its deltas, per choice."""

    def __init__(self, frames: list[wire.ReplyFrame], n: int = 1) -> None:
        self.frames = frames
        self.deltas = [[f for f in frames if isinstance(f, wire.Delta) and f.index == i] for i in range(n)]

    def text(self, index: int = 0) -> str:
        return "".join(d.text for d in self.deltas[index])

    def reasoning(self, index: int = 0) -> str:
        return "".join(d.reasoning for d in self.deltas[index])

    def tool_calls(self, index: int = 0) -> list[tuple[str, str]]:
        return [(c.name, c.arguments) for d in self.deltas[index] for c in d.tool_calls]

    def token_ids(self, index: int = 0) -> list[int]:
        return [t for d in self.deltas[index] for t in d.token_ids]

    def finish_reason(self, index: int = 0) -> FinishReason | None:
        return next((d.finish_reason for d in self.deltas[index] if d.finish_reason), None)

    def resume(self) -> list[wire.ResumedChoice]:
        return [wire.ResumedChoice(token_ids=self.token_ids(i), finish_reason=self.finish_reason(i))
                for i in range(len(self.deltas))]

    @property
    def final(self) -> wire.Final:
        final = self.frames[-1]
        assert isinstance(final, wire.Final), self.frames[-1]
        return final


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await declaration.ensure_topology(js, BusLimits())  # the runs' events have somewhere to go
        yield js
    finally:
        await nc.close()


def served(engine: Engine, tokenizer: Tokenizer, reasoning_parser: str = "auto") -> ServedModel:
    settings = WorkerSettings(reasoning_parser=reasoning_parser)
    return ModelLoop(settings, engine, tokenizer, MODEL).model


def chat(content: str, sampling: SamplingParams, request_id: str = "r", **fields: object) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, model=MODEL, reply_subject="_INBOX.unused", sampling=sampling,
                                messages=[wire.ChatMessage(role="user", content=content)], **fields)  # type: ignore[arg-type]


async def uninterrupted(model: ServedModel, request: wire.GenerateRequest, js: JetStreamContext) -> Answer:
    replier = CollectingReplier(attempt=1, node="whole")
    await run_request(model, request, replier, attempt=1, node="whole", js=js)
    return Answer(replier.frames, request.sampling.n)


async def died_after(model: ServedModel, request: wire.GenerateRequest, js: JetStreamContext,
                     alive: Callable[[list[wire.ReplyFrame]], bool]) -> Answer:
    """The first attempt, as its client saw it before its worker died."""
    replier = DyingReplier(alive, lambda: asyncio.ensure_future(abort_request(model.engine, request)))
    await run_request(model, request, replier, attempt=1, node="first", js=js)
    assert replier.dead, "the first attempt finished before its death"
    return Answer(replier.frames, request.sampling.n)


async def resumed(model: ServedModel, request: wire.GenerateRequest, js: JetStreamContext, first: Answer,
                  attempt: int = 2) -> Answer:
    replier = CollectingReplier(attempt=attempt, node="second")
    migrated = msgspec.structs.replace(request, resume=first.resume(), attempt=attempt)
    await run_request(model, migrated, replier, attempt=attempt, node="second", js=js)
    return Answer(replier.frames, request.sampling.n)


def tokens_sent(at_most: int) -> Callable[[list[wire.ReplyFrame]], bool]:
    """Alive while the client has at most `at_most` tokens."""
    def alive(frames: list[wire.ReplyFrame]) -> bool:
        return sum(len(f.token_ids) for f in frames if isinstance(f, wire.Delta)) <= at_most
    return alive


def deltas_sent(at_most: int) -> Callable[[list[wire.ReplyFrame]], bool]:
    def alive(frames: list[wire.ReplyFrame]) -> bool:
        return sum(isinstance(f, wire.Delta) for f in frames) <= at_most
    return alive


@pytest.fixture
async def real_engine() -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.start(WorkerSettings(max_num_seqs=4).engine_config(str(default_model_path())))
    try:
        yield engine
    finally:
        await engine.shutdown()


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=120, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True,
                             frequency_penalty=0.3),
}


# About 130 decode steps of SmolLM2 on CPU: seconds on a quiet machine, minutes on a loaded one.
@pytest.mark.timeout(1500)
async def test_a_migrated_answer_equals_an_uninterrupted_one_on_the_real_model(
        real_engine: AsyncEngine, tok: Tokenizer, js: JetStreamContext) -> None:
    """Greedy and seeded sampled (with a penalty over the output), all in one engine batch: 120
    tokens uninterrupted, and beside it a first attempt that dies after about 45 tokens and a
    second one resuming from what its client had: the same tokens and text, usage for all 120."""
    model = served(real_engine, tok)

    async def migrated(request: wire.GenerateRequest) -> tuple[Answer, Answer]:
        first = await died_after(model, request, js, tokens_sent(at_most=45))
        return first, await resumed(model, request, js, first)

    prompt = "Write a short story about a lighthouse keeper."
    wholes = [chat(prompt, sampling, request_id=f"whole-{name}") for name, sampling in SAMPLINGS.items()]
    parts = [chat(prompt, sampling, request_id=f"part-{name}") for name, sampling in SAMPLINGS.items()]
    results = await asyncio.gather(*(uninterrupted(model, r, js) for r in wholes), *(migrated(r) for r in parts))
    for name, whole, (first, second) in zip(SAMPLINGS, results[:2], results[2:], strict=True):
        assert len(whole.token_ids()) == 120 and whole.final.usage.completion_tokens == 120, name
        assert whole.final.finish_reason == FinishReason.LENGTH, name
        assert not any(isinstance(f, wire.Final) for f in first.frames), name
        assert 35 <= len(first.token_ids()) <= 45, name
        assert first.token_ids() + second.token_ids() == whole.token_ids(), name
        assert first.text() + second.text() == whole.text(), name
        assert second.final.finish_reason == FinishReason.LENGTH, name
        assert second.final.usage.completion_tokens == 120, name
        assert second.final.usage.prompt_tokens == whole.final.usage.prompt_tokens, name
    assert results[0].token_ids() != results[1].token_ids()
    assert real_engine.free_slots() == real_engine.max_num_seqs


SHAPED_REPLY = ('<think>Let me think: café ☕, then 🎉 again</think>\n\nSure — here it is: 日本語 '
                '<tool_call>\n{"name": "lookup", "arguments": {"q": "naïve"}}\n</tool_call> after the call '
                'STOP-HERE never sent')


@pytest.fixture
def shaped(tmp_path: Path, tok: Tokenizer) -> ServedModel:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": SHAPED_REPLY}), encoding="utf-8")
    return served(ScriptedEngine(script, tok, MODEL), tok, reasoning_parser="on")


async def test_a_migration_at_any_delta_sends_each_piece_of_text_once(shaped: ServedModel,
                                                                      js: JetStreamContext) -> None:
    """Reasoning, a tool call, multi-byte characters split across tokens and a stop string all
    hold text back at some point; cut after every delta, the two attempts together give the
    client exactly the uninterrupted answer, and the resumed tokens count in its usage."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    request = chat("go", SamplingParams(max_tokens=200, stop=["STOP-HERE"]), tools=tools)
    whole = await uninterrupted(shaped, request, js)
    assert whole.reasoning() == "Let me think: café ☕, then 🎉 again"
    assert whole.tool_calls() == [("lookup", '{"q": "naïve"}')]
    assert whole.finish_reason() == FinishReason.TOOL_CALLS and whole.final.finish_reason == FinishReason.TOOL_CALLS
    assert "never sent" not in whole.text()
    num_deltas = len(whole.deltas[0])
    assert num_deltas > 20
    for cut in range(num_deltas):
        first = await died_after(shaped, request, js, deltas_sent(at_most=cut))
        assert len(first.deltas[0]) == cut
        second = await resumed(shaped, request, js, first)
        context = f"cut after delta {cut}"
        assert first.text() + second.text() == whole.text(), context
        assert first.reasoning() + second.reasoning() == whole.reasoning(), context
        assert first.tool_calls() + second.tool_calls() == whole.tool_calls(), context
        assert first.token_ids() + second.token_ids() == whole.token_ids(), context
        assert second.final.finish_reason == FinishReason.TOOL_CALLS, context
        assert second.final.usage.completion_tokens == whole.final.usage.completion_tokens, context
        assert second.final.usage.reasoning_tokens == whole.final.usage.reasoning_tokens, context


async def test_a_finished_choice_is_not_run_again_and_the_others_go_on(
        js: JetStreamContext, tmp_path: Path, tok: Tokenizer) -> None:
    script = tmp_path / "plain.json"
    script.write_text(json.dumps({"default": "one two three four five six seven"}), encoding="utf-8")
    engine = ScriptedEngine(script, tok, MODEL)
    model = served(engine, tok)
    request = chat("go", SamplingParams(n=2, max_tokens=50))
    whole = await uninterrupted(model, request, js)
    assert [whole.text(i) for i in range(2)] == ["one two three four five six seven"] * 2
    # Choice 0 had finished, choice 1 had two deltas when the first worker died.
    first = Answer(whole.deltas[0] + whole.deltas[1][:2], n=2)  # type: ignore[operator]
    assert first.finish_reason(0) == FinishReason.STOP and first.finish_reason(1) is None
    assert first.text(1).startswith("one")
    second = await resumed(model, request, js, first)
    assert second.deltas[0] == []
    assert first.text(1) + second.text(1) == whole.text(1)
    assert second.final.usage.completion_tokens == whole.final.usage.completion_tokens


async def test_a_resume_that_does_not_fit_the_request_is_refused(shaped: ServedModel, js: JetStreamContext) -> None:
    replier = CollectingReplier(attempt=2, node="second")
    request = chat("go", SamplingParams(n=2, max_tokens=20), resume=[wire.ResumedChoice(token_ids=[1, 2])])
    await run_request(shaped, request, replier, attempt=2, node="second", js=js)
    assert [type(f) for f in replier.frames] == [wire.ErrorFrame]
    assert replier.frames[0].status == 400


async def test_a_resumed_runs_prefill_sample_counts_the_tokens_it_recomputed(
        shaped: ServedModel, js: JetStreamContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine prefills a migrated request's prompt and its resumed tokens before its first new
    token; the prefill rate's sample counts both, or every takeover would drag the rate down."""
    whole = await uninterrupted(shaped, chat("go", SamplingParams(max_tokens=200)), js)
    first = Answer(whole.frames[:10])
    resumed_ids = first.token_ids()
    assert len(resumed_ids) >= 5
    samples: list[tuple[int, float]] = []
    monkeypatch.setattr(ContextLimit, "observe_prefill", lambda _, tokens, ms: samples.append((tokens, ms)) or True)
    second = await resumed(shaped, chat("go", SamplingParams(max_tokens=200)), js, first)
    prompt_tokens = second.final.usage.prompt_tokens
    assert samples == [(prompt_tokens + len(resumed_ids), 0.0)]  # the scripted engine caches nothing
