from __future__ import annotations

import pytest
import torch

from helexa_kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_update,
    naive_causal_conv1d,
    naive_causal_conv1d_update,
)
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _weights(dim: int, width: int, dtype: torch.dtype, bias: bool):
    w = torch.randn(dim, 1, width, device=DEVICE).to(dtype)  # as nn.Conv1d stores it
    return w, (torch.randn(dim, device=DEVICE).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,activation", [pytest.param(False, "silu", id="silu"),
                                             pytest.param(True, None, id="bias-linear")])
@pytest.mark.parametrize("init", [pytest.param(None, id="init-all"),
                                  pytest.param([False, True, False, True], id="init-mixed")])
@pytest.mark.parametrize("width", [4, 2], ids=["w4", "w2"])
def test_prefill(width: int, init: list[bool] | None, bias: bool, activation: str | None,
                 dtype: torch.dtype) -> None:
    lens = [1, 2, 37, 5]  # shorter than the window, and past one token tile
    dim = 40
    x = torch.randn(sum(lens), dim, device=DEVICE).to(dtype)
    w, b = _weights(dim, width, dtype, bias)
    state = torch.randn(6, dim, width - 1, device=DEVICE).to(dtype)
    state_indices = torch.tensor([4, 0, 2, 5], device=DEVICE)
    flags = None if init is None else torch.tensor(init, device=DEVICE)
    ref_state, out_state = state.clone(), state.clone()
    ref = naive_causal_conv1d(x, w, b, ref_state, state_indices, _cu(lens),
                              has_initial_state=flags, activation=activation)
    out = causal_conv1d(x, w, b, out_state, state_indices, _cu(lens), has_initial_state=flags,
                        activation=activation)
    assert_close(out, ref, tol_for(dtype), "out")
    assert_close(out_state, ref_state, tol_for(dtype), "conv_state")


def test_prefill_skips_slot_minus_one() -> None:
    lens = [3, 4]
    x = torch.randn(7, 16, device=DEVICE)
    w, _ = _weights(16, 4, torch.float32, False)
    state = torch.randn(3, 16, 3, device=DEVICE)
    out_state = state.clone()
    out = causal_conv1d(x, w, None, out_state, torch.tensor([-1, 1], device=DEVICE), _cu(lens))
    ref_state = state.clone()
    ref = naive_causal_conv1d(x, w, None, ref_state, torch.tensor([-1, 1], device=DEVICE), _cu(lens))
    assert_close(out[3:], ref[3:], 1e-5)
    assert torch.equal(out_state, ref_state) and torch.equal(out_state[0], state[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 3], ids=["w4", "w3"])
def test_update(width: int, dtype: torch.dtype) -> None:
    dim = 48
    x = torch.randn(4, dim, device=DEVICE).to(dtype)
    w, b = _weights(dim, width, dtype, True)
    state = torch.randn(5, dim, width - 1, device=DEVICE).to(dtype)
    state_indices = torch.tensor([3, -1, 0, 1], device=DEVICE)
    ref_state, out_state = state.clone(), state.clone()
    ref = naive_causal_conv1d_update(x, w, b, ref_state, state_indices)
    out = causal_conv1d_update(x, w, b, out_state, state_indices)
    keep = state_indices >= 0
    assert_close(out[keep], ref[keep], tol_for(dtype), "out")
    assert torch.equal(out_state, ref_state)


def test_prefill_then_updates_equal_one_prefill() -> None:
    """The state a prefill leaves lets decode steps continue exactly where it stopped."""
    dim, width = 24, 4
    x = torch.randn(10, dim, device=DEVICE)
    w, b = _weights(dim, width, torch.float32, True)
    slot = torch.tensor([1], device=DEVICE)
    state = torch.zeros(2, dim, width - 1, device=DEVICE)
    ref = naive_causal_conv1d(x, w, b, state.clone(), slot, _cu([10]))
    head = causal_conv1d(x[:7], w, b, state, slot, _cu([7]),
                         has_initial_state=torch.tensor([False], device=DEVICE))
    steps = [causal_conv1d_update(x[t:t + 1], w, b, state, slot) for t in range(7, 10)]
    assert_close(torch.cat([head, *steps]), ref, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size(dtype: torch.dtype) -> None:
    lens, dim, width = [4000, 17, 1, 900], 8192, 4
    x = torch.randn(sum(lens), dim, device=DEVICE).to(dtype)
    w, _ = _weights(dim, width, dtype, False)
    state = torch.randn(8, dim, width - 1, device=DEVICE).to(dtype)
    idx = torch.tensor([7, 0, 3, 4], device=DEVICE)
    ref_state, out_state = state.clone(), state.clone()
    ref = naive_causal_conv1d(x, w, None, ref_state, idx, _cu(lens))
    assert_close(causal_conv1d(x, w, None, out_state, idx, _cu(lens)), ref, tol_for(dtype))
    assert_close(out_state, ref_state, tol_for(dtype), "conv_state")
    xd = torch.randn(4, dim, device=DEVICE).to(dtype)
    ref = naive_causal_conv1d_update(xd, w, None, ref_state, idx)
    assert_close(causal_conv1d_update(xd, w, None, out_state, idx), ref, tol_for(dtype))
