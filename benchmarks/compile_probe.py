"""Does torch.compile pay on CPU? Every decoder layer's MLP compiled (inductor, dynamic shapes)
against eager, decode steps at 16 sequences interleaved in one process; prints the first
compiled step's time (the compile) and min/median step times.

    python -m benchmarks.compile_probe float32 > benchmarks/results/torch_compile-cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types

import torch

from benchmarks.lib import machine_info
from benchmarks.step_profile import decode_core
from engine.loading.default_model import default_model_path
from engine.loading.loader import load_checkpoint
from engine.models.layers import GatedMLP


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    checkpoint = load_checkpoint(default_model_path(), dtype=getattr(torch, dtype))
    core = decode_core(checkpoint)
    layers = checkpoint.model.model.layers
    compiled = torch.compile(GatedMLP.forward, dynamic=True)

    def use(flag: bool) -> None:
        for layer in layers:
            if flag:
                layer.mlp.forward = types.MethodType(compiled, layer.mlp)
            else:
                layer.mlp.__dict__.pop("forward", None)

    def step_ms() -> float:
        start = time.perf_counter()
        core.step()
        return (time.perf_counter() - start) * 1000

    core.step()
    use(True)
    compile_s = step_ms() / 1000
    core.step()
    eager, comp = [], []
    for _ in range(12):
        use(False)
        eager.append(step_ms())
        use(True)
        comp.append(step_ms())
    print(json.dumps({"experiment": "torch.compile of every GatedMLP.forward, decode step at 16 sequences",
                      "dtype": dtype, "machine": machine_info(), "compile_first_step_s": round(compile_s, 1),
                      "decode16_eager_min_ms": round(min(eager), 1), "decode16_compiled_min_ms": round(min(comp), 1),
                      "decode16_eager_median_ms": round(statistics.median(eager), 1),
                      "decode16_compiled_median_ms": round(statistics.median(comp), 1)}, indent=2))


if __name__ == "__main__":
    main()
