"""How the CPU engine's linears run, over the default model's projection shapes: `F.linear`,
oneDNN from prepacked weights, and in bf16 the C++ kernel (helexa_kernels/linear/cpu_bf16_linear.cpp,
where the CPU has AVX512-BF16).

One pass runs every linear layer of SmolLM2-135M as built (30 layers of qkv, o, gate_up, down,
each with its own weight, so weights stream from memory as in a real step) and the LM head, at
1, 16, 64 and 512 rows, in fp32 and bf16. The methods alternate pass by pass in one process, so
a busy moment hits each alike; each figure is the median of `--runs` passes. A method's speed is
withheld if its outputs differ from `F.linear`'s beyond the dtype's rounding.

    python -m benchmarks.cpu_linear --out benchmarks/results/cpu_linear-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib import emit, machine_info
from engine.cpu import cpu_linear
from engine.cpu.dtype_choice import linear_shapes
from engine.loading.default_model import default_model_path
from engine.loading.loader import read_model_config
from helexa_kernels import cpu as cpu_kernels

ROWS = (1, 16, 64, 512)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def one_pass(fns: list, inputs: dict[int, torch.Tensor], in_features: list[int]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = [fn(inputs[k]) for fn, k in zip(fns, in_features, strict=True)]
    return time.perf_counter() - start, outs


def methods(weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list]:
    """Each way a linear can run here: `F.linear`, oneDNN prepacked, and in bf16 (where the CPU
    has AVX512-BF16) the C++ kernel the engine runs for a few rows."""
    found = {"f_linear": [lambda x, w=w: F.linear(x, w) for w in weights],
             # The defaults call on purpose (B008): each weight is packed once, as the list is built.
             "onednn_prepacked": [lambda x, p=cpu_linear.pack(w): cpu_linear.packed_linear(x, p, None)  # noqa: B008
                                  for w in weights]}
    if dtype == torch.bfloat16 and cpu_kernels.load() and cpu_kernels.bf16_linear_available():
        found["bf16_kernel"] = [lambda x, p=cpu_kernels.pack_bf16_weight(w), n=w.shape[0]:  # noqa: B008  (as above)
                                cpu_kernels.bf16_linear(x, p, None, n) for w in weights]
    return found


def measure(dtype: torch.dtype, rows: int, runs: int) -> dict:
    config = read_model_config(default_model_path())
    shapes, (hidden, vocab) = linear_shapes(config)
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=generator) * 0.05).to(dtype) for i, o in shapes]
    weights.append((torch.randn(vocab, hidden, generator=generator) * 0.05).to(dtype))
    in_features = [w.shape[1] for w in weights]
    inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in set(in_features)}
    contenders = methods(weights, dtype)
    _, reference = one_pass(contenders["f_linear"], inputs, in_features)
    entry: dict = {"rows": rows, "dtype": str(dtype).removeprefix("torch.")}
    times: dict[str, list[float]] = {}
    for name, fns in contenders.items():
        _, got = one_pass(fns, inputs, in_features)
        worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                    for a, b in zip(got, reference, strict=True))
        entry[f"{name}_worst_relative_difference"] = round(worst, 6)
        if worst <= TOLERANCE[dtype]:
            times[name] = []
        else:
            entry[f"{name}_withheld"] = "outputs differ from F.linear beyond the dtype's rounding"
    for _ in range(runs):  # interleaved: a busy moment hits every method alike
        for name in times:
            times[name].append(one_pass(contenders[name], inputs, in_features)[0])
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    entry |= {f"{name}_ms": round(ms, 2) for name, ms in medians.items()}
    for name in medians.keys() - {"f_linear"}:
        if "f_linear" in medians:
            entry[f"{name}_speedup_over_f_linear"] = round(medians["f_linear"] / medians[name], 2)
    if {"bf16_kernel", "onednn_prepacked"} <= medians.keys():
        entry["bf16_kernel_speedup_over_onednn"] = round(medians["onednn_prepacked"] / medians["bf16_kernel"], 2)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = [measure(dtype, rows, args.runs) for dtype in (torch.float32, torch.bfloat16) for rows in ROWS]
    report = {"benchmark": "cpu_linear", "model_shapes": "SmolLM2-135M-Instruct (all projections + LM head)",
              "runs": args.runs, "machine": machine_info(), "results": results}
    emit(report, args.out)


if __name__ == "__main__":
    main()
