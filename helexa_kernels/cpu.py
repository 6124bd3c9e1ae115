"""The C++ CPU kernels: one extension built from each op's .cpp on first use, then loaded from a cache.

On CPU a decode step is small work spread over thousands of ATen calls, and their fixed cost is
much of the step. These kernels do in one call what the PyTorch forms do in several:

- `helexa_kernels/paged_attention/cpu_decode.cpp`: every decode row's attention, reading keys and values
  straight through the block tables (the PyTorch form gathers each row's keys into a padded copy
  and runs SDPA over it: ~0.4 ms a layer for 16 sequences of ~150 keys, nearly all fixed cost);
- `helexa_kernels/rmsnorm/cpu_rms_norm.cpp`: RMSNorm and the residual add before it;
- `helexa_kernels/rotary/cpu_rotary.cpp`: rotate-half RoPE of q and k, in place;
- `helexa_kernels/silu_and_mul/cpu_silu_and_mul.cpp`: the gated MLP's silu(gate) * up, rounded once;
- `helexa_kernels/kv_store/cpu_kv_store.cpp`: a step's new keys and values into the paged cache, both in
  one call;
- `helexa_kernels/linear/cpu_bf16_linear.cpp`: a bf16 linear for a few rows from a weight packed for
  AVX512-BF16's pair dot product, through AMX tiles where the CPU has them
  (`helexa_kernels/linear/amx_bf16.h`; `engine.cpu.cpu_linear` measures where it beats oneDNN);
- `helexa_kernels/decoder/cpu_decoder_stack.cpp`: a Llama-family decode step's whole layer stack, calling
  the kernels above straight from C++ (their entry points: `helexa_kernels/cpu_ops.h`), built and used by
  `engine.cpu.cpu_decode_stack`.

They run on torch's own thread pool (at::parallel_for). The extension is compiled with the
machine's own instruction set (`-march=native`), so the build is cached per CPU (model and
flags), environment, torch and source, under `$XDG_CACHE_HOME/helexa/kernels/cpu-<hash>`
(`build_directory`). The environment is part of the key because the build names its paths
(torch's headers and libraries, Python's headers): two venvs on one machine each build once and
never rebuild each other's. A directory whose build finished holds `built.json`; a start that finds
it loads the library as it is, without running the build tool. A start that builds says so first,
with a rough time (~25 s on 2 EPYC cores: all sources as one translation unit, `_unit`). Builds
of one directory take turns under an `flock` (`helexa_kernels.build_lock`), which the kernel drops
when its holder dies: a start killed mid-build never blocks the next one, and one that has to
wait says on whom. Where the kernels cannot be built (no compiler), `load()` says why once and
returns False, and `engine.runner.ops` keeps the PyTorch forms (`helexa_kernels/<op>/aten.py`,
`engine.runner.attention`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from helexa_kernels.build_lock import Holder, build_lock
from helexa_kernels.machine import cache_dir, cpu_identity

log = logging.getLogger("helexa.engine")

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "paged_attention" / "cpu_decode.cpp", HERE / "rmsnorm" / "cpu_rms_norm.cpp",
           HERE / "rotary" / "cpu_rotary.cpp", HERE / "silu_and_mul" / "cpu_silu_and_mul.cpp",
           HERE / "kv_store" / "cpu_kv_store.cpp", HERE / "linear" / "cpu_bf16_linear.cpp",
           HERE / "decoder" / "cpu_decoder_stack.cpp"]
# What they share (fp32 widening and narrowing, a dot product; AMX tiles), and the AMX forms of
# the bf16 linear and of the decode attention.
HEADERS = [HERE / "cpu_ops.h", HERE / "cpu_vec.h", HERE / "amx.h", HERE / "linear" / "amx_bf16.h",
           HERE / "paged_attention" / "amx_decode.h"]


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


NAME = "helexa_cpu"
# Written once a build has finished: a directory without it is built (again) before use.
BUILT_MARKER = "built.json"
# Our flock's file, which stays (only the lock on it comes and goes).
LOCK_FILE = "build.lock"
# Each build works in a folder of its own (`build-<pid>`), so a killed build's leftovers (torch's
# `lock` baton, objects its orphaned compilers may still write) never meet the next build.
WORK_PREFIX = "build-"
# Seconds a build takes. The sources compile as one translation unit (`_unit`): most of a source's
# compile is parsing ATen's and torch's headers, so on the 2-core EPYC seven units took 50 s (two
# at a time) where one takes 24 s (benchmarks/kernel_build.py); with more cores, seven in parallel
# would be little quicker than one. Slow small VMs may take some minutes.
BUILD_S = (15.0, 120.0)


def environment() -> dict[str, str]:
    """The paths a build names besides its sources: the interpreter's environment, torch's install
    (headers, libraries) and Python's headers."""
    return {"prefix": sys.prefix, "torch": str(Path(torch.__file__).resolve().parent),
            "torch_version": torch.__version__, "python_include": sysconfig.get_paths()["include"]}


