"""A 16-row decode step with and without transparent huge pages for the engine's memory.

glibc 2.35+ madvises every block malloc takes from the system as MADV_HUGEPAGE when a process
starts with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which puts the weights, the KV cache and the
activations on 2 MiB pages where the kernel's transparent huge pages are `madvise` or `always`.
A decode step streams every weight once, so fewer TLB misses could speed it up; measured here,
it does not (benchmarks/results/huge_pages-cpu-epyc.json: 31.1 against 31.2 ms over 8 pairs), and the
engine does not ask for it.

Each sample is a fresh process (glibc reads `GLIBC_TUNABLES` only as a process starts): the
default model in bf16, 16 sequences past their 128-token prefill, the median of 40 decode steps.
Processes alternate, with the tunable and without, `--pairs` times; the JSON has every process's
median, the median of each side, and how much of the process's memory sat on huge pages.

    python -m benchmarks.huge_pages --out benchmarks/results/huge_pages-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.lib import emit, machine_info

ROOT = Path(__file__).resolve().parents[1]
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"

STEPS = 40
SAMPLE = f"""
import json, statistics
import torch
from benchmarks.step_profile import decode_core, time_steps
from engine.loading.default_model import default_model_path
from engine.loading.loader import load_checkpoint
core = decode_core(load_checkpoint(default_model_path(), dtype=torch.bfloat16))
time_steps(core.step, 5)  # warm-up
times = time_steps(core.step, {STEPS})
rollup = open("/proc/self/smaps_rollup").read().splitlines()
huge = next((int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages")), 0)
print(json.dumps({{"step_ms": statistics.median(times) * 1000, "huge_pages_mib": huge >> 10}}))
"""


def sample(huge_pages: bool) -> dict:
    env = dict(os.environ)
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    if huge_pages:
        tunables.append(HUGE_PAGES_TUNABLE)
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    # `-c` puts the working directory first on sys.path: the repository root, for `benchmarks`.
    done = subprocess.run([sys.executable, "-c", SAMPLE], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides: dict[str, list[dict]] = {"huge_pages": [], "without": []}
    for _ in range(args.pairs):
        sides["without"].append(sample(False))
        sides["huge_pages"].append(sample(True))
    medians = {name: statistics.median(s["step_ms"] for s in samples) for name, samples in sides.items()}
    emit({
        "benchmark": "huge_pages",
        "workload": "default model, bf16, a 16-row decode step (16 sequences past 128-token prompts), "
                    f"median of {STEPS} steps per process, processes alternating",
        "machine": machine_info(),
        "thp_mode": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else None,
        "processes": {name: [{k: round(v, 2) for k, v in s.items()} for s in samples]
                      for name, samples in sides.items()},
        "step_ms_median": {name: round(v, 2) for name, v in medians.items()},
        "speedup": round(medians["without"] / medians["huge_pages"], 3),
    }, args.out)


if __name__ == "__main__":
    main()
