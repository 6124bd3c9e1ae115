"""The C++ bf16 linear (helexa_kernels/linear/cpu_bf16_linear.cpp) against an fp32 matmul rounded once
to bf16. It exists only where the CPU has AVX512-BF16; where it does not, the engine keeps oneDNN
(tests/engine/test_cpu_linear.py)."""

from __future__ import annotations

import pytest
import torch

from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.machine import cpu_identity
from tests.kernels.helpers import AMX_FORMS

HAS_BF16_DOT = {"avx512_bf16", "avx512bw"} <= set(cpu_identity()["flags"])
HAS_AMX_BF16 = HAS_BF16_DOT and {"amx_tile", "amx_bf16"} <= set(cpu_identity()["flags"])
needs_bf16_dot = pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load(), "the CPU kernels did not build on this machine"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.bfloat16()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 sums in another order, rounded once: equal up to about one bf16 rounding step."""
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    assert cpu_kernels.bf16_linear_available() == HAS_BF16_DOT


def test_amx_tiles_serve_exactly_where_the_cpu_has_amx_bf16() -> None:
    assert cpu_kernels.bf16_linear_amx() == HAS_AMX_BF16
    with cpu_kernels.amx_off():
        assert not cpu_kernels.bf16_linear_amx()
    assert cpu_kernels.bf16_linear_amx() == HAS_AMX_BF16


# Where the CPU has AMX, K a multiple of 32 goes through its tiles (as picked) and any other K,
# or any K with AMX switched off, through AVX512-BF16; elsewhere every case is AVX512-BF16.
@needs_bf16_dot
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 16, 17, 40])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(16, 64), (40, 96), (200, 130), (64, 2), (300, 160), (72, 1536)],
                         ids=["one-block", "column-tail", "groups-and-k-chunks", "k-2", "groups-tiles",
                              "long-k"])
@pytest.mark.parametrize("form", AMX_FORMS)
def test_matches_an_fp32_matmul(rows: int, out_features: int, in_features: int, form) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.1).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    with form():
        assert_close(cpu_kernels.bf16_linear(x, packed, None, out_features), reference(x, weight, None))


@needs_bf16_dot
def test_bias_is_added_before_rounding() -> None:
    weight = (torch.randn(50, 96) * 0.1).bfloat16()
    bias = torch.randn(50).bfloat16()
    x = torch.randn(9, 96).bfloat16()
    got = cpu_kernels.bf16_linear(x, cpu_kernels.pack_bf16_weight(weight), bias.float(), 50)
    assert_close(got, reference(x, weight, bias))


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("form", AMX_FORMS)
def test_fp32_output_is_the_sums_unrounded(rows: int, form) -> None:
    """Logits: the same sums stored in fp32, so they round to the bf16 output exactly, and sit
    far closer to an fp32 matmul than one bf16 step."""
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 128, generator=generator) * 0.1).bfloat16()
    bias = torch.randn(200, generator=generator)
    x = torch.randn(rows, 128, generator=generator).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    with form():
        wide = cpu_kernels.bf16_linear(x, packed, bias, 200, torch.float32)
        narrow = cpu_kernels.bf16_linear(x, packed, bias, 200)
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), narrow)
    expected = x.float() @ weight.float().T + bias
    torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-4)
    assert not torch.equal(wide, narrow.float())  # the rounding a bf16 output would have made


@needs_bf16_dot
def test_strided_offset_and_batched_inputs() -> None:
    weight = (torch.randn(72, 64) * 0.1).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    wide = torch.randn(6, 80).bfloat16()
    for x in (wide[:, 8:72], wide[:, 1:65], torch.randn(2, 3, 64).bfloat16()):  # strided, odd offset, 3-D
        assert_close(cpu_kernels.bf16_linear(x, packed, None, 72), reference(x, weight, None))


@needs_bf16_dot
def test_columns_past_the_weight_are_never_written() -> None:
    weight = (torch.randn(20, 64) * 0.1).bfloat16()  # 2 blocks, the second 4 columns wide
    x = torch.randn(3, 64).bfloat16()
    out = torch.full((3, 32), 7.0, dtype=torch.bfloat16)
    torch.ops.helexa_cpu.bf16_linear(out[:, :20], x, cpu_kernels.pack_bf16_weight(weight), None)
    assert torch.equal(out[:, 20:], torch.full((3, 12), 7.0, dtype=torch.bfloat16))
    assert_close(out[:, :20], reference(x, weight, None))


@needs_bf16_dot
def test_mismatched_inputs_are_refused() -> None:
    packed = cpu_kernels.pack_bf16_weight(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.bf16_linear(torch.randn(2, 62).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.bf16_linear(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="last block"):
        cpu_kernels.bf16_linear(torch.randn(2, 64).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.bf16_linear(torch.randn(2, 64).bfloat16(), packed, torch.randn(31), 32)
