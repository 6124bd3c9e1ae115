"""The CPU decode kernel (cpu_decode.cpp): built on first use, then loaded from a cache.

On CPU a decode step's attention is tiny work spread over many small calls: gathering each
sequence's keys into a padded copy and running SDPA over it costs ~0.4 ms a layer for 16
sequences of ~150 keys, nearly all of it fixed cost. The C++ kernel reads keys and values
straight through the block tables, one task per (sequence, kv head) on torch's own thread pool.

It is compiled with the machine's own instruction set (`-march=native`), so the build is
cached per CPU (model and flags) and torch version, under `$XDG_CACHE_HOME/helexa/kernels`.
Where it cannot be built (no compiler), `load()` says why once and returns False, and the
engine keeps the PyTorch path (engine.attention).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import cache
from pathlib import Path

import torch

from engine.dtype_cache import cpu_identity

log = logging.getLogger("helexa.engine")

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def _capability() -> list[str]:
    """ATen's vector width for this CPU: its Vectorized<float> is 16 lanes with AVX-512, 8 with
    AVX2, plain arrays otherwise."""
    flags = set(cpu_identity()["flags"])
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


FLAGS = ["-O3", "-march=native", "-fopenmp", *_capability()]


def build_directory() -> Path:
    """Where this CPU's build lives: one folder per (source, flags, CPU, torch)."""
    identity = json.dumps({"cpu": cpu_identity(), "torch": torch.__version__, "flags": FLAGS,
                           "source": SOURCE.read_text()}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "helexa" / "kernels" / f"cpu_decode-{digest}"


@cache
def load() -> bool:
    """Build (once per machine) and load the kernel; False, with one warning, where it can't be."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name="helexa_cpu_decode", sources=[str(SOURCE)], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory),
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no headers: the PyTorch path still serves
        log.warning("CPU decode attention kernel not built (%s: %s); using the PyTorch path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           token_rows: torch.Tensor, seq_rows: torch.Tensor, scale: float) -> None:
    """out[token_rows[i]] = one query's attention over the first seq_lens[seq_rows[i]] keys of
    sequence seq_rows[i]. q, out: [num_tokens, num_heads, head_dim]; caches [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32; seq_lens
    [num_seqs] int32; token_rows, seq_rows [n] int64. Needs `load()` to have returned True."""
    torch.ops.helexa_cpu.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens,
                                                token_rows, seq_rows, scale)
