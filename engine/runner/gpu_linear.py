"""Batch-1 projections on a GPU: the Triton one-row product where it measures faster than cuBLAS.

A batch-1 decode step reads every weight once, and the H200 profile of Qwen3-8B showed cuBLAS
reading its qkv and o projections at ~73 % of the copy bandwidth (its gate_up at ~96 %), the
down and o projections through split-K with a reduce kernel after each. `helexa_kernels.gemv`
reads a weight in one kernel; whether it is faster depends on the shape and the device, so at
engine start, before the decode graphs are captured, `use_gemv_where_faster` times both on the
model's own weights: per weight shape, one CUDA graph over every layer's weight of that shape
(so the weights stream from memory as in a step, not from L2), cuBLAS against each tiling in
`CONFIGS`. Where a tiling wins by MARGIN, that shape's `Linear`s take `GemvLinear` in their
`packed` slot (the hook `engine.cpu.cpu_linear.Linear.forward` calls): one-row calls run the
Triton kernel, every other call F.linear as before. The LM head (fp32 logits) stays on cuBLAS.

HELEXA_GEMV=off skips the measurement; a failure inside it is logged and leaves cuBLAS
everywhere. The choices are kept (`ModelRunner.gemv_choices`) for the benchmarks to report.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu.cpu_linear import Linear

log = logging.getLogger("helexa.engine")

# A tiling must beat cuBLAS by this fraction of its time to be used.
MARGIN = 0.03
REPLAYS = 10


class GemvLinear:
    """A bias-free weight whose one-row products run `helexa_kernels.gemv` with `config`."""

    def __init__(self, weight: torch.Tensor, config: tuple[int, int, int]) -> None:
        from helexa_kernels.gemv import triton as gemv_triton

        self.weight, self.config, self._gemv = weight, config, gemv_triton.gemv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():
            return self._gemv(x, self.weight, self.config)
        return F.linear(x, self.weight)

    def fp32_output(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).float()


def _graph_ms(calls: list, stream: torch.cuda.Stream) -> float:
    """Median ms of one replay of a CUDA graph of `calls` (each run once outside it first)."""
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def _shape_groups(model: nn.Module) -> dict[tuple[int, int], list[Linear]]:
    """The model's bias-free 16-bit `Linear`s by weight shape, the LM head left out."""
    lm_head = getattr(model, "lm_head", None)
    groups: dict[tuple[int, int], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if (isinstance(module, Linear) and module is not lm_head and module.bias is None
                and module.weight.dtype in (torch.bfloat16, torch.float16)
                and module.weight.stride(1) == 1):
            groups[tuple(module.weight.shape)].append(module)
    return groups


@torch.inference_mode()
def use_gemv_where_faster(model: nn.Module, device: torch.device) -> dict[str, object]:
    """Time cuBLAS against the Triton one-row product per weight shape and install the winner
    (see the module doc); returns what was measured and chosen, by shape "NxK"."""
    if os.environ.get("HELEXA_GEMV", "auto") == "off":
        return {"skipped": "HELEXA_GEMV=off"}
    from helexa_kernels.gemv import triton as gemv_triton

    choices: dict[str, object] = {}
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        clear_gemv(model)  # an earlier engine's choice on the same model
        for (n, k), modules in _shape_groups(model).items():
            weights = [module.weight for module in modules]
            x = torch.randn(1, k, device=device, dtype=weights[0].dtype)
            timings = {"cublas": _graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights], stream)}
            for config in gemv_triton.CONFIGS:
                timings["x".join(map(str, config))] = _graph_ms(
                    [lambda w=w, c=config, x=x: gemv_triton.gemv(x, w, c) for w in weights], stream)
            best = min(gemv_triton.CONFIGS, key=lambda c: timings["x".join(map(str, c))])
            use = timings["x".join(map(str, best))] < (1 - MARGIN) * timings["cublas"]
            if use:
                for module in modules:
                    module.packed = GemvLinear(module.weight, best)  # type: ignore[assignment]  # the packed slot's GPU form
            choices[f"{n}x{k}"] = {"layers": len(modules), "ms": {name: round(t, 4) for name, t in
                                                                   timings.items()},
                                   "chosen": "x".join(map(str, best)) if use else "cublas"}
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
    except Exception as exc:  # a measurement that fails must not stop the engine: cuBLAS stays
        log.warning("batch-1 GEMV measurement failed, cuBLAS everywhere: %s", exc)
        clear_gemv(model)
        return {"error": f"{type(exc).__name__}: {exc}"}
    log.info("batch-1 projections: %s", {shape: c["chosen"] for shape, c in choices.items()
                                         if isinstance(c, dict)})
    return choices


def clear_gemv(model: nn.Module) -> None:
    """Every `Linear` back on F.linear: what an engine without decode graphs runs (a Triton
    launch from Python costs more than cuBLAS's at batch 1; the graphs are what remove it)."""
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.packed, GemvLinear):
            module.packed = None
