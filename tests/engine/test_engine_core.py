"""The engine core on the real SmolLM2 weights: batching, preemption and prefix caching are
invisible in the output; aborts give every block back."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRequest, FinishReason, SamplingParams
from engine.loading.loader import Checkpoint

TOPICS = [
    "the sea", "a red bicycle", "why the sky is blue, in one sentence", "bread",
    "the history of the printing press and why it mattered so much to Europe", "owls",
    "a quiet winter morning in a small mountain village", "prime numbers",
]


def prompts(checkpoint: Checkpoint) -> list[list[int]]:
    tokenizer = checkpoint.tokenizer
    out = []
    for topic in TOPICS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Write about {topic}."}])
        out.append(tokenizer.encode(text, add_special_tokens=False))
    assert len({len(p) for p in out}) > 4, "prompt lengths should differ"
    return out


def make_core(checkpoint: Checkpoint, **overrides: object) -> EngineCore:
    return EngineCore(checkpoint, EngineConfig(model="in-memory", **overrides))  # type: ignore[arg-type]


def greedy(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    finished = set()
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH, out
                finished.add(out.request_id)
    assert finished == set(tokens)
    return tokens


@pytest.fixture(scope="module")
def alone(smollm2: Checkpoint) -> dict[str, list[int]]:
    """Each prompt run on its own: the reference every batched run must reproduce."""
    core = make_core(smollm2)
    result = {}
    for i, prompt in enumerate(prompts(smollm2)):
        result.update(run(core, [EngineRequest(f"r{i}", prompt, greedy())]))
    return result


def test_batching_is_invisible(smollm2: Checkpoint, alone: dict[str, list[int]]) -> None:
    core = make_core(smollm2, max_num_batched_tokens=64)
    requests = [EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(prompts(smollm2))]
    assert run(core, requests) == alone
    assert core.stats.num_preemptions == 0


def test_preemption_is_invisible(smollm2: Checkpoint, alone: dict[str, list[int]]) -> None:
    # 24 blocks of 4 tokens cannot hold even two of these 34-47 token prompts plus their outputs.
    core = make_core(smollm2, block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    requests = [EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(prompts(smollm2))]
    assert run(core, requests) == alone
    assert core.stats.num_preemptions > 0
    assert core.kv_cache.num_free_blocks == 24


def test_prefix_cache_computes_only_new_tokens(smollm2: Checkpoint) -> None:
    tokenizer = smollm2.tokenizer
    system = "You are a meticulous assistant who answers questions about geography. " * 8
    first, second = (
        tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]), add_special_tokens=False)
        for q in ("What is the capital of Italy?", "Name a river in Spain.")
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 64

    core = make_core(smollm2)
    run(core, [EngineRequest("first", first, greedy())])
    computed_before = core.stats.prompt_tokens_computed
    cached = []
    core.add_request(EngineRequest("second", second, greedy()))
    with_cache: list[int] = []
    while core.has_work():
        for out in core.step():
            with_cache.extend(out.new_token_ids)
            if out.prefill_ms is not None:
                cached.append(out.num_cached_tokens)
    block = core.info.block_size
    assert cached == [shared // block * block]
    assert core.stats.prompt_tokens_computed - computed_before == len(second) - cached[0]

    fresh = run(make_core(smollm2, enable_prefix_caching=False), [EngineRequest("second", second, greedy())])
    assert with_cache == fresh["second"]


def test_abort_mid_generation_frees_every_block(smollm2: Checkpoint) -> None:
    core = make_core(smollm2, num_kv_blocks=64)
    prompt = prompts(smollm2)[4]
    core.add_request(EngineRequest("long", prompt, greedy(max_tokens=200)))
    core.add_request(EngineRequest("other", prompts(smollm2)[0], greedy(max_tokens=200)))
    for _ in range(5):
        core.step()
    assert core.kv_cache.num_free_blocks < 64
    outputs = core.abort(["long", "other", "never-existed"])
    assert {(o.request_id, o.finish_reason) for o in outputs} == {
        ("long", FinishReason.ABORT), ("other", FinishReason.ABORT)
    }
    assert not core.has_work()
    assert core.kv_cache.num_free_blocks == 64


def test_seeded_sampling_is_reproducible_alone_or_batched(smollm2: Checkpoint) -> None:
    all_prompts = prompts(smollm2)

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)

    alone_core = make_core(smollm2)
    solo = run(alone_core, [EngineRequest("s", all_prompts[2], sampled(7))])["s"]
    batch = run(make_core(smollm2), [
        EngineRequest("a", all_prompts[0], sampled(1)),
        EngineRequest("s", all_prompts[2], sampled(7)),
        EngineRequest("b", all_prompts[5], SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)),
    ])
    assert batch["s"] == solo
    other = run(make_core(smollm2), [EngineRequest("s", all_prompts[2], sampled(8))])["s"]
    assert other != solo


def test_top_k_1_equals_greedy(smollm2: Checkpoint, alone: dict[str, list[int]]) -> None:
    prompt = prompts(smollm2)[3]
    options = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    assert run(make_core(smollm2), [EngineRequest("r3", prompt, options)])["r3"] == alone["r3"]


def test_prompt_longer_than_the_model_fails_cleanly(smollm2: Checkpoint) -> None:
    core = make_core(smollm2, max_model_len=64)
    core.add_request(EngineRequest("big", list(range(100, 200)), greedy()))
    outputs = core.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outputs] == [("big", FinishReason.ERROR, True)]
    assert not core.has_work()


RESUMABLE = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, top_p=0.95, seed=11),
    "seeded-penalties": dict(temperature=0.9, top_k=40, seed=-5, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.2, min_tokens=30),
}


@pytest.mark.parametrize("config", list(RESUMABLE.values()), ids=list(RESUMABLE))
def test_a_resumed_request_continues_exactly_as_an_uninterrupted_one(
        smollm2: Checkpoint, config: dict[str, object]) -> None:
    """The first k tokens on one engine, the rest on another engine from those k: the same answer
    as one uninterrupted run, also when the resumed part shares its batch with another request.
    The resumed tokens count as generated: for max_tokens, min_tokens, penalties and the seed."""
    prompt = prompts(smollm2)[1]

    def options(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **config)  # type: ignore[arg-type]

    whole = run(make_core(smollm2), [EngineRequest("r", prompt, options(40))])["r"]
    first = run(make_core(smollm2), [EngineRequest("r", prompt, options(15))])["r"]
    assert first == whole[:15]
    core = make_core(smollm2)
    core.add_request(EngineRequest("r", prompt, options(40), resumed_token_ids=first))
    core.add_request(EngineRequest("other", prompts(smollm2)[3], greedy(max_tokens=30)))
    rest: list[int] = []
    prefill = []
    while core.has_work():
        for out in core.step():
            if out.request_id == "r":
                rest.extend(out.new_token_ids)
                prefill.append(out.prefill_ms)
                if out.finished:
                    assert out.finish_reason is FinishReason.LENGTH
    assert first + rest == whole
    assert len(rest) == 25
    assert prefill[0] is not None and all(p is None for p in prefill[1:])


def test_a_resumed_request_that_had_already_ended_finishes_at_once(smollm2: Checkpoint) -> None:
    prompt = prompts(smollm2)[0]
    eos = smollm2.tokenizer.eos_token_id
    core = make_core(smollm2, num_kv_blocks=64)
    # Every token it may have was already sent; its last token was a stop token; or not (it goes on).
    core.add_request(EngineRequest("full", prompt, greedy(max_tokens=3), resumed_token_ids=[5, 6, 7]))
    core.add_request(EngineRequest("stopped", prompt, SamplingParams(max_tokens=9, temperature=0.0),
                                   resumed_token_ids=[5, eos]))
    core.add_request(EngineRequest("ignored", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                   resumed_token_ids=[5, eos]))
    outputs = core.step()
    ended = {o.request_id: (o.finish_reason, o.new_token_ids) for o in outputs if o.request_id != "ignored"}
    assert ended == {"full": (FinishReason.LENGTH, []), "stopped": (FinishReason.STOP, [])}
    while core.has_work():
        outputs += core.step()
    generated = [t for o in outputs if o.request_id == "ignored" for t in o.new_token_ids]
    assert len(generated) == 2  # "ignored" had 2 of its 4
    assert outputs[-1].request_id == "ignored" and outputs[-1].finish_reason is FinishReason.LENGTH
    assert core.kv_cache.num_free_blocks == 64
