"""The one place that decides which implementation of a hot op the engine runs.

Each op has a PyTorch reference (`helexa_kernels/<op>/naive.py`) and a Triton kernel
(`helexa_kernels/<op>/triton.py`); the PyTorch path runs the references, except where a form with
fewer ATen calls computes the same thing (`helexa_kernels/<op>/aten.py` for norms, rotary, SiLU-and-mul
and the KV store; the unpadded SDPA form in `engine.runner.attention` for paged attention; and on the
Triton path too for long chunk continuations, where it is faster: engine.runner.attention_plan). Model
code calls the functions here and never picks one itself. The engine core picks once, at build,
from `EngineConfig.kernels` (the worker's `HELEXA_KERNELS`, read in apps/settings.py):

- `auto` (default): Triton on CUDA, the C++ CPU kernels on CPU, resolved against the engine's
  device;
- `cpu`: the C++ kernels of `helexa_kernels.cpu` (norms, rotary, SiLU-and-mul, the KV store, decode
  attention, and the bf16 linear that `engine.cpu.cpu_linear` runs for a few rows where it measures
  faster), built once per machine, and the PyTorch path for every other op; where they cannot be built
  (no compiler), the PyTorch path for everything;
- `torch`: the PyTorch path everywhere (e.g. to bisect a numerical problem);
- `triton`: the Triton kernels everywhere; on CPU they run only under `TRITON_INTERPRET=1`,
  which is how the CPU tests check the engine's Triton path.

Until an engine has picked (kernel tests, benches calling ops directly), `auto` holds per
tensor: Triton for CUDA tensors, the C++ kernels for CPU ones.

Triton modules are imported on first use, so a CPU engine never loads Triton.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch

from engine.frontend.engine_config import KERNEL_CHOICES
from engine.runner import attention_plan
from engine.runner.attention import attend_chunks, sdpa_chunks, store_and_attend
from engine.runner.attention import paged_attention as sdpa_paged_attention
from engine.runner.step_metadata import AttentionMetadata
from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.causal_conv1d import naive as conv_naive
from helexa_kernels.gated_delta_rule import naive as gdr_naive
from helexa_kernels.gdn_gating import naive as gating_naive
from helexa_kernels.kv_store import naive as kv_store_naive
from helexa_kernels.moe import naive as moe_naive
from helexa_kernels.rmsnorm import aten as rmsnorm_aten
from helexa_kernels.rmsnorm import naive as rmsnorm_naive
from helexa_kernels.rotary import aten as rotary_aten
from helexa_kernels.silu_and_mul import aten as silu_and_mul_aten

# "torch", "triton" or "cpu" once an engine has picked; None: auto, per tensor device.
_backend: str | None = None


def resolve_backend(choice: str, device: torch.device | str) -> str:
    """'torch', 'triton' or 'cpu': what `choice` (one of KERNEL_CHOICES) means on `device`."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "triton" if torch.device(device).type == "cuda" else "cpu"


def use_backend(choice: str, device: torch.device | str | None = None) -> str:
    """Pick the ops' implementation from now on: `choice` resolved for `device`; `auto` without
    a device goes back to per-tensor auto. Returns what is in use ('auto' for the latter). The C++
    CPU kernels are built (once per machine) when they are picked, not on the first step."""
    global _backend
    if device is None and choice == "auto":
        _backend = None
        return "auto"
    _backend = resolve_backend(choice, device if device is not None else "cpu")
    if _backend == "cpu":
        cpu_kernels.load()
    return _backend


def backend_for(device: torch.device | str) -> str:
    """'triton', 'torch' or 'cpu': what ops run for tensors on `device`."""
    return _backend or resolve_backend("auto", device)


def _use_triton(x: torch.Tensor) -> bool:
    if _backend is None:
        return x.is_cuda
    return _backend == "triton"


def cpu_kernels_picked() -> bool:
    """Whether CPU tensors go through the C++ CPU kernels: picked (or auto), and built here."""
    return _backend in (None, "cpu") and cpu_kernels.load()


def _use_cpu_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_kernels_picked()


