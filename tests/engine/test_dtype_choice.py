"""dtype by measurement among what the CPU runs: the rule that picks, what is measured, a CPU without
bf16 (never tried, the real engine starts and answers in fp32), HELEXA_DTYPE, and bf16's accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apps.settings import WorkerSettings
from benchmarks.core_timing import run_greedy
from engine.core.core_process import build_core
from engine.core.engine_core import EngineCore
from engine.cpu import cpu_linear, dtype_choice
from engine.cpu.cpu_support import FORCE_UNSUPPORTED_ENV, UnsupportedDtype
from engine.cpu.dtype_choice import (
    Scenario,
    choose_dtype,
    linear_shapes,
    measure,
    pick,
    scenarios,
)
from engine.frontend.engine_config import EngineConfig
from engine.frontend.model_source import load_tokenizer
from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint, read_model_config
from engine.loading.model_config import ModelConfig
from engine.models.layers import Linear
from engine.runner import ops
from tests.engine.greedy_agreement import Agreement, argmax_gaps

TINY = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def timings(**by_dtype: tuple[float, float, float]) -> dict[str, dict[str, float]]:
    names = ("rows_1", "rows_16", "rows_512")
    return {dtype: dict(zip(names, values, strict=True)) for dtype, values in by_dtype.items()}


def test_pick_takes_the_best_geometric_mean_and_prefers_fp32_on_near_ties() -> None:
    # bf16 1.5x slower for one row but 2.5x / 3x faster for batches: geomean 0.56 -> bf16.
    assert pick(timings(float32=(10, 40, 300), bfloat16=(15, 16, 100))) == "bfloat16"
    # AVX2-only part: bf16 3x slower everywhere.
    assert pick(timings(float32=(10, 40, 300), bfloat16=(30, 120, 900))) == "float32"
    # 5 % faster is not worth fp32's accuracy.
    assert pick(timings(float32=(10, 40, 300), bfloat16=(9.5, 38, 285))) == "float32"
    assert pick(timings(float32=(10, 40, 300), bfloat16=(8, 20, 150), float16=(6, 10, 90))) == "float16"


@pytest.fixture
def packed(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of every weight packed for oneDNN from now on (an attempt counts, even one that
    raises)."""
    dtypes: list[torch.dtype] = []
    real = cpu_linear.pack

    def recorded(weight: torch.Tensor) -> torch.Tensor:
        dtypes.append(weight.dtype)
        return real(weight)

    monkeypatch.setattr(cpu_linear, "pack", recorded)
    return dtypes


