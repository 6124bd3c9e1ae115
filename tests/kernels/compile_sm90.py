"""Compile every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

The interpreter runs kernels as NumPy, so it never sees what only the compiler rejects (types
that change across a loop, layouts, unsupported ops). This script calls each launcher at real
model sizes with the kernels swapped for recorders (nothing runs), then compiles every recorded
launch with Triton's own compiler and bundled ptxas for sm_90, and prints one JSON line per
launch with ptxas's registers and spill (stack) bytes. Exit status 1 if any launch fails.

Run without TRITON_INTERPRET (the interpreter replaces Triton's own jit helpers):
    TRITON_INTERPRET=0 python tests/kernels/compile_sm90.py
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                 torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _record(module_name: str, *kernel_names: str):
    module = importlib.import_module(module_name)
    recorders = []
    for name in kernel_names:
        recorder = Recorder(getattr(module, name))
        setattr(module, name, recorder)
        recorders.append(recorder)
    return module, recorders


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _divisible_by_16(value: object) -> bool:
    """What Triton's JIT tells the compiler about an argument on the GPU (tt.divisibility 16: a
    pointer 16-byte aligned, an int a multiple of 16), which lets loads vectorize: without it
    the registers and spills reported here would be a worse case than the GPU's."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _resource_usage(cubin: bytes) -> dict[str, int]:
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])} if found else {}


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict) -> dict[str, object]:
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = values[param.name]
        else:
            signature[param.name] = _arg_type(values[param.name])
            if _divisible_by_16(values[param.name]):
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                              options=options)
    blocks = {name: str(v) for (i,), v in constexprs.items()
              if (name := kernel.params[i].name).startswith(("B", "GROUP", "DOT"))}
    return {"kernel": kernel.fn.__name__, "tiles": blocks, **options,
            **_resource_usage(compiled.asm["cubin"])}


