"""Linear layers on CPU run from weights prepacked once (engine.cpu.cpu_linear): oneDNN's copy, and in
bf16 the C++ kernel's for up to its measured row count; the same numbers as `F.linear`, in every
model family, packed by the model runner at build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.cpu import cpu_linear
from engine.frontend.engine_config import EngineConfig
from engine.models.layers import Linear
from engine.runner import ops
from engine.runner.model_runner import ModelRunner
from helexa_kernels import cpu as cpu_kernels
from tests.engine.helpers import PagedSequences
from tests.engine.tiny_models import randomized_model
from tests.kernels.helpers import BF16

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

# fp32: oneDNN and sgemm sum in different orders; bf16: both accumulate in fp32, round once.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), BF16])
@pytest.mark.parametrize("shape", [(0, 96), (1, 96), (16, 96), (3, 5, 96)])
def test_packed_linear_is_f_linear(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(shape).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    assert layer.prepack()
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_non_contiguous_rows_are_read_as_they_are() -> None:
    layer = Linear(32, 8, bias=False)
    x = torch.randn(6, 64)[:, ::2]  # every other column: strided rows
    expected = layer(x)
    layer.prepack()
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_fp16_is_left_to_f_linear() -> None:
    layer = Linear(32, 8).to(torch.float16)
    assert not layer.prepack() and layer.packed is None


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_every_family_gives_the_same_logits_packed(model_type: str) -> None:
    model = randomized_model(model_type)
    prompts = {0: list(range(3, 20)), 1: list(range(40, 47))}
    with torch.inference_mode():
        before = PagedSequences(model, [32, 32]).step(prompts)
        assert cpu_linear.prepack_model(model) > 0
        after = PagedSequences(model, [32, 32]).step(prompts)
    for plain, packed in zip(before, after, strict=True):
        torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
        assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_the_model_runner_packs_every_linear_on_cpu() -> None:
    model = randomized_model("llama")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is None for m in linears)
    ModelRunner(model, model.config, EngineConfig(model="in-memory", num_kv_blocks=8))
    assert all(m.packed is not None for m in linears)


needs_bf16_kernel = pytest.mark.skipif(not (cpu_kernels.load() and cpu_kernels.bf16_linear_available()),
                                       reason="this CPU has no AVX512-BF16")


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bf16 kernel serving up to 16 rows (as if measured so), and the row counts it got."""
    calls: list[int] = []
    real = cpu_kernels.bf16_linear

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(cpu_linear, "bf16_kernel_rows", lambda: 16)
    monkeypatch.setattr(cpu_kernels, "bf16_linear", counted)
    return calls


@needs_bf16_kernel
def test_bf16_runs_the_kernel_up_to_its_measured_rows_and_onednn_above(kernel_calls: list[int]) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16)
    assert layer.prepack() and layer.packed.kernel_rows == 16
    for rows in (1, 16, 17, 64):
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-2, rtol=1e-2)
    assert kernel_calls == [1, 16]


@pytest.mark.parametrize("dtype", [BF16, pytest.param(torch.float32, id="fp32")])
def test_logits_come_out_in_fp32_by_every_method(kernel_calls: list[int], dtype: torch.dtype) -> None:
    """An LM head's `fp32_output`: fp32 by the kernel's rows, oneDNN's and unpacked alike; from the
    kernel they are its sums unrounded (closer to an fp32 matmul than the bf16 output)."""
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=False).to(dtype)
    unpacked = Linear(96, 40, bias=False).to(dtype)
    unpacked.weight = layer.weight
    assert layer.prepack()
    for rows in (1, 16, 17):
        x = torch.randn(rows, 96).to(dtype)
        expected = x.float() @ layer.weight.float().T
        for module in (layer, unpacked):
            logits = module.fp32_output(x)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, expected, atol=2e-2, rtol=1e-2)
    if dtype == torch.bfloat16 and layer.packed.kernel_weight is not None:
        assert kernel_calls == [1, 16]
        x = torch.randn(4, 96).bfloat16()
        exact = x.float() @ layer.weight.float().T
        assert (layer.fp32_output(x) - exact).abs().max() < (layer(x).float() - exact).abs().max()


@needs_bf16_kernel
def test_torch_kernels_keep_onednn_for_bf16(kernel_calls: list[int]) -> None:
    ops.use_backend("torch", "cpu")
    try:
        layer = Linear(96, 40).to(torch.bfloat16)
        assert layer.prepack() and layer.packed.kernel_weight is None
        layer(torch.randn(2, 96).bfloat16())
    finally:
        ops.use_backend("auto")
    assert kernel_calls == []


def test_fp32_never_takes_the_bf16_kernel(kernel_calls: list[int]) -> None:
    layer = Linear(96, 40)
    assert layer.prepack() and layer.packed.kernel_weight is None
    layer(torch.randn(2, 96))
    assert kernel_calls == []


def test_the_kernels_rows_are_measured_once_and_remembered(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda: tmp_path)
    cpu_linear.bf16_kernel_rows.cache_clear()
    try:
        rows = cpu_linear.bf16_kernel_rows()
        if not (cpu_kernels.load() and cpu_kernels.bf16_linear_available()):
            assert rows == 0 and not list(tmp_path.iterdir())
            return
        assert rows in (0, *cpu_linear.KERNEL_PROBE_ROWS)
        remembered = json.loads((tmp_path / "bf16_linear_rows.json").read_text())
        assert remembered["rows"] == rows and 1 in {int(r) for r in remembered["timings_ms"]}
        # A later process on this machine reads it instead of measuring again.
        (tmp_path / "bf16_linear_rows.json").write_text(json.dumps({"rows": 4}))
        cpu_linear.bf16_kernel_rows.cache_clear()
        monkeypatch.setattr(cpu_linear, "_measure_kernel_rows", lambda: pytest.fail("measured again"))
        assert cpu_linear.bf16_kernel_rows() == 4
    finally:
        cpu_linear.bf16_kernel_rows.cache_clear()