@cache
def triton_module(op: str) -> ModuleType:
    return importlib.import_module(f"helexa_kernels.{op}.triton")


# --- norms -----------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim in fp32 (`unit_offset`: (1 + w), Qwen3-Next/3.5)."""
    if _use_triton(x):
        return triton_module("rmsnorm").rms_norm(x, weight, eps, unit_offset=unit_offset)
    if _use_cpu_kernels(x):
        return cpu_kernels.rms_norm(x, weight, eps, unit_offset)
    return rmsnorm_aten.rms_norm(x, weight, eps, unit_offset=unit_offset)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       *, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place; returns (rms_norm(residual), residual)."""
    if _use_triton(x):
        return triton_module("rmsnorm").fused_add_rms_norm(x, residual, weight, eps,
                                                     unit_offset=unit_offset)
    if _use_cpu_kernels(x):
        return cpu_kernels.fused_add_rms_norm(x, residual, weight, eps, unit_offset)
    return rmsnorm_aten.fused_add_rms_norm(x, residual, weight, eps, unit_offset=unit_offset)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """rms_norm(x) * w * silu(z): the norm after the gated delta rule."""
    if _use_triton(x):
        return triton_module("rmsnorm").gated_rms_norm(x, z, weight, eps)
    return rmsnorm_naive.naive_gated_rms_norm(x, z, weight, eps)


# --- attention -------------------------------------------------------------------------------

def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor,
           step_tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, HK, D]; cos_sin_cache [max_pos, rotary_dim].
    `step_tables`: this step's `rotary_step_tables`, shared by its layers.

    The Triton path and the CPU kernel rotate in place: callers pass fresh projections they own.
    """
    if _use_triton(q):
        return triton_module("rotary").rotary(q, k, positions, cos_sin_cache, inplace=True)
    if _use_cpu_kernels(q) and cos_sin_cache.dtype == torch.float32:
        return cpu_kernels.rotary_(q, k, positions, cos_sin_cache)
    return rotary_aten.rotary(q, k, step_tables or rotary_aten.rotary_tables(positions, cos_sin_cache))