def build_directory() -> Path:
    """Where this build lives: one folder per (sources, flags, CPU, environment, torch)."""
    identity = json.dumps({"cpu": cpu_identity(), "environment": environment(), "flags": FLAGS,
                           "sources": [source.read_text() for source in (*SOURCES, *HEADERS)]},
                          sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu-{digest}"


def build_estimate() -> str:
    """A rough time for the first build, said before it starts: "~15 s-2 min"."""
    low, high = BUILD_S
    return f"~{low:.0f} s-{high / 60:.0f} min"


def _unit(work: Path) -> Path:
    """The one translation unit the build compiles: a file in `work` that includes every source.
    Each source keeps its helpers in an anonymous namespace, so two sources may not give helpers
    the same name (the build says which, file and line)."""
    unit = work / f"{NAME}.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in SOURCES))
    return unit


def _built(directory: Path) -> bool:
    return (directory / BUILT_MARKER).is_file() and (directory / f"{NAME}.so").is_file()


def _say_waiting(directory: Path) -> Callable[[Holder], None]:
    def on_wait(holder: Holder) -> None:
        log.info("waiting for the CPU kernel build lock held by %s (%s): another start is compiling them",
                 holder.describe(), directory / LOCK_FILE)
    return on_wait


def _build(directory: Path) -> None:
    """Compile the extension in a work folder of its own, load it, then move the library into
    `directory` and mark it built; the caller holds the directory's build lock."""
    from torch.utils import cpp_extension

    # No one else builds here while we hold the lock: other work folders are killed builds'.
    for left in directory.glob(f"{WORK_PREFIX}*"):
        log.info("removing what a killed build left (%s)", left)
        shutil.rmtree(left, ignore_errors=True)
    work = directory / f"{WORK_PREFIX}{os.getpid()}"
    work.mkdir()
    log.info("compiling CPU kernels (one-time, %s) into %s ...", build_estimate(), directory)
    start = time.perf_counter()
    cpp_extension.load(name=NAME, sources=[str(_unit(work))], extra_cflags=FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(work), is_python_module=False,
                       verbose=False)
    build_s = round(time.perf_counter() - start, 1)
    os.replace(work / f"{NAME}.so", directory / f"{NAME}.so")  # loaded already; the mapping stays
    marker = directory / BUILT_MARKER
    tmp = marker.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "build_s": build_s,
                               "python": sys.executable, **environment()}))
    tmp.replace(marker)
    shutil.rmtree(work, ignore_errors=True)  # the objects: a source change is another directory
    log.info("CPU kernels built in %.1f s (%s)", build_s, directory)


@cache
def load() -> bool:
    """Load the kernels, building them first where this environment has not (once per machine and
    environment); False, with one warning, where they can't be built."""
    directory = build_directory()
    start = time.perf_counter()
    try:
        if not _built(directory):
            directory.mkdir(parents=True, exist_ok=True)
            with build_lock(directory / LOCK_FILE, on_wait=_say_waiting(directory)):
                if not _built(directory):  # else built by the start we waited for
                    _build(directory)
                    return True
        torch.ops.load_library(str(directory / f"{NAME}.so"))
    except Exception as exc:  # no compiler, no headers: the PyTorch path still serves
        lines = [line for line in str(exc).splitlines() if line.strip()]
        log.warning("CPU kernels not built (%s: %s); using the PyTorch forms", type(exc).__name__,
                    " | ".join(lines[-3:]))
        return False
    log.info("CPU kernels loaded from cache in %.1f s (%s)", time.perf_counter() - start, directory)
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


