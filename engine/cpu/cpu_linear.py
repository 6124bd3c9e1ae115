"""How a linear layer runs on CPU: from copies of its weight packed once, by the fastest method
for the rows at hand.

`F.linear` on CPU reorders the weight into the matmul kernel's blocked layout on every call
(bf16 through oneDNN) or runs a plain sgemm (fp32). For a decode step, which streams every weight
once for a handful of rows, that reorder is most of the work: on a 2-core AVX-512 machine the
default model's projections at 16 rows run 1.65× faster from prepacked weights in bf16 and 2.2×
in fp32, 1.5-1.6× at one row, about the same at 512 (`benchmarks/cpu_linear.py`,
benchmarks/results/archive/cpu_linear-cpu-epyc.json). So the model runner packs every linear layer's weight
once, at build (`prepack_model`), and `engine.models.layers.Linear` runs from the packed copy.

In bf16, on CPUs with AVX512-BF16 and with the C++ kernels picked (`engine.runner.ops`), a second copy
is packed for `helexa_kernels/linear/cpu_bf16_linear.cpp`, which streams the weight at close to memory
speed for a few rows where oneDNN does not (on a Zen 4, the default model's projections: 1 row
12.9 against 18.7 ms, 16 rows 17.0 against 20.8, benchmarks/results/cpu_linear-cpu-epyc-kernel.json).
Where the CPU has AMX-BF16 the kernel multiplies on AMX tiles, from the same packed copy (on a
2-core Sapphire Rapids, the projections at 16 rows: 11.4 against oneDNN's 14.6 ms,
`helexa_kernels/linear/amx_bf16.h`). Up to how many rows it runs is measured once per machine
(`bf16_kernel_rows`): there oneDNN wins from ~64 rows.

The checkpoint's own weight stays as it is (the loader, tied embeddings and the parity tests read
it); each packed copy costs one more copy of the linear weights in memory. Only CPU tensors in
fp32 or bf16 are packed, only where this torch has oneDNN, and bf16 only where oneDNN supports it
on this CPU (`engine.cpu.cpu_support`: on an AVX2-only part oneDNN's bf16 reorder raises, where
`F.linear` still runs); everything else runs `F.linear`. `pack` refuses such a weight itself,
so nothing reaches oneDNN's bf16 path on a CPU without it. `dtype_choice` times the same op the
engine will run (`linear_op`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import cpu_support
from engine.runner import ops
from helexa_kernels import cpu as cpu_kernels

log = logging.getLogger("helexa.engine")

PACKABLE = (torch.float32, torch.bfloat16)
# The row count oneDNN is told to expect; measured: any of 1, 16 or 512 serves 1 to 2048 rows alike.
BATCH_HINT = 16


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE
            and torch.backends.mkldnn.is_available() and cpu_support.dtype_supported(weight.dtype))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> an opaque oneDNN tensor of the same weight, laid out for its matmul. Raises
    `UnsupportedDtype` for a dtype this CPU's oneDNN cannot run (as oneDNN itself would)."""
    cpu_support.require(str(weight.dtype).removeprefix("torch."))
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b from `pack(W)`; x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Row counts at which the bf16 kernel is timed against oneDNN, and the weights it is timed on:
# 32 MiB of bf16, past the caches, as a decode step streams them.
KERNEL_PROBE_ROWS = (1, 4, 16, 64, 128, 256)
KERNEL_PROBE_SHAPE = (2048, 1024)
KERNEL_PROBE_WEIGHTS = 8
KERNEL_PROBE_PASSES = 5


def _kernel_built() -> bool:
    """The C++ kernels are picked (`engine.runner.ops`), this build has the bf16 linear, and bf16 runs here
    at all (its measurement packs a bf16 weight for oneDNN too)."""
    return (cpu_support.dtype_supported("bfloat16") and ops.cpu_kernels_picked()
            and cpu_kernels.bf16_linear_available())


def _kernel_applies(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0
            and _kernel_built())


