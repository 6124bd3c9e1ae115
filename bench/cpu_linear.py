"""Prepacked oneDNN linears against `F.linear`, over the default model's projection shapes.

One pass runs every linear layer of SmolLM2-135M as built (30 layers of qkv, o, gate_up, down,
each with its own weight, so weights stream from memory as in a real step) and the LM head, at
1, 16 and 512 rows, in fp32 and bf16. The two methods alternate pass by pass in one process, so
a busy moment hits both; each figure is the median of `--runs` passes. A method's speed is
withheld if its outputs differ from `F.linear`'s beyond the dtype's rounding.

    python bench/cpu_linear.py --out bench/results/cpu_linear-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info
from bench.report import emit
from engine import cpu_linear
from engine.default_model import default_model_path
from engine.dtype_choice import linear_shapes
from engine.loader import read_model_config

ROWS = (1, 16, 512)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def one_pass(fns: list, inputs: dict[int, torch.Tensor], in_features: list[int]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = [fn(inputs[k]) for fn, k in zip(fns, in_features, strict=True)]
    return time.perf_counter() - start, outs


def measure(dtype: torch.dtype, rows: int, runs: int) -> dict:
    config = read_model_config(default_model_path())
    shapes, (hidden, vocab) = linear_shapes(config)
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=generator) * 0.05).to(dtype) for i, o in shapes]
    weights.append((torch.randn(vocab, hidden, generator=generator) * 0.05).to(dtype))
    in_features = [w.shape[1] for w in weights]
    inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in set(in_features)}
    plain = [lambda x, w=w: F.linear(x, w) for w in weights]
    packed = [cpu_linear.linear_op(w) for w in weights]
    _, reference = one_pass(plain, inputs, in_features)
    _, got = one_pass(packed, inputs, in_features)
    worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                for a, b in zip(got, reference, strict=True))
    times: dict[str, list[float]] = {"f_linear": [], "prepacked": []}
    for _ in range(runs):
        times["f_linear"].append(one_pass(plain, inputs, in_features)[0])
        times["prepacked"].append(one_pass(packed, inputs, in_features)[0])
    entry = {"rows": rows, "dtype": str(dtype).removeprefix("torch."),
             "worst_relative_difference": round(worst, 6), "correct": worst <= TOLERANCE[dtype]}
    if entry["correct"]:
        medians = {k: statistics.median(v) * 1000 for k, v in times.items()}
        entry |= {"f_linear_ms": round(medians["f_linear"], 2), "prepacked_ms": round(medians["prepacked"], 2),
                  "speedup": round(medians["f_linear"] / medians["prepacked"], 2)}
    else:
        entry["withheld"] = "prepacked outputs differ from F.linear beyond the dtype's rounding"
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
