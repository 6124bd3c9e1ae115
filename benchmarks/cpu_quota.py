"""The engine under a cgroup CPU quota: torch's own thread count against the count fitted to the quota.

A container limited to fewer CPUs than its host has cores (Kubernetes' `limits.cpu`, `docker run
--cpus`) keeps every core in its affinity mask, so torch starts a thread per core; the kernel then
stops the process for the rest of each 100 ms period once its threads have spent the quota. This
runs one request on the default model (greedy, `--new` tokens), each run a fresh process placed in
a new cgroup (v1 cpu hierarchy; root only) limited to `--cpus` CPUs, in three modes, alternating:
`torch` (torch's starting count throughout, no governor), `governed` (the thread governor from
torch's count, the engine before it read quotas) and `fitted` (the count first lowered to the
quota, `engine.cpu.thread_governor.fit_torch_threads`, then governed: the engine now). A run counts
only if its tokens equal the first run's; the JSON gives each mode's median seconds, decode step,
threads and governor moves, and the ratios against `torch`.

    sudo python -m benchmarks.cpu_quota --out benchmarks/results/cpu_quota-<machine>.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from benchmarks.lib import cpu_quota_cgroup, emit, in_cgroup, machine_info
from benchmarks.thread_governor import PROMPT, compare
from helexa_kernels.machine import cpu_budget

MODES = {"torch": "off", "governed": "on", "fitted": "fit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=float, default=1.0, help="the cgroup's quota in CPUs per period")
    parser.add_argument("--new", type=int, default=100, help="tokens decoded per run")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (medians reported)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = {name: MODES[name] for name in args.modes.split(",") if name in MODES}
    if len(modes) != len(args.modes.split(",")) or not modes:
        parser.error(f"--modes: some of {', '.join(MODES)}")
    with cpu_quota_cgroup(args.cpus) as directory:
        if directory is None:
            sys.exit("cpu_quota: this machine lets this user make no cgroup with a CPU quota "
                     "(it needs root and cgroup v1's cpu hierarchy)")
        level, medians = compare(modes, args.runs, args.new, [], functools.partial(in_cgroup, directory))
    for mode in ("governed", "fitted"):
        if mode in medians and "torch" in medians:
            level[f"{mode}_vs_torch"] = round(medians[mode] / medians["torch"], 3)
    emit({
        "benchmark": "cpu_quota",
        "inputs": {"model": "SmolLM2-135M (default)", "prompt": PROMPT, "new_tokens": args.new, "runs": args.runs,
                   "quota_cpus": args.cpus, "cores_in_affinity": cpu_budget().affinity, "sequences": 1},
        "machine": machine_info(),
        "results": level,
    }, args.out)


if __name__ == "__main__":
    main()
