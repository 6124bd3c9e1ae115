"""The CPU thread governor against torch's fixed count, on a quiet machine and beside a busy process.

One request on the default model's engine core (greedy, `--new` tokens) is decoded in a fresh
process per run, with the governor (`engine.cpu.thread_governor`, its defaults) or without it (every
step on torch's starting count). The machine is either quiet or has `--busy` other processes each
spinning on a core, as a shared host would. Modes alternate within each condition, `--runs` times
each. A run counts only if its tokens equal the first run's (every run decodes the same prompt
greedily); the JSON gives median seconds per run, the median decode step, the governor's moves and
the on/off ratio per condition.

    python -m benchmarks.thread_governor --out benchmarks/results/thread_governor-<machine>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROMPT = "What is the capital of France? " * 6


def measure(governed: bool, new: int, fit: bool = False) -> dict:
    """One run in this process (`fit`: torch's count first lowered to the CPUs the process may use,
    as the engine core's process does, `engine.cpu.thread_governor.fit_torch_threads`)."""
    import torch

    from engine.core.engine_core import EngineCore
    from engine.cpu.thread_governor import fit_torch_threads
    from engine.frontend.engine_config import EngineConfig
    from engine.frontend.protocol import EngineRequest, SamplingParams
    from engine.loading.default_model import default_model_path
    from engine.loading.loader import load_checkpoint

    torch_threads = torch.get_num_threads()
    if fit:
        fit_torch_threads()
    threads_at_start = torch.get_num_threads()
    checkpoint = load_checkpoint(default_model_path())
    core = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=4, enable_prefix_caching=False))
    governor = core.runner.thread_governor
    if not governed:
        core.runner.thread_governor = None
    prompt = checkpoint.tokenizer.encode(PROMPT, add_special_tokens=False)
    core.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    steps = []
    started = time.perf_counter()
    while core.has_work():
        step_started = time.perf_counter()
        for output in core.step():
            tokens += output.new_token_ids
        steps.append(time.perf_counter() - step_started)
    seconds = time.perf_counter() - started
    core.close()
    return {"seconds": seconds, "decode_step_ms": statistics.median(steps[1:]) * 1e3, "tokens": tokens,
            "torch_threads": torch_threads, "threads_at_start": threads_at_start, "dtype": str(core.runner.dtype),
            "moves": [] if not governed or governor is None else governor.moves}


def run(mode: str, new: int, wrap: Callable[[list[str]], list[str]] = list) -> dict:
    """One run in a fresh process (`mode`: "on" governed, "off" torch's count throughout, "fit" the
    count fitted to the process's CPUs, then governed), its command line passed through `wrap`."""
    result = subprocess.run(wrap([sys.executable, "-m", "benchmarks.thread_governor", "--measure", mode, str(new)]),
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(modes: dict[str, str], runs: int, new: int, reference: list[int],
            wrap: Callable[[list[str]], list[str]] = list) -> tuple[dict[str, object], dict[str, float]]:
    """`runs` runs of each of `modes` (name: `run`'s mode), alternating so drift in the machine hits
    each; a run counts only if its tokens equal `reference` (set from the first run when empty).
    Each mode's entry (medians over its correct runs, its steps, threads and moves) and the medians."""
    from benchmarks.lib import medians_of_correct

    by_mode: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(runs):
        for name, mode in modes.items():
            measured = run(mode, new, wrap)
            if not reference:
                reference.extend(measured["tokens"])
            measured["correct"] = measured.pop("tokens") == reference
            by_mode[name].append(measured)
    entries, medians = medians_of_correct(by_mode, "seconds", 3,
                                          "a run's tokens differed from the first run's: no time")
    for name, entry in entries.items():
        if entry["correct"]:
            mode_runs = by_mode[name]
            entry.update({"decode_step_ms_runs": [round(r["decode_step_ms"], 2) for r in mode_runs],
                          "torch_threads": mode_runs[0]["torch_threads"],
                          "threads_at_start": mode_runs[0]["threads_at_start"], "dtype": mode_runs[0]["dtype"],
                          "moves_runs": [r["moves"] for r in mode_runs]})
    return {**entries}, medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=400, help="tokens decoded per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode and condition (medians reported)")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside the engine when busy")
    parser.add_argument("--conditions", default="quiet,busy", help="which of quiet and busy to measure")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "NEW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        mode = args.measure[0]
        print(json.dumps(measure(mode != "off", int(args.measure[1]), fit=mode == "fit")))
        return
    from benchmarks.lib import emit, machine_info

    reference: list[int] = []
    results: dict[str, dict] = {}
    conditions = args.conditions.split(",")
    if not conditions or not set(conditions) <= {"quiet", "busy"}:
        parser.error("--conditions: quiet, busy or both")
    for condition in conditions:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.busy if condition == "busy" else 0)]
        try:
            level, medians = compare({"governed": "on", "fixed": "off"}, args.runs, args.new, reference)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        if len(medians) == 2:
            level["governed_vs_fixed"] = round(medians["governed"] / medians["fixed"], 3)
        results[condition] = level
    emit({
        "benchmark": "thread_governor",
        "inputs": {"model": "SmolLM2-135M (default)", "prompt": PROMPT, "new_tokens": args.new, "runs": args.runs,
                   "busy_processes": args.busy, "sequences": 1},
        "machine": machine_info(),
        "results": results,
    }, args.out)


if __name__ == "__main__":
    main()