@pytest.fixture
def no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU as one without oneDNN's bf16 and fp16 paths (a Zen 3, any AVX2-only part): there a
    bf16 reorder raises, as `cpu_linear.pack` then does."""
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16,float16")


def test_where_only_fp32_runs_auto_takes_it_unmeasured(no_bf16: None, packed: list[torch.dtype],
                                                        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_measuring(*args: object) -> None:
        raise AssertionError("measured")

    monkeypatch.setattr(dtype_choice, "measure", no_measuring)
    choice = choose_dtype(EngineConfig(model="m", dtype="auto"), TINY, "cpu", tmp_path / "dtype-choice.json")
    assert (choice.dtype, choice.reason, choice.timings_ms) == ("float32", "only-supported", {})
    assert "bf16 unsupported here (" in choice.detail and "fp16 unsupported here (" in choice.detail
    assert "CPU: " in choice.detail
    assert packed == [] and not (tmp_path / "dtype-choice.json").exists()


def test_a_dtype_the_cpu_cannot_run_is_never_timed(monkeypatch: pytest.MonkeyPatch,
                                                   packed: list[torch.dtype]) -> None:
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16")
    cases = [Scenario("rows_1", 1, True, 20_000), Scenario("rows_4", 4, True, 20_000)]
    result = measure(TINY, cases)
    assert "bfloat16" not in result and "float32" in result
    assert torch.bfloat16 not in packed and torch.float32 in packed  # fp32 timed as it runs: prepacked


def test_a_configured_dtype_the_cpu_cannot_run_is_refused_before_anything_is_built(
        no_bf16: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedDtype, match="avx_ne_convert|bf16"):
        choose_dtype(EngineConfig(model="m", dtype="bfloat16"), TINY, "cpu")

    def no_kernels(*args: object) -> None:
        raise AssertionError("kernels picked (and built) before the refusal")

    monkeypatch.setattr(ops, "use_backend", no_kernels)
    with pytest.raises(UnsupportedDtype) as refused:
        build_core(EngineConfig(model=str(default_model_path()), dtype="bfloat16"))
    assert "\n" not in str(refused.value) and "float32" in str(refused.value)
    with pytest.raises(UnsupportedDtype):
        build_core(EngineConfig(model=str(default_model_path()), dtype="float16"))


def test_where_bf16_is_unsupported_a_bf16_weight_is_never_packed(no_bf16: None) -> None:
    layer = Linear(32, 8).to(torch.bfloat16)
    assert not layer.prepack() and layer.packed is None  # F.linear serves it
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with pytest.raises(UnsupportedDtype):
        cpu_linear.pack(layer.weight)
    assert cpu_linear.method() in ("onednn-prepacked", "F.linear")  # no bf16 kernel


def test_the_real_engine_starts_and_answers_with_default_settings_where_bf16_is_unsupported(
        no_bf16: None, packed: list[torch.dtype], monkeypatch: pytest.MonkeyPatch) -> None:
    """The test that would have caught the crash on a Zen 3: the worker's default settings
    (HELEXA_DTYPE unset: auto; kernels auto), the real model, fp32 chosen, no bf16 reorder tried."""
    monkeypatch.delenv("HELEXA_DTYPE", raising=False)
    config = WorkerSettings(kv_cache_mb=64).engine_config(str(default_model_path()))
    assert config.dtype == "auto"
    core = build_core(config)
    assert core.info.dtype == "float32" and "bf16 unsupported here" in core.info.dtype_reason
    assert torch.bfloat16 not in packed and torch.float32 in packed  # still prepacked in fp32
    tokenizer, _ = load_tokenizer(default_model_path())
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True)
    tokens = run_greedy(core, [("q", tokenizer.encode(text, add_special_tokens=False), 12)]).tokens["q"]
    assert "Paris" in tokenizer.decode(tokens)


def test_configured_and_cuda_dtypes_are_not_measured() -> None:
    assert choose_dtype(EngineConfig(model="m", dtype="float32"), TINY, "cpu").reason == "configured"
    choice = choose_dtype(EngineConfig(model="m", dtype="auto"), TINY, "cuda")
    assert (choice.dtype, choice.reason, choice.timings_ms) == ("bfloat16", "cuda", {})


def test_the_measured_shapes_are_the_models_own_packed_projections() -> None:
    config = read_model_config(default_model_path())
    shapes, lm_head = linear_shapes(config)
    # Per layer: qkv (9 + 2 * 3 heads of 64), o, gate|up, down.
    assert shapes[:4] == [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    assert len(shapes) == 4 * config.num_hidden_layers and lm_head == (576, config.vocab_size)
    assert [s.rows for s in scenarios(EngineConfig(model="m", max_num_seqs=16))] == [1, 16, 512]


def test_measure_times_every_scenario_of_fp32_and_each_worthwhile_candidate() -> None:
    cases = [Scenario("rows_1", 1, True, 20_000), Scenario("rows_4", 4, True, 20_000),
             Scenario("rows_32", 32, False, 10_000)]
    result = measure(TINY, cases)
    assert "float32" in result
    for by_case in result.values():
        assert set(by_case) == {"rows_1", "rows_4", "rows_32"} and all(ms > 0 for ms in by_case.values())
    choice = choose_dtype(EngineConfig(model="m", dtype="auto"), TINY, "cpu")
    if dtype_choice.supported_candidates() == ("float32",):  # e.g. AVX2 only: nothing to choose from
        assert (choice.dtype, choice.reason, choice.timings_ms) == ("float32", "only-supported", {})
    else:
        assert choice.reason == "measured" and choice.dtype in choice.timings_ms


def test_a_busy_moment_during_the_screen_falls_on_both_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Passes alternate fp32, bf16: bf16 is twice as fast, and three passes in a row are slowed
    # 100x by the machine. Timed one dtype after the other, all of bf16's passes were the slow ones.
    passes = iter([0.010, 0.005, 0.010, 1.0, 1.0, 1.0, 0.010, 0.005])
    monkeypatch.setattr(dtype_choice, "_clock", lambda fn: next(passes))
    shapes, _ = linear_shapes(TINY)
    assert dtype_choice.worth_measuring("bfloat16", shapes, 4)


def test_a_measurement_is_remembered_per_machine_and_shapes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two candidates on every machine (one that runs fp32 alone measures nothing), timed by a stand-in.
    monkeypatch.setattr(dtype_choice, "supported_candidates", lambda: ("float32", "bfloat16"))
    monkeypatch.setattr(dtype_choice, "measure", lambda config, cases, candidates: {
        dtype: {case.name: 2.0 if dtype == "float32" else 1.0 for case in cases} for dtype in candidates})
    cache = tmp_path / "dtype-choice.json"
    first = choose_dtype(EngineConfig(model="m", dtype="auto"), TINY, "cpu", cache)

    def no_measuring(*args: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr("engine.cpu.dtype_choice.measure", no_measuring)
    again = choose_dtype(EngineConfig(model="m", dtype="auto"), TINY, "cpu", cache)
    assert (again.dtype, again.timings_ms) == (first.dtype, first.timings_ms)
    # Other batch shapes are another measurement.
    with pytest.raises(AssertionError, match="measured again"):
        choose_dtype(EngineConfig(model="m", dtype="auto", max_num_seqs=8), TINY, "cpu", cache)


def test_helexa_dtype_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELEXA_DTYPE", "bfloat16")
    assert WorkerSettings().engine_config("model.gguf").dtype == "bfloat16"
    monkeypatch.setenv("HELEXA_DTYPE", "bf16")
    with pytest.raises(ValueError, match="HELEXA_DTYPE"):
        WorkerSettings()


def test_bf16_greedy_output_stays_within_the_fp32_agreement_bound(smollm2: Checkpoint) -> None:
    """bf16 flips near ties (so texts may part), but every token it picks must be (nearly) what
    the fp32 model would pick after the same prefix: see tests.engine.greedy_agreement."""
    bf16 = load_checkpoint(default_model_path(), dtype=torch.bfloat16)
    questions = ["What is the capital of France?", "Explain how a compass works.",
                 "List three uses of copper.", "Write a haiku about rain."]
    requests = []
    for i, question in enumerate(questions):
        text = bf16.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True)
        requests.append((f"q{i}", bf16.tokenizer.encode(text, add_special_tokens=False), 32))
    core = EngineCore(bf16, EngineConfig(model="in-memory", enable_prefix_caching=False))
    assert core.info.dtype == "bfloat16"
    outputs = run_greedy(core, requests).tokens
    agreement = Agreement()
    for request_id, prompt, _ in requests:
        agreement.add(argmax_gaps(smollm2.model, prompt, outputs[request_id]))
    assert agreement.tokens == 4 * 32
    assert agreement.ok, agreement.summary()
