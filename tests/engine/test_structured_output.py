"""Grammar-constrained decoding in the engine core on the real SmolLM2 weights: the output matches
its grammar (greedy and sampled, through preemption), the request stops when the grammar is
complete, a constrained row never changes what an unconstrained one in the same batch gets, and a
grammar that fails ends only its own request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.core.structured_output import apply_masks, unpack_numpy, unpack_torch
from engine.frontend.engine_config import EngineConfig
from engine.frontend.grammars import STEP_MAX_ITEMS
from engine.frontend.protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams, StructuredOutput
from engine.frontend.protocol import StructuredOutputKind as Kind
from engine.loading.loader import Checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
PERSON_JSON = StructuredOutput(kind=Kind.JSON_SCHEMA, spec=json.dumps(PERSON))
PHONE = StructuredOutput(kind=Kind.REGEX, spec=r"\(\d{3}\) \d{3}-\d{4}")
ANSWERS = StructuredOutput(kind=Kind.CHOICE, spec=json.dumps(["yes", "no", "it depends"]))


def make_core(checkpoint: Checkpoint, **overrides: object) -> EngineCore:
    return EngineCore(checkpoint, EngineConfig(model="in-memory", **overrides))  # type: ignore[arg-type]


def chat(checkpoint: Checkpoint, question: str) -> list[int]:
    tokenizer = checkpoint.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, tuple[list[int], EngineOutput]]:
    """Every request's tokens and its final output."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: dict[str, EngineOutput] = {}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for out in core.step():
            assert out.request_id not in finals, f"output after the final one: {out}"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(tokens)
    return {request_id: (tokens[request_id], finals[request_id]) for request_id in tokens}


def compiled(core: EngineCore) -> None:
    """Wait for the grammars compiling beside the core (its next step admits their requests)."""
    for future in list(core.structured._compiling.values()):
        future.result(timeout=60)


def text(checkpoint: Checkpoint, token_ids: list[int]) -> str:
    return checkpoint.tokenizer.decode(token_ids, skip_special_tokens=True)