@cache
def bf16_kernel_rows() -> int:
    """Up to how many rows the bf16 kernel beats prepacked oneDNN here (0: never, or not built):
    measured once per machine, kernel build and torch (`_measure_kernel_rows`), then remembered
    beside the kernel's build."""
    if not _kernel_built():
        return 0
    remembered = cpu_kernels.build_directory() / "bf16_linear_rows.json"
    try:
        return int(json.loads(remembered.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("timing the bf16 linear kernel against oneDNN (once per machine and build) ...")
    rows, timings = _measure_kernel_rows()
    log.info("bf16 linear kernel for up to %d rows, oneDNN above (one thread, ms per %d MiB of "
             "weights: %s)", rows, KERNEL_PROBE_WEIGHTS * KERNEL_PROBE_SHAPE[0] * KERNEL_PROBE_SHAPE[1] * 2 >> 20,
             timings)
    try:
        remembered.write_text(json.dumps({"rows": rows, "timings_ms": timings}))
    except OSError as exc:
        log.warning("could not remember the bf16 kernel measurement (%s)", exc)
    return rows


def _measure_kernel_rows() -> tuple[int, dict[int, dict[str, float]]]:
    """Both methods timed over the same weights, passes interleaved, the fastest pass of each; the
    first row count where oneDNN is as fast ends the kernel's range. On one thread: a core taken
    by another process for a moment (the services starting beside the engine) stalls a 2-thread
    pass at its barrier and can turn the result over (measured: 16 rows 1.7 ms against oneDNN's
    6.2, 1 row 29 against 1.8, while a load burst ran); one thread ranks the two as two do. And in
    this thread's CPU time, not wall time: a pass the thread spent partly preempted counted the
    wait (measured while the test suite loaded the machine: 4 rows 6.1 ms against oneDNN's 3.4,
    so the kernel was kept to 1 row and a 16-row decode step took 50 ms instead of 36)."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = KERNEL_PROBE_SHAPE
    weights = [torch.empty(KERNEL_PROBE_SHAPE).uniform_(-0.05, 0.05, generator=generator).bfloat16()
               for _ in range(KERNEL_PROBE_WEIGHTS)]
    # The defaults call on purpose (B008): each weight is packed once, as the list is built.
    methods = {"kernel": [lambda x, p=cpu_kernels.pack_bf16_weight(w): cpu_kernels.bf16_linear(x, p, None, out_features)  # noqa: B008
                          for w in weights],
               "onednn": [lambda x, p=pack(w): packed_linear(x, p, None) for w in weights]}  # noqa: B008
    timings: dict[int, dict[str, float]] = {}
    limit = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in KERNEL_PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=generator).bfloat16()
            best = {name: float("inf") for name in methods}
            for fns in methods.values():  # untimed: oneDNN makes its primitive for this row count
                fns[0](x)
            for _ in range(KERNEL_PROBE_PASSES):
                for name, fns in methods.items():
                    start = time.thread_time()
                    for fn in fns:
                        fn(x)
                    best[name] = min(best[name], time.thread_time() - start)
            timings[rows] = {name: round(t * 1000, 3) for name, t in best.items()}
            if best["kernel"] >= best["onednn"]:
                break
            limit = rows
    finally:
        torch.set_num_threads(threads)
    return limit, timings


def method() -> str:
    """How linears run here: part of what a remembered dtype measurement was taken with
    (engine.cpu.dtype_cache)."""
    if not torch.backends.mkldnn.is_available():
        return "F.linear"
    if _kernel_built():
        return "onednn-prepacked+bf16-kernel" + ("-amx" if cpu_kernels.bf16_linear_amx() else "")
    return "onednn-prepacked"


class PackedWeight:
    """One weight (and bias) as the CPU engine runs it: prepacked for oneDNN, and in bf16 where
    the kernel applies also packed for it, which then serves calls of up to `kernel_rows` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.onednn = pack(weight)
        self.bias = bias
        self.kernel_rows = bf16_kernel_rows() if _kernel_applies(weight) else 0
        self.kernel_elements = self.kernel_rows * self.in_features  # the most x may hold for it
        self.kernel_weight = cpu_kernels.pack_bf16_weight(weight) if self.kernel_rows else None
        self.kernel_bias = (bias.detach().float().contiguous()
                            if bias is not None and self.kernel_weight is not None else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernel_weight is not None and x.dtype == torch.bfloat16
                and x.numel() <= self.kernel_elements):
            return cpu_kernels.bf16_linear(x, self.kernel_weight, self.kernel_bias, self.out_features)
        return packed_linear(x, self.onednn, self.bias)

    def fp32_output(self, x: torch.Tensor) -> torch.Tensor:
        """The same product in fp32 (logits): the bf16 kernel stores its fp32 sums as they are;
        oneDNN's output is widened."""
        if (self.kernel_weight is not None and x.dtype == torch.bfloat16
                and x.numel() <= self.kernel_elements):
            return cpu_kernels.bf16_linear(x, self.kernel_weight, self.kernel_bias, self.out_features,
                                           torch.float32)
        return packed_linear(x, self.onednn, self.bias).float()


def linear_op(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T as the engine runs it for this weight (packed where it can be)."""
    if can_pack(weight):
        return PackedWeight(weight, None)
    return lambda x: F.linear(x, weight)


class Linear(nn.Linear):
    """`nn.Linear` that runs from packed copies of its weight once `prepack` has made them.
    The copies are taken when `prepack` runs: call it once the weights are final (and again if
    they are ever changed in place)."""

    packed: PackedWeight | None = None

    def prepack(self) -> bool:
        if not can_pack(self.weight):
            return False
        self.packed = PackedWeight(self.weight, self.bias)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

    def fp32_output(self, x: torch.Tensor) -> torch.Tensor:
        """This layer's output in fp32 whatever the model dtype: an LM head's logits. Rounded to
        bf16 (8 bits of mantissa: steps of 0.0625 at a logit of 10), two tokens a few hundredths
        apart get the same logit, and greedy picks between them by token id (measured on the
        default model on a Sapphire Rapids: "What is the capital of France?" started "L'Étoile"
        where fp32 says "The capital of France is Paris.", 0.08 logits apart)."""
        if self.packed is not None:
            return self.packed.fp32_output(x)
        return F.linear(x, self.weight, self.bias).float()


def prepack_model(model: nn.Module) -> int:
    """Pack every `Linear` of the model that can be (call once its weights are loaded);
    returns how many were. Seconds for a small model on 2 cores, so it is announced."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    if not any(can_pack(module.weight) for module in linears):
        return 0
    log.info("prepacking %d linear layers for oneDNN ...", len(linears))
    start = time.perf_counter()
    packed = sum(module.prepack() for module in linears)
    log.info("%d linear layers prepacked in %.1f s", packed, time.perf_counter() - start)
    return packed
