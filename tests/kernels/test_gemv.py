from __future__ import annotations

import pytest
import torch

from helexa_kernels.gemv import gemv, naive_gemv
from helexa_kernels.gemv.triton import CONFIGS
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [pytest.param(c, id="x".join(map(str, c))) for c in CONFIGS])
@pytest.mark.parametrize("n,k", [pytest.param(40, 2048, id="even-k"),
                                 pytest.param(24, 1100, id="ragged-k")])
def test_gemv(n: int, k: int, config: tuple[int, int, int], dtype: torch.dtype) -> None:
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    out = gemv(x, w, config)
    assert out.dtype == dtype and out.shape == (1, n)
    assert_close(out, naive_gemv(x, w), tol_for(dtype))


def test_strided_weight_rows() -> None:
    """A weight whose rows sit in a wider buffer (a slice of a packed projection)."""
    packed = torch.randn(48, 640, device=DEVICE)
    w = packed[:, 64:576]
    x = torch.randn(1, 512, device=DEVICE)
    assert_close(gemv(x, w, (16, 512, 4)), naive_gemv(x, w), 1e-5)


def test_checks_its_inputs() -> None:
    w = torch.randn(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        gemv(torch.randn(2, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(1, 64, device=DEVICE), w.t().contiguous().t())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [pytest.param(6144, 4096, id="qkv"), pytest.param(4096, 12288, id="down")])
def test_full_size(n: int, k: int) -> None:
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k ** -0.5
    for config in CONFIGS:
        assert_close(gemv(x, w, config), naive_gemv(x, w), 1e-2)


def test_a_linear_runs_one_row_calls_through_it() -> None:
    """engine.gpu_linear's form of a Linear: one-row calls on the kernel, any other on F.linear."""
    from engine.cpu_linear import Linear
    from engine.gpu_linear import GemvLinear, clear_gemv

    layer = Linear(96, 40, bias=False).to(DEVICE)
    calls: list[int] = []
    gemv_linear = GemvLinear(layer.weight, CONFIGS[0])
    real = gemv_linear._gemv
    gemv_linear._gemv = lambda *a: calls.append(1) or real(*a)
    layer.packed = gemv_linear
    x = torch.randn(3, 96, device=DEVICE)
    with torch.no_grad():
        assert_close(layer(x[:1]), naive_gemv(x[:1], layer.weight), 1e-5)
        assert calls == [1]
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
        assert calls == [1]
    clear_gemv(layer)
    assert layer.packed is None


@pytest.mark.gpu
def test_measured_choice_on_gpu_keeps_the_outputs() -> None:
    from engine.cpu_linear import Linear
    from engine.gpu_linear import GemvLinear, use_gemv_where_faster

    model = torch.nn.Sequential(*(Linear(1024, 3072, bias=False) for _ in range(4)),
                                Linear(3072, 1024, bias=False)).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = model[0](x)
        choices = use_gemv_where_faster(model, torch.device(DEVICE))
        after = model[0](x)
    assert set(choices) == {"3072x1024", "1024x3072"}, choices
    configs = {"x".join(map(str, c)) for c in CONFIGS}
    assert all(choice["chosen"] in {"cublas", *configs} for choice in choices.values())
    assert_close(after, before, 1e-2)
    chosen = choices["3072x1024"]["chosen"] != "cublas"
    assert all(isinstance(layer.packed, GemvLinear) == chosen for layer in list(model)[:4])