def constrained(structured: StructuredOutput, max_tokens: int = 80, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=structured, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_output_validates(smollm2: Checkpoint, temperature: float) -> None:
    prompt = chat(smollm2, "Describe a person as JSON.")
    requests = [EngineRequest(f"p{i}", prompt, constrained(PERSON_JSON, temperature=temperature, seed=i))
                for i in range(3)]
    for token_ids, final in run(make_core(smollm2), requests).values():
        assert final.finish_reason is FinishReason.STOP, final
        jsonschema.validate(json.loads(text(smollm2, token_ids)), PERSON)


def test_regex_and_choice_hold_when_sampled(smollm2: Checkpoint) -> None:
    phone, question = chat(smollm2, "What is your phone number?"), chat(smollm2, "Is the sea blue?")
    requests = [EngineRequest(f"phone{i}", phone, constrained(PHONE, temperature=1.0, seed=i)) for i in range(4)]
    requests += [EngineRequest(f"answer{i}", question, constrained(ANSWERS, temperature=1.0, seed=i))
                 for i in range(4)]
    for request_id, (token_ids, final) in run(make_core(smollm2), requests).items():
        assert final.finish_reason is FinishReason.STOP
        output = text(smollm2, token_ids)
        if request_id.startswith("phone"):
            assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", output), output
        else:
            assert output in ("yes", "no", "it depends")


def test_complete_grammar_stops_without_eos_even_when_eos_is_ignored(smollm2: Checkpoint) -> None:
    prompt = chat(smollm2, "Is the sea blue?")
    result = run(make_core(smollm2), [EngineRequest("a", prompt, constrained(ANSWERS, temperature=0.0,
                                                                              ignore_eos=True))])
    token_ids, final = result["a"]
    assert final.finish_reason is FinishReason.STOP
    assert not set(token_ids) & set(smollm2.tokenizer.all_stop_token_ids)
    assert text(smollm2, token_ids) in ("yes", "no", "it depends")


def test_constrained_rows_leave_unconstrained_ones_alone(smollm2: Checkpoint) -> None:
    free = [chat(smollm2, f"Write about {topic}.") for topic in ("the sea", "owls", "bread")]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = {f"free{i}": run(make_core(smollm2), [EngineRequest(f"free{i}", p, greedy)])[f"free{i}"][0]
             for i, p in enumerate(free)}
    mixed = [EngineRequest(f"free{i}", p, greedy) for i, p in enumerate(free)]
    mixed.insert(1, EngineRequest("json", chat(smollm2, "A person as JSON."),
                                  constrained(PERSON_JSON, temperature=0.0)))
    mixed.append(EngineRequest("phone", chat(smollm2, "Your number?"), constrained(PHONE, temperature=1.0, seed=3)))
    result = run(make_core(smollm2), mixed)
    assert {request_id: result[request_id][0] for request_id in alone} == alone
    jsonschema.validate(json.loads(text(smollm2, result["json"][0])), PERSON)


def test_preemption_feeds_each_token_to_the_grammar_once(smollm2: Checkpoint) -> None:
    prompts = [chat(smollm2, f"Describe {who} as JSON.") for who in ("a sailor", "a baker", "a child")]
    requests = [EngineRequest(f"p{i}", p, constrained(PERSON_JSON, temperature=0.0)) for i, p in enumerate(prompts)]
    roomy = run(make_core(smollm2), requests)
    # 20 blocks of 4 tokens cannot hold all three prompts with their outputs at once.
    core = make_core(smollm2, block_size=4, num_kv_blocks=20, enable_prefix_caching=False)
    tight = run(core, requests)
    assert core.stats.num_preemptions > 0
    assert tight == roomy
    for token_ids, _ in tight.values():
        jsonschema.validate(json.loads(text(smollm2, token_ids)), PERSON)
    assert len(core.structured) == 0


def test_grammar_that_does_not_compile_fails_alone(smollm2: Checkpoint) -> None:
    prompt = chat(smollm2, "Hello")
    bad = StructuredOutput(kind=Kind.REGEX, spec="((")
    result = run(make_core(smollm2), [
        EngineRequest("bad", prompt, constrained(bad)),
        EngineRequest("good", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
    ])
    assert result["bad"][1].finish_reason is FinishReason.ERROR
    assert "does not compile" in (result["bad"][1].error or "")
    assert result["bad"][0] == []
    assert result["good"][1].finish_reason is FinishReason.LENGTH and len(result["good"][0]) == 4


def test_grammar_failing_mid_generation_ends_only_its_request(smollm2: Checkpoint) -> None:
    core = make_core(smollm2)
    prompt = chat(smollm2, "Describe a person as JSON.")
    core.add_request(EngineRequest("broken", prompt, constrained(PERSON_JSON, temperature=0.0)))
    core.add_request(EngineRequest("fine", prompt, constrained(PERSON_JSON, temperature=0.0)))
    core.add_request(EngineRequest("free", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    compiled(core)
    core.step()  # prefill: one token each
    # Drive one matcher into its error state as a run-time failure (a limit hit) would.
    assert not core.structured._matchers["broken"].consume_token(smollm2.tokenizer.eos_token_id)
    finals: dict[str, EngineOutput] = {}
    tokens: dict[str, list[int]] = {"broken": [], "fine": [], "free": []}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert finals["broken"].finish_reason is FinishReason.ERROR
    assert "structured output failed" in (finals["broken"].error or "")
    assert finals["fine"].finish_reason is FinishReason.STOP
    assert finals["free"].finish_reason is FinishReason.LENGTH
    assert core.kv_cache.num_free_blocks == core.info.num_blocks


def test_bitmask_unpacking_agrees_with_the_bit_layout() -> None:
    generator = torch.Generator().manual_seed(0)
    masks = torch.randint(-(1 << 31), (1 << 31) - 1, (3, 4), dtype=torch.int32, generator=generator)
    expected = torch.tensor([[(int(masks[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(128)] for r in range(3)])
    shifts = torch.arange(32, dtype=torch.int32)
    assert torch.equal(unpack_numpy(masks), expected)
    assert torch.equal(unpack_torch(masks, shifts), expected)
    # Logits one token wider than the mask: the extra id is never allowed.
    logits = torch.zeros(5, 129)
    apply_masks(logits, [0, 2, 4], masks, shifts)
    for k, row in enumerate([0, 2, 4]):
        assert torch.equal(logits[row, :128] == 0, expected[k]) and logits[row, 128] == float("-inf")
    assert torch.equal(logits[[1, 3]], torch.zeros(2, 129))


def test_choices_of_one_grammar_share_one_compile(smollm2: Checkpoint) -> None:
    core = make_core(smollm2)
    prompt = chat(smollm2, "Is the sea blue?")
    requests = [EngineRequest(f"a/{i}", prompt, constrained(ANSWERS, temperature=1.0, seed=i)) for i in range(16)]
    for token_ids, final in run(core, requests).values():
        assert final.finish_reason is FinishReason.STOP
        assert text(smollm2, token_ids) in ("yes", "no", "it depends")
    assert (core.stats.grammar_compiles, core.stats.grammar_cache_hits) == (1, 15)
    # A later request with the same grammar takes the cached one; a new grammar compiles.
    run(core, [EngineRequest("again", prompt, constrained(ANSWERS, temperature=0.0)),
               EngineRequest("phone", prompt, constrained(PHONE, temperature=0.0))])
    assert (core.stats.grammar_compiles, core.stats.grammar_cache_hits) == (2, 16)


def test_a_compile_past_its_budget_fails_its_request_alone(smollm2: Checkpoint,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(smollm2)
    core.structured.compile_budget_s = 0.2
    release = threading.Event()
    real_compile = core.structured.compile

    def stuck(structured: StructuredOutput) -> object:
        release.wait(60)  # a compile that takes as long as the test says
        return real_compile(structured)

    monkeypatch.setattr(core.structured, "compile", stuck)
    prompt = chat(smollm2, "Hello")
    core.add_request(EngineRequest("slow", prompt, constrained(PHONE)))
    core.add_request(EngineRequest("free", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    finals: dict[str, EngineOutput] = {}
    while core.has_work():
        finals.update({out.request_id: out for out in core.step() if out.finished})
    release.set()
    assert finals["free"].finish_reason is FinishReason.LENGTH
    assert finals["slow"].finish_reason is FinishReason.ERROR
    assert "did not compile within 0.2 s" in (finals["slow"].error or "")
    assert core.kv_cache.num_free_blocks == core.info.num_blocks


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once(smollm2: Checkpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(smollm2)
    release = threading.Event()
    real_compile = core.structured.compile
    monkeypatch.setattr(core.structured, "compile", lambda s: (release.wait(60), real_compile(s))[1])
    core.add_request(EngineRequest("a", chat(smollm2, "Hello"), constrained(PHONE)))
    assert core.has_work() and core.only_compiling
    [out] = core.abort(["a"])
    assert out.finished and out.finish_reason is FinishReason.ABORT
    release.set()
    assert not core.has_work() and core.structured.num_waiting == 0


def test_a_grammar_error_is_short_and_never_carries_the_grammar(smollm2: Checkpoint) -> None:
    huge = "(" * 20_000 + "a"  # llguidance's own error quotes the whole regex
    result = run(make_core(smollm2), [EngineRequest("bad", chat(smollm2, "Hi"),
                                                    constrained(StructuredOutput(kind=Kind.REGEX, spec=huge)))])
    error = result["bad"][1].error or ""
    assert "does not compile" in error and len(error.encode()) <= 600


def test_a_grammar_past_its_bounds_is_refused_without_compiling(smollm2: Checkpoint,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(smollm2)
    monkeypatch.setattr("engine.core.structured_output.to_llguidance",
                        lambda s: pytest.fail("a grammar past its bounds reached the compiler"))
    huge = StructuredOutput(kind=Kind.GRAMMAR, spec='start: "' + "a" * (64 << 10) + '"')
    # Small, but more GBNF rules than their conversion may cost (as a bus client could send it).
    many_rules = StructuredOutput(kind=Kind.GRAMMAR, spec="".join(f'r{i} ::= "a"\n' for i in range(200)))
    result = run(core, [EngineRequest("big", chat(smollm2, "Hi"), constrained(huge)),
                        EngineRequest("rules", chat(smollm2, "Hi"), constrained(many_rules))])
    for request_id in ("big", "rules"):
        assert result[request_id][1].finish_reason is FinishReason.ERROR
        assert "at most" in (result[request_id][1].error or "")


def test_a_grammar_whose_masks_grow_with_the_answer_fails_alone_while_others_finish(smollm2: Checkpoint) -> None:
    """An ambiguous grammar compiles at once but costs more per token the longer the answer gets
    (0.9 ms a mask at 100 tokens, 100 ms at 600): its row fails once a mask passes llguidance's
    per-token item bound, and the request beside it runs to its end."""
    core = make_core(smollm2)
    growing = StructuredOutput(kind=Kind.GRAMMAR, spec='start: s\ns: s s | "a"')
    prompt = chat(smollm2, "Say a.")
    result = run(core, [EngineRequest("growing", prompt, constrained(growing, max_tokens=600, min_tokens=600)),
                        EngineRequest("free", prompt, SamplingParams(max_tokens=300, min_tokens=300))])
    tokens, final = result["growing"]
    # The per-token bound ended it (llguidance names its limit), not the later row limit.
    assert final.finish_reason is FinishReason.ERROR and f"limit {STEP_MAX_ITEMS}" in (final.error or ""), final.error
    assert "right recursion" in (final.error or "")  # what usually causes it, and the way around
    assert len(tokens) < 600
    free_tokens, free_final = result["free"]
    assert free_final.finish_reason is FinishReason.LENGTH and len(free_tokens) == 300
