from __future__ import annotations

import pytest
import torch

from helexa_kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tests.kernels.helpers import DEVICE, assert_close, tol_for

NUM_SLOTS = 6


def _inputs(lens: list[int], hk: int, hv: int, dk: int, dv: int,
            dtype: torch.dtype = torch.float32):
    T = sum(lens)
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=DEVICE)
    q = torch.randn(T, hk, dk, device=DEVICE).to(dtype)
    k = torch.randn(T, hk, dk, device=DEVICE).to(dtype)
    v = torch.randn(T, hv, dv, device=DEVICE).to(dtype)
    g = -torch.rand(T, hv, device=DEVICE) * 0.5  # log-decay, <= 0
    beta = torch.rand(T, hv, device=DEVICE)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, device=DEVICE) * 0.1
    # Slots out of order, and not the first ones.
    state_indices = torch.tensor([5, 1, 3, 0, 4][:len(lens)], device=DEVICE)
    return q, k, v, g, beta, state, state_indices, cu_seqlens


def _run(fn, inputs, **kwargs):
    q, k, v, g, beta, state, state_indices, cu_seqlens = inputs
    state = state.clone()
    return fn(q, k, v, g, beta, state, state_indices, cu_seqlens, **kwargs), state


def _check(out, ref, tol: float) -> None:
    assert_close(out[0], ref[0], tol, "o")
    assert_close(out[1], ref[1], tol, "state")


INIT = [pytest.param(None, id="init-all"), pytest.param([False, True, False], id="init-mixed"),
        pytest.param([False, False, False], id="init-none")]
# chunk 16: lengths below, at, across and not a multiple of it.
LENS = [pytest.param([5, 16, 37], id="5-16-37"), pytest.param([1, 33, 2], id="1-33-2")]
HEADS = [pytest.param(2, 2, id="hv2"), pytest.param(1, 3, id="gqa-hk1-hv3")]
# The chunked kernels' two forms and their chunk sizes (the wy form's is 64), with lengths
# below, at, across and not a multiple of each.
FORMS = [pytest.param("wy", 64, [5, 64, 130], id="wy-5-64-130"),
         pytest.param("wy", 64, [1, 70, 2], id="wy-1-70-2"),
         pytest.param("inline", 16, [5, 16, 37], id="inline-5-16-37"),
         pytest.param("inline", 16, [1, 33, 2], id="inline-1-33-2")]


def _flags(init: list[bool] | None) -> torch.Tensor | None:
    return None if init is None else torch.tensor(init, device=DEVICE)


@pytest.mark.parametrize("init", INIT)
@pytest.mark.parametrize("lens", LENS)
def test_naive_chunk_equals_token_by_token(lens: list[int], init: list[bool] | None) -> None:
    inputs = _inputs(lens, 2, 4, 16, 8)
    ref = _run(naive_recurrent_gated_delta_rule, inputs, has_initial_state=_flags(init))
    for chunk_size in (4, 16, 64):
        out = _run(naive_chunk_gated_delta_rule, inputs, has_initial_state=_flags(init),
                   chunk_size=chunk_size)
        _check(out, ref, 1e-5)


@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize("init", INIT)
@pytest.mark.parametrize("form,chunk_size,lens", FORMS)
def test_chunk_kernel_equals_token_by_token(form: str, chunk_size: int, lens: list[int],
                                            init: list[bool] | None, hk: int, hv: int) -> None:
    inputs = _inputs(lens, hk, hv, 16, 24)
    ref = _run(naive_recurrent_gated_delta_rule, inputs, has_initial_state=_flags(init))
    out = _run(chunk_gated_delta_rule, inputs, has_initial_state=_flags(init),
               chunk_size=chunk_size, block_v=16, form=form)
    _check(out, ref, 1e-5)


def test_wy_form_by_default_and_the_inline_one_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from helexa_kernels.gated_delta_rule import triton as gdr_triton

    inputs = _inputs([70, 3], 2, 2, 16, 16, torch.bfloat16)
    ref = _run(naive_recurrent_gated_delta_rule, inputs)
    called: list[str] = []
    for name in ("chunk_gated_delta_rule_wy", "chunk_gated_delta_rule_inline"):
        module = gdr_triton.triton_chunk if name.endswith("wy") else gdr_triton
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **kw: called.append(_n) or _r(*a, **kw))
    monkeypatch.delenv("HELEXA_GDN_CHUNK", raising=False)
    _check(_run(chunk_gated_delta_rule, inputs), ref, 1e-2)
    monkeypatch.setenv("HELEXA_GDN_CHUNK", "inline")
    _check(_run(chunk_gated_delta_rule, inputs), ref, 1e-2)
    assert called == ["chunk_gated_delta_rule_wy", "chunk_gated_delta_rule_inline"]
    with pytest.raises(ValueError, match="64"):
        _run(chunk_gated_delta_rule, inputs, chunk_size=16, form="wy")
    # fp32 on a GPU: the inline form (the wy one's exact dots spill there).
    monkeypatch.delenv("HELEXA_GDN_CHUNK")
    monkeypatch.setattr(gdr_triton, "interpreting", lambda: False)
    assert gdr_triton._default_form(torch.float32) == "inline"
    assert gdr_triton._default_form(torch.bfloat16) == "wy"