def record_all() -> list[Recorder]:
    """Call every launcher once per tiling it picks, at Qwen3-8B / Qwen3-Next sizes."""
    bf, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    recorders: list[Recorder] = []

    m, r = _record("helexa_kernels.rmsnorm.triton", "rms_norm_fwd_kernel")
    x, w = torch.zeros(2, 4096, dtype=bf), torch.zeros(4096, dtype=bf)
    m.fused_add_rms_norm(x, x.clone(), w, unit_offset=True)
    m.gated_rms_norm(x[:, :128], x[:, :128], w[:128])
    recorders += r
    m, r = _record("helexa_kernels.silu_and_mul.triton", "silu_and_mul_fwd_kernel")
    m.silu_and_mul(torch.zeros(2, 2 * 12288, dtype=bf))
    recorders += r
    m, r = _record("helexa_kernels.rotary.triton", "rotary_fwd_kernel")
    m.rotary(torch.zeros(2, 32, 128, dtype=bf), torch.zeros(2, 8, 128, dtype=bf),
             torch.zeros(2, dtype=i64), torch.zeros(8, 64), inplace=True)
    recorders += r
    m, r = _record("helexa_kernels.kv_store.triton", "kv_store_fwd_kernel")
    cache = torch.zeros(4, 16, 8, 128, dtype=bf)
    m.kv_store(torch.zeros(2, 8, 128, dtype=bf), torch.zeros(2, 8, 128, dtype=bf), cache,
               cache.clone(), torch.zeros(2, dtype=i64))
    recorders += r

    m, r = _record("helexa_kernels.rotary_kv_store.triton", "rotary_kv_store_fwd_kernel")
    q = torch.zeros(2, 32, 128, dtype=bf)
    m.rotary_kv_store(q, q[:, :8], q[:, 8:16], torch.zeros(2, dtype=i64), torch.zeros(8, 128),
                      cache, cache.clone(), torch.zeros(2, dtype=i64), w[:128], w[:128])
    q = torch.zeros(2, 16, 256, dtype=bf)  # Qwen3.5's gated attention: (1 + w), partial rotary
    m.rotary_kv_store(q, q[:, :2], q[:, 2:4], torch.zeros(2, dtype=i64), torch.zeros(8, 64),
                      torch.zeros(4, 16, 2, 256, dtype=bf), torch.zeros(4, 16, 2, 256, dtype=bf),
                      torch.zeros(2, dtype=i64), w[:256], w[:256], unit_offset=True)
    m.rotary_kv_store(q, q[:, :2], q[:, 2:4], torch.zeros(2, dtype=i64), torch.zeros(8, 256),
                      torch.zeros(4, 16, 2, 256, dtype=bf), torch.zeros(4, 16, 2, 256, dtype=bf),
                      torch.zeros(2, dtype=i64))  # Llama: no norm
    recorders += r

    m, r = _record("helexa_kernels.gemv.triton", "gemv_fwd_kernel")
    for config in m.CONFIGS:
        m.gemv(torch.zeros(1, 4096, dtype=bf), torch.zeros(6144, 4096, dtype=bf), config)
    m.gemv(torch.zeros(1, 1100, dtype=bf), torch.zeros(64, 1100, dtype=bf))  # ragged K
    recorders += r

    m, r = _record("helexa_kernels.paged_attention.triton", "paged_attention_fwd_kernel",
                   "paged_attention_split_fwd_kernel", "paged_attention_split_reduce_kernel")
    meta = (torch.tensor([0, 1, 2], dtype=i32), torch.tensor([5, 5], dtype=i32),
            torch.zeros(2, 4, dtype=i32))
    for dtype, max_query_len in ((bf, 1), (bf, 2), (torch.float32, 1), (torch.float32, 2)):
        kv = cache.to(dtype)
        m.paged_attention(torch.zeros(2, 32, 128, dtype=dtype), kv, kv, *meta, max_query_len, 0.1,
                          num_splits=1)
        if max_query_len == 1:  # and split-K, as a small batch runs it
            m.paged_attention(torch.zeros(2, 32, 128, dtype=dtype), kv, kv, *meta, 1, 0.1,
                              num_splits=16)
    recorders += r

    m, r = _record("helexa_kernels.gated_delta_rule.triton", "recurrent_gated_delta_rule_fwd_kernel",
                   "chunk_gated_delta_rule_fwd_kernel")
    q, v = torch.zeros(3, 16, 128, dtype=bf), torch.zeros(3, 32, 128, dtype=bf)
    g, state = torch.zeros(3, 32), torch.zeros(4, 32, 128, 128)
    slots, cu, init = torch.zeros(3, dtype=i64), torch.tensor([0, 3], dtype=i32), torch.ones(1, dtype=torch.bool)
    m.recurrent_gated_delta_rule(q, q, v, g, g, state, slots)
    m.chunk_gated_delta_rule(q, q, v, g, g, state, slots[:1], cu, has_initial_state=init,
                             form="inline")
    recorders += r
    m, r = _record("helexa_kernels.gated_delta_rule.triton_chunk",
                   "chunk_gated_delta_rule_wy_prepare_fwd_kernel", "chunk_gated_delta_rule_wy_fwd_kernel")
    for block_v in (64, 32):  # bf16 only: fp32 inputs take the inline form on a GPU
        m.chunk_gated_delta_rule_wy(q, q, v, g, g, state, slots[:1], cu, scale=0.1,
                                    use_qk_l2norm=True, has_initial_state=init.int(),
                                    has_init_flags=True, block_v=block_v)
    recorders += r

    m, r = _record("helexa_kernels.causal_conv1d.triton", "causal_conv1d_fwd_kernel",
                   "causal_conv1d_update_fwd_kernel")
    x, w, conv = torch.zeros(3, 8192, dtype=bf), torch.zeros(8192, 4, dtype=bf), torch.zeros(4, 8192, 3, dtype=bf)
    m.causal_conv1d(x, w, None, conv, slots[:1], cu, has_initial_state=init)
    m.causal_conv1d_update(x, w, None, conv, slots)
    recorders += r
    m, r = _record("helexa_kernels.gdn_gating.triton", "gdn_gating_fwd_kernel")
    m.gdn_gating(torch.zeros(32), torch.zeros(3, 32, dtype=bf), torch.zeros(3, 32, dtype=bf),
                 torch.zeros(32))
    recorders += r
    m, r = _record("helexa_kernels.moe.triton", "moe_routing_fwd_kernel", "grouped_matmul_fwd_kernel")
    m.moe_routing(torch.zeros(3, 128), 8, True)
    m.moe_routing(torch.zeros(3, 512), 10, True)
    m.grouped_matmul(torch.zeros(16, 2048, dtype=bf), torch.zeros(4, 1536, 2048, dtype=bf),
                     torch.tensor([0, 4, 4, 10, 16]))
    recorders += r
    return recorders


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter replaces Triton's jit helpers")
    failed = 0
    for recorder in record_all():
        for args, kwargs in recorder.launches:
            try:
                print(json.dumps(compile_launch(recorder.kernel, args, kwargs)), flush=True)
            except Exception as exc:
                failed += 1
                print(json.dumps({"kernel": recorder.kernel.fn.__name__, "error": str(exc)}),
                      flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