def rotary_step_tables(positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The PyTorch path's cos/sin at a step's positions, gathered once for all its layers; None
    where a kernel (Triton, or the C++ one on CPU) reads the table itself."""
    if _use_triton(positions) or _use_cpu_kernels(positions):
        return None
    return rotary_aten.rotary_tables(positions, cos_sin_cache)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """New k/v [T, HK, D] into the paged caches at their flat slots; slot -1 is skipped
    (CUDA-graph padding rows use it)."""
    if _use_triton(k):
        triton_module("kv_store").kv_store(k, v, k_cache, v_cache, slot_mapping)
    elif _use_cpu_kernels(k):
        cpu_kernels.kv_store(k, v, k_cache, v_cache, slot_mapping)
    else:
        kv_store_naive.naive_kv_store(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over the cache (keys already stored; the step's
    own `k`/`v`, when given, spare the PyTorch path gathering them back for whole prefills)."""
    if _use_triton(q):
        # Long chunk continuations go through SDPA, faster there (engine.runner.attention_plan).
        chunks = sdpa_chunks(meta, k_cache.shape[1], q.device)
        out = triton_module("paged_attention").paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, max_seq_len=meta.max_seq_len,
            skip_chunks_from=attention_plan.SDPA_CHUNK_MIN_QUERIES if chunks else 0)
        attend_chunks(out, q, k_cache, v_cache, chunks, scale)
        return out
    return sdpa_paged_attention(q, k_cache, v_cache, meta, scale, k, v, decode_kernel=_use_cpu_kernels(q))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's k/v, then attend with q: what a model's attention layer calls."""
    if not _use_triton(q):
        kernels = _use_cpu_kernels(q)
        return store_and_attend(q, k, v, k_cache, v_cache, meta, scale, decode_kernel=kernels,
                                store_kernel=kernels)
    kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale)


def rotary_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor,
                     step_tables: tuple[torch.Tensor, torch.Tensor] | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, *, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     unit_offset: bool = False) -> torch.Tensor:
    """An attention layer between its projections: q and k normalized per head (when given their
    norm weights, Qwen3's q_norm/k_norm), rotated (`rotary`), k/v stored, then attention.

    The Triton path runs the first three as one kernel (`helexa_kernels.rotary_kv_store`), in
    place on q and k; the other paths run `rms_norm`, `rotary` and `attention` as before."""
    if _use_triton(q):
        triton_module("rotary_kv_store").rotary_kv_store(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
            q_norm_weight, k_norm_weight, eps, unit_offset=unit_offset)
        return paged_attention(q, k_cache, v_cache, meta, scale)
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, eps, unit_offset=unit_offset)
        k = rms_norm(k, k_norm_weight, eps, unit_offset=unit_offset)
    q, k = rotary(q, k, positions, cos_sin_cache, step_tables)
    return attention(q, k, v, k_cache, v_cache, meta, scale)


# --- MLP -------------------------------------------------------------------------------------

def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up."""
    if _use_triton(x):
        return triton_module("silu_and_mul").silu_and_mul(x)
    if _use_cpu_kernels(x):
        return cpu_kernels.silu_and_mul(x)
    return silu_and_mul_aten.silu_and_mul(x)


def moe_routing(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top k, optional renormalization -> (weights fp32, ids int32)."""
    if _use_triton(router_logits):
        return triton_module("moe").moe_routing(router_logits, top_k, renormalize)
    return moe_naive.naive_moe_routing(router_logits, top_k, renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' SiLU-gated MLPs, weighted and summed per token: [T, H] -> [T, H]."""
    if _use_triton(hidden):
        return triton_module("moe").fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    return moe_naive.naive_fused_moe(hidden, w13, w2, topk_weights, topk_ids)


# --- gated DeltaNet (hybrid models) ----------------------------------------------------------

def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) fp32 [T, HV]: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    if _use_triton(a):
        return triton_module("gdn_gating").gdn_gating(A_log, a, b, dt_bias)
    return gating_naive.naive_gdn_gating(A_log, a, b, dt_bias)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, state_indices: torch.Tensor,
                  cu_seqlens: torch.Tensor, *, has_initial_state: torch.Tensor | None = None,
                  activation: str | None = "silu") -> torch.Tensor:
    """Varlen prefill of the depthwise causal conv; each sequence's conv_state slot updated."""
    fn = triton_module("causal_conv1d").causal_conv1d if _use_triton(x) else conv_naive.naive_causal_conv1d
    return fn(x, weight, bias, conv_state, state_indices, cu_seqlens,
              has_initial_state=has_initial_state, activation=activation)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor, *,
                         activation: str | None = "silu") -> torch.Tensor:
    """Decode: one token per sequence through its conv_state slot."""
    fn = (triton_module("causal_conv1d").causal_conv1d_update if _use_triton(x)
          else conv_naive.naive_causal_conv1d_update)
    return fn(x, weight, bias, conv_state, state_indices, activation=activation)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                           cu_seqlens: torch.Tensor, *, scale: float | None = None,
                           use_qk_l2norm: bool = True,
                           has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill form of the gated delta rule (see helexa_kernels/gated_delta_rule/naive.py)."""
    fn = (triton_module("gated_delta_rule").chunk_gated_delta_rule if _use_triton(v)
          else gdr_naive.naive_chunk_gated_delta_rule)
    return fn(q, k, v, g, beta, state, state_indices, cu_seqlens, scale=scale,
              use_qk_l2norm=use_qk_l2norm, has_initial_state=has_initial_state)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                               *, scale: float | None = None, use_qk_l2norm: bool = True,
                               has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """Token-by-token form (decode: cu_seqlens None, one token per sequence)."""
    fn = (triton_module("gated_delta_rule").recurrent_gated_delta_rule if _use_triton(v)
          else gdr_naive.naive_recurrent_gated_delta_rule)
    return fn(q, k, v, g, beta, state, state_indices, cu_seqlens, scale=scale,
              use_qk_l2norm=use_qk_l2norm, has_initial_state=has_initial_state)
