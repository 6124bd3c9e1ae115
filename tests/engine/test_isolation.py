"""No request can hurt the batch it shares: on the real SmolLM2 weights, a request with a destructive
parameter (or a row made to fail) ends alone, or produces only valid tokens, while the greedy
requests beside it get exactly the tokens they get without it. Only device faults poison."""

from __future__ import annotations

import pytest
import torch

from engine.core.core_process import Arrivals, handle_message
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import (
    INT64_MAX,
    INT64_MIN,
    AddRequest,
    DeviceFault,
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
    device_fault_message,
    encode_message,
    is_device_fault,
)
from engine.loading.loader import Checkpoint
from engine.runner.sampler import NO_FINITE_LOGITS
from tests.engine.helpers import RaisesAfterForward, run_all
from tests.engine.test_engine_core import greedy, prompts

MAX_TOKENS = 10


def make_core(checkpoint: Checkpoint) -> EngineCore:
    return EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_batched_tokens=64))


def bystanders(checkpoint: Checkpoint) -> list[EngineRequest]:
    return [EngineRequest(f"g{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(prompts(checkpoint)[:3])]


@pytest.fixture(scope="module")
def reference(smollm2: Checkpoint) -> dict[str, list[int]]:
    """The bystanders' greedy tokens, batched together with nobody else."""
    return {request_id: tokens for request_id, (tokens, _) in
            run_all(make_core(smollm2), bystanders(smollm2)).items()}


def assert_bystanders_unhurt(results: dict[str, tuple[list[int], EngineOutput]],
                             reference: dict[str, list[int]]) -> None:
    for request_id, expected in reference.items():
        tokens, final = results[request_id]
        assert final.finish_reason is FinishReason.LENGTH, final
        assert tokens == expected, request_id


def valid(tokens: list[int], checkpoint: Checkpoint) -> bool:
    return all(0 <= t < checkpoint.config.vocab_size for t in tokens)


DESTRUCTIVE = {
    "temperature-1e-38": [SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-38, ignore_eos=True)],
    "repetition-penalty-1e-300": [SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1e-300,
                                                 ignore_eos=True, seed=5)],
    "repetition-penalty-1e-300-greedy": [SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1e-300,
                                                        temperature=0.0, ignore_eos=True, logprobs=3)],
    "seed-int64-max-n2": [SamplingParams(max_tokens=MAX_TOKENS, seed=INT64_MAX, ignore_eos=True).for_choice(i)
                          for i in range(2)],
    "seed-int64-min": [SamplingParams(max_tokens=MAX_TOKENS, seed=INT64_MIN, ignore_eos=True)],
}


@pytest.mark.parametrize("sampling", list(DESTRUCTIVE.values()), ids=list(DESTRUCTIVE))
def test_a_destructive_parameter_changes_nobody_else(smollm2: Checkpoint, reference: dict[str, list[int]],
                                                     sampling: list[SamplingParams]) -> None:
    prompt = prompts(smollm2)[4]
    hostile = [EngineRequest(f"x{i}", prompt, params) for i, params in enumerate(sampling)]
    results = run_all(make_core(smollm2), bystanders(smollm2) + hostile)
    assert_bystanders_unhurt(results, reference)
    for request in hostile:
        tokens, final = results[request.request_id]
        assert final.finish_reason is FinishReason.LENGTH and final.error is None
        assert len(tokens) == MAX_TOKENS and valid(tokens, smollm2)


def test_a_tiny_temperature_is_greedy(smollm2: Checkpoint) -> None:
    prompt = prompts(smollm2)[4]
    results = run_all(make_core(smollm2), [
        EngineRequest("cold", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-38, ignore_eos=True)),
        EngineRequest("greedy", prompt, greedy(MAX_TOKENS)),
    ])
    assert results["cold"][0] == results["greedy"][0]
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-4).greedy


def test_seeds_at_the_int64_ends_replay(smollm2: Checkpoint) -> None:
    prompt = prompts(smollm2)[4]
    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True) for seed in (INT64_MAX, INT64_MIN)]
    first = run_all(make_core(smollm2), [EngineRequest(f"s{i}", prompt, p) for i, p in enumerate(params)])
    again = run_all(make_core(smollm2), [EngineRequest(f"s{i}", prompt, p) for i, p in enumerate(params)])
    assert [first[k][0] for k in ("s0", "s1")] == [again[k][0] for k in ("s0", "s1")]


class _PoisonRow:
    """Wraps the runner's sampler: the rows of one request get NaN logits (all, or a few)."""

    def __init__(self, sampler: object, victim: SamplingParams, everywhere: bool) -> None:
        self.sampler, self.victim, self.everywhere = sampler, victim, everywhere

    def __getattr__(self, name: str) -> object:  # the rest of the sampler (forget) as it is
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, rows: list) -> object:
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.options is self.victim:
                if self.everywhere:
                    logits[i] = float("nan")
                else:
                    logits[i, :100] = float("nan")
                    logits[i, 100:110] = float("inf")
        return self.sampler(logits, rows)