@pytest.mark.parametrize("hk,hv", HEADS)
@pytest.mark.parametrize("init", INIT)
def test_recurrent_kernel_varlen(init: list[bool] | None, hk: int, hv: int) -> None:
    inputs = _inputs([3, 9, 1], hk, hv, 16, 24)
    ref = _run(naive_recurrent_gated_delta_rule, inputs, has_initial_state=_flags(init))
    _check(_run(recurrent_gated_delta_rule, inputs, has_initial_state=_flags(init)), ref, 1e-5)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
def test_recurrent_decode_on_slots(dtype: torch.dtype) -> None:
    """One token per sequence, no cu_seqlens; slot -1 leaves every slot untouched."""
    q, k, v, g, beta, state, _, _ = _inputs([1, 1, 1, 1], 2, 4, 16, 16, dtype)
    state_indices = torch.tensor([2, -1, 0, 5], device=DEVICE)
    ref_state, out_state = state.clone(), state.clone()
    ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, ref_state, state_indices)
    out = recurrent_gated_delta_rule(q, k, v, g, beta, out_state, state_indices)
    keep = state_indices >= 0
    assert out.dtype == dtype
    assert_close(out[keep], ref[keep], tol_for(dtype), "o")
    assert_close(out_state, ref_state, 1e-5 if dtype == torch.float32 else 1e-2, "state")
    for slot in (1, 3, 4):
        assert torch.equal(out_state[slot], state[slot])


CHUNK_FORMS = [pytest.param("wy", 64, id="wy"), pytest.param("inline", 16, id="inline")]


@pytest.mark.parametrize("form,chunk_size", CHUNK_FORMS)
def test_bf16_chunk(form: str, chunk_size: int) -> None:
    inputs = _inputs([20, 70], 2, 2, 16, 16, torch.bfloat16)
    ref = _run(naive_recurrent_gated_delta_rule, inputs)
    out = _run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size, block_v=16, form=form)
    assert out[0].dtype == torch.bfloat16
    _check(out, ref, 1e-2)


@pytest.mark.parametrize("form,chunk_size", CHUNK_FORMS)
def test_chunked_prefill_then_decode_continues_the_state(form: str, chunk_size: int) -> None:
    """Prefill in two chunked calls, then decode a token: equals one pass token by token."""
    q, k, v, g, beta, state, _, _ = _inputs([100], 2, 2, 16, 16)
    slot = torch.tensor([3], device=DEVICE)
    ref_state = state.clone()
    cu_all = torch.tensor([0, 100], dtype=torch.int32, device=DEVICE)
    ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, ref_state, slot, cu_all,
                                           has_initial_state=torch.tensor([False], device=DEVICE))
    pieces = []
    for start, end, fresh in ((0, 21, True), (21, 99, False)):
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        sl = slice(start, end)
        pieces.append(chunk_gated_delta_rule(
            q[sl], k[sl], v[sl], g[sl], beta[sl], state, slot, cu,
            has_initial_state=torch.tensor([not fresh], device=DEVICE), chunk_size=chunk_size,
            block_v=16, form=form))
    sl = slice(99, 100)
    pieces.append(recurrent_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], state, slot))
    assert_close(torch.cat(pieces), ref, 1e-5, "o")
    assert_close(state[3], ref_state[3], 1e-5, "state")


def test_without_l2norm_and_custom_scale() -> None:
    inputs = _inputs([6, 71], 2, 2, 16, 16)
    q, k, *rest = inputs
    inputs = (q * 0.1, torch.nn.functional.normalize(k, dim=-1), *rest)
    kwargs = {"use_qk_l2norm": False, "scale": 0.3}
    ref = _run(naive_recurrent_gated_delta_rule, inputs, **kwargs)
    _check(_run(chunk_gated_delta_rule, inputs, block_v=16, **kwargs), ref, 1e-5)
    _check(_run(chunk_gated_delta_rule, inputs, chunk_size=16, block_v=16, form="inline",
                **kwargs), ref, 1e-5)
    _check(_run(recurrent_gated_delta_rule, inputs, **kwargs), ref, 1e-5)


def test_skipped_slots_keep_their_state() -> None:
    """Slot -1: the sequence is skipped and no slot moves (its output rows are undefined)."""
    q, k, v, g, beta, state, _, cu = _inputs([30, 80, 5], 2, 2, 16, 16)
    slots = torch.tensor([2, -1, 0], device=DEVICE)
    ref_state, out_state = state.clone(), state.clone()
    ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, ref_state, slots, cu)
    out = chunk_gated_delta_rule(q, k, v, g, beta, out_state, slots, cu)
    keep = torch.ones(115, dtype=torch.bool, device=DEVICE)
    keep[30:110] = False
    assert_close(out[keep], ref[keep], 1e-5, "o")
    assert_close(out_state, ref_state, 1e-5, "state")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
def test_full_size(dtype: torch.dtype) -> None:
    # Qwen3-Next-80B linear attention: 16 key heads, 32 value heads, 128 x 128 state.
    inputs = _inputs([1000, 64, 3, 513], 16, 32, 128, 128, dtype)
    init = torch.tensor([True, False, True, False], device=DEVICE)
    ref = _run(naive_chunk_gated_delta_rule, inputs, has_initial_state=init)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # fp32 on a GPU takes the inline form by default; both forms for bf16.
    for form in ("wy", "inline") if dtype == torch.bfloat16 else (None,):
        _check(_run(chunk_gated_delta_rule, inputs, has_initial_state=init, form=form), ref, tol)
    _check(_run(recurrent_gated_delta_rule, inputs, has_initial_state=init), ref, tol)
