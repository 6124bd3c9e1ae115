"""Linear layers on CPU run from weights prepacked once for oneDNN (engine.cpu_linear): the same
numbers as `F.linear`, in every model family, packed by the model runner at build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear
from engine.engine_config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.layers import Linear
from tests.engine.helpers import PagedSequences
from tests.engine.test_packed_projections import _our_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

# fp32: oneDNN and sgemm sum in different orders; bf16: both accumulate in fp32, round once.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


def _randomized(model_type: str) -> torch.nn.Module:
    model = _our_model(model_type)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_every_family_gives_the_same_logits_packed(model_type: str) -> None:
    model = _randomized(model_type)
    prompts = {0: list(range(3, 20)), 1: list(range(40, 47))}
    with torch.inference_mode():
        before = PagedSequences(model, [32, 32]).step(prompts)
        assert cpu_linear.prepack_model(model) > 0
        after = PagedSequences(model, [32, 32]).step(prompts)
    for plain, packed in zip(before, after, strict=True):
        torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
        assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_the_model_runner_packs_every_linear_on_cpu() -> None:
    model = _randomized("llama")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is None for m in linears)
    ModelRunner(model, model.config, EngineConfig(model="in-memory", num_kv_blocks=8))
    assert all(m.packed is not None for m in linears)