@pytest.mark.parametrize("everywhere", [True, False], ids=["all-nan", "some-nan-and-inf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_a_nan_row_ends_alone_or_stays_valid(smollm2: Checkpoint, reference: dict[str, list[int]],
                                             everywhere: bool, temperature: float) -> None:
    core = make_core(smollm2)
    victim = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, ignore_eos=True, logprobs=2)
    core.runner.sampler = _PoisonRow(core.runner.sampler, victim, everywhere)  # type: ignore[assignment]
    results = run_all(core, bystanders(smollm2) + [EngineRequest("nan", prompts(smollm2)[4], victim)])
    assert_bystanders_unhurt(results, reference)
    tokens, final = results["nan"]
    if everywhere:
        assert (tokens, final.finish_reason, final.error) == ([], FinishReason.ERROR, NO_FINITE_LOGITS)
    else:
        assert final.finish_reason is FinishReason.LENGTH and len(tokens) == MAX_TOKENS
        assert valid(tokens, smollm2) and all(110 <= t for t in tokens)
    assert not is_device_fault(final.error)
    assert core.kv_cache.num_free_blocks == core.info.num_blocks


def test_a_row_that_raises_fails_alone(smollm2: Checkpoint, reference: dict[str, list[int]]) -> None:
    used = {t for p in prompts(smollm2)[:3] for t in p} | {t for tokens in reference.values() for t in tokens}
    marker = next(t for t in range(1000, 2000) if t not in used)
    core = make_core(smollm2)
    core.runner.forward = RaisesAfterForward(core.runner.forward, marker)  # type: ignore[method-assign]
    bad = EngineRequest("bad", prompts(smollm2)[4] + [marker], greedy(MAX_TOKENS))
    results = run_all(core, bystanders(smollm2) + [bad])
    assert_bystanders_unhurt(results, reference)
    tokens, final = results["bad"]
    assert (tokens, final.finish_reason) == ([], FinishReason.ERROR)
    assert "index out of range" in final.error and not is_device_fault(final.error)
    assert core.kv_cache.num_free_blocks == core.info.num_blocks


def test_a_duplicate_id_is_refused_without_touching_the_live_request(
        smollm2: Checkpoint, reference: dict[str, list[int]]) -> None:
    core = make_core(smollm2)
    requests = bystanders(smollm2)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: list[EngineOutput] = []
    for request in requests:
        core.add_request(request)
    steps = 0
    while core.has_work():
        steps += 1
        if steps == 3:  # mid-generation: "g1" is running
            core.add_request(EngineRequest("g1", prompts(smollm2)[5], greedy(MAX_TOKENS)))
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals.append(out)
    assert tokens == reference
    duplicate = [f for f in finals if f.finish_reason is FinishReason.ERROR]
    assert len(duplicate) == 1 and duplicate[0].request_id == "g1" and "duplicate" in duplicate[0].error
    assert sorted(f.request_id for f in finals if f.finish_reason is FinishReason.LENGTH) == ["g0", "g1", "g2"]


def test_a_rejection_alone_reaches_the_client_through_step(smollm2: Checkpoint) -> None:
    """Rejected by the scheduler with nothing else to run: the next step hands it back, and the
    core is idle afterwards (it used to spin on has_work())."""
    core = make_core(smollm2)
    vocab = smollm2.config.vocab_size
    core.add_request(EngineRequest("outside", [1, 2, vocab], greedy()))
    assert core.has_work()
    (out,) = core.step()
    assert (out.request_id, out.finished, out.finish_reason) == ("outside", True, FinishReason.ERROR)
    assert "outside the vocabulary" in out.error
    assert not core.has_work() and core.step() == []


def test_an_invalid_message_fails_its_request_not_the_core(smollm2: Checkpoint) -> None:
    core = make_core(smollm2)
    raw = encode_message(AddRequest(EngineRequest("hot", [1, 2, 3], SamplingParams(max_tokens=4, temperature=2.0))))
    # What a client with no bounds could send: a temperature past the protocol's bound.
    raw = raw.replace(encode_message(2.0), encode_message(9.0))
    (out,) = handle_message(core, raw, Arrivals())
    assert (out.request_id, out.finish_reason) == ("hot", FinishReason.ERROR)
    assert "temperature" in out.error and not core.has_work()
    assert handle_message(core, b"\xc1", Arrivals()) == []


@pytest.mark.parametrize("exc", [
    IndexError("index out of range in self"),
    ValueError("prompt token id 99999 is outside the vocabulary"),
    ValueError("CUDA error: a request's own text"),
    KeyError("g1"),
    RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"),
    RuntimeError("Expected all tensors to be on the same device"),
], ids=["index-error", "value-error", "value-error-naming-cuda", "key-error", "nan-probabilities",
        "wrong-device"])
def test_request_level_errors_are_not_device_faults(exc: Exception) -> None:
    message = device_fault_message(exc)
    assert not is_device_fault(message)
    assert message == f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    torch.AcceleratorError("an illegal instruction was encountered"),
    DeviceFault("lost the device"),
], ids=["illegal-access", "device-side-assert", "accelerator-error", "device-fault"])
def test_device_faults_are_classified_as_such(exc: Exception) -> None:
    assert is_device_fault(device_fault_message(exc))