# The wrappers below take a model's hidden states as they come: [tokens, hidden] rows go to the
# kernel as they are; anything else is flattened to rows first and the result shaped back.
# (A decode step makes ~300 of these calls: each reshape and view they skip is host time saved.)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * w (`unit_offset`: (1 + w)) over the last dim, fp32 inside, in x's dtype."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    torch.ops.helexa_cpu.rms_norm(out, rows, weight, eps, unit_offset)
    return out if rows is x else out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (rounded to the residual's dtype); (norm(residual) in x's dtype,
    residual)."""
    if x.dim() == 2:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.helexa_cpu.fused_add_rms_norm(out, x, residual, weight, eps, unit_offset)
        return out, residual
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    torch.ops.helexa_cpu.fused_add_rms_norm(out, rows, residual.view(-1, x.shape[-1]), weight, eps,
                                            unit_offset)
    return out.view(x.shape), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up in fp32, in x's dtype."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], rows.shape[1] // 2)
    torch.ops.helexa_cpu.silu_and_mul(out, rows)
    return out if rows is x else out.view(*x.shape[:-1], x.shape[-1] // 2)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
            cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, HK, D] in place; returns (q, k)."""
    torch.ops.helexa_cpu.rotary_(q, k, positions, cos_sin_cache)
    return q, k


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, HK, D] into caches [blocks, block_size, HK, D] at flat slots (-1: skipped)."""
    torch.ops.helexa_cpu.kv_store(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping)


def bf16_linear_available() -> bool:
    """Whether this build has the bf16 linear (the CPU has AVX512-BF16). Needs `load()`."""
    return bool(torch.ops.helexa_cpu.bf16_linear_available())


def bf16_linear_amx() -> bool:
    """Whether the bf16 linear runs on AMX tiles where K is a multiple of 32 (the CPU has AMX-BF16
    and the process may use it). Needs `load()`."""
    return bool(torch.ops.helexa_cpu.bf16_linear_amx())


@contextmanager
def amx_off() -> Iterator[None]:
    """Within: the kernels' AMX forms stay unused (their AVX-512 forms run), to test or time those
    on a CPU that has AMX. Needs `load()`."""
    previous = torch.ops.helexa_cpu.set_amx_wanted(False)
    try:
        yield
    finally:
        torch.ops.helexa_cpu.set_amx_wanted(previous)


# Output columns per packed block of `pack_bf16_weight`: one AVX-512 register of fp32 sums.
BF16_BLOCK = 16


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> [ceil(N/16), K/2, 16, 2]: blocks of 16 output columns, K in pairs,
    the columns past N zero."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // BF16_BLOCK)
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, blocks * BF16_BLOCK - out_features))
    return padded.view(blocks, BF16_BLOCK, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., K] bf16 @ W.T (+ bias, fp32 [N]) -> [..., N] in `out_dtype` (bf16, or fp32: the sums
    as they are), W as `pack_bf16_weight(W)`."""
    if x.dim() == 2 and x.is_contiguous() and x.storage_offset() % 2 == 0:  # a step's hidden states
        out = x.new_empty(x.shape[0], out_features, dtype=out_dtype)
        torch.ops.helexa_cpu.bf16_linear(out, x, packed, bias)
        return out
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or rows.stride(0) % 2 or rows.storage_offset() % 2:
        rows = rows.contiguous()  # the kernel reads x two elements at a time
    out = torch.empty(rows.shape[0], out_features, dtype=out_dtype, device=x.device)
    torch.ops.helexa_cpu.bf16_linear(out, rows, packed, bias)
    return out.view(*x.shape[:-1], out_features)


if __name__ == "__main__":  # `python -m helexa_kernels.cpu`: build now (make setup does), not at first use
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load()
