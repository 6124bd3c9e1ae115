"""What the benchmark scripts share: the machine a run was on, the commit a tree measured was at,
each contender's median over runs that passed their check, and how a result is handed over.

Every CPU benchmark records the machine beside its numbers, because bf16 is 3× slower than fp32 on
one x86 part and 6× faster on another; the load average says whether others shared the cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from helexa_kernels.machine import cpu_identity

# The prose the engine benchmarks tokenize into prompts (repeated to the length they need).
TEXT = (
    "The history of navigation is a story of people learning to read the sky, the sea and the land. "
    "Early sailors kept close to the coast and steered by landmarks, then by the sun and the stars. "
    "The magnetic compass, the astrolabe and later the sextant let ships cross open water with growing "
    "confidence, while the marine chronometer finally solved the problem of longitude. Maps improved as "
    "surveyors measured coastlines and mountains, and today satellites give every phone its position. "
)

# The instruction sets that change which dtype is fastest for a linear layer.
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def machine_info() -> dict:
    """CPU model, the flags that decide matmul speed, cores, torch threads, load."""
    # Imported here: the service benchmarks (recorder_throughput) use `emit` without torch.
    import torch

    cpu = cpu_identity()
    flags = set(cpu["flags"])
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu_model": cpu["model"] or platform.processor() or platform.machine(),
        "cpu_family": cpu["family"], "cpu_model_number": cpu["model_number"],
        "cpu_flags": [flag for flag in MATMUL_FLAGS if flag in flags],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": round(load[0], 2),
    }


def emit(report: dict, out: Path | None) -> None:
    """The JSON printed, and written to `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def commit_of(tree: Path) -> str:
    """The tree's commit, "-dirty" when its tracked files differ from it."""
    return subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True, check=True).stdout.strip()


def medians_of_correct(runs: dict[str, list[dict]], key: str, digits: int,
                       wrong: str) -> tuple[dict[str, dict], dict[str, float]]:
    """Each contender's `key` over its runs (each run a dict with `correct`): the runs and their
    median, or, when any run failed its check, `wrong` and no figure. Returns the per-contender
    entries and the medians of those that passed."""
    entries: dict[str, dict] = {}
    medians: dict[str, float] = {}
    for name, measured in runs.items():
        if not all(run["correct"] for run in measured):
            entries[name] = {"correct": False, "note": wrong}
            continue
        medians[name] = round(statistics.median(run[key] for run in measured), digits)
        entries[name] = {"correct": True, f"{key}_median": medians[name],
                         f"{key}_runs": [round(run[key], digits) for run in measured]}
    return entries, medians


def measure_in_tree(script: str, tree: Path, args: list[str], env: dict[str, str] | None = None) -> dict:
    """`script --measure ARGS` in a fresh process that imports `tree`'s sources (a base checkout's
    or this one's); the JSON its last line prints."""
    result = subprocess.run([sys.executable, script, "--measure", *args], cwd=tree, capture_output=True, text=True,
                            env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)}, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def tree_comparison(benchmark: str, inputs: dict, trees: dict[str, Path], results: dict) -> dict:
    """The report of a benchmark of this checkout against a base one: inputs, each tree's commit,
    the machine and the results."""
    return {"benchmark": benchmark, "inputs": inputs,
            "trees": {name: {"path": str(tree), "commit": commit_of(tree)} for name, tree in trees.items()},
            "machine": machine_info(), "results": results}


def with_ratio(entries: dict[str, dict], medians: dict[str, float]) -> dict:
    """`medians_of_correct`'s entries, with `this_vs_base` where both trees have a figure."""
    if len(medians) == 2:
        return {**entries, "this_vs_base": round(medians["this"] / medians["base"], 3)}
    return {**entries}


@contextlib.contextmanager
def cpu_quota_cgroup(cpus: float) -> Iterator[Path | None]:
    """A new cgroup (v1 cpu hierarchy) under this process's own, limited to `cpus` CPUs' worth of
    time per 100 ms period, removed on exit; None where this machine lets no one make one (not root,
    no v1 cpu hierarchy). Start a process in it with `in_cgroup`."""
    from helexa_kernels.machine import cgroup_cpu_mounts, own_cgroup_paths

    own = own_cgroup_paths(Path("/proc/self/cgroup").read_text()).get(1)
    mounts = [mount for mount in cgroup_cpu_mounts(Path("/proc/self/mountinfo").read_text())
              if mount.version == 1 and mount.root == "/"]
    directory = None
    if own is not None and mounts:
        directory = mounts[0].point / own.lstrip("/") / f"helexa-bench-{os.getpid()}"
        try:
            directory.mkdir()
        except OSError:
            directory = None
    if directory is not None:
        try:
            (directory / "cpu.cfs_period_us").write_text("100000")
            (directory / "cpu.cfs_quota_us").write_text(str(round(cpus * 100_000)))
        except OSError:
            directory.rmdir()
            directory = None
    try:
        yield directory
    finally:
        if directory is not None:
            directory.rmdir()


def in_cgroup(directory: Path, argv: list[str]) -> list[str]:
    """`argv` started inside the cgroup at `directory` (it moves itself in, then execs)."""
    return ["sh", "-c", f'echo $$ > "{directory}/cgroup.procs" && exec "$@"', "sh", *argv]
