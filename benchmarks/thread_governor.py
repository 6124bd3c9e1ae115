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
from pathlib import Path

PROMPT = "What is the capital of France? " * 6


def measure(governed: bool, new: int) -> dict:
    """One run in this process."""
    import torch

    from engine.core.engine_core import EngineCore
    from engine.frontend.engine_config import EngineConfig
    from engine.frontend.protocol import EngineRequest, SamplingParams
    from engine.loading.default_model import default_model_path
    from engine.loading.loader import load_checkpoint

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
            "threads_at_start": torch.get_num_threads(), "dtype": str(core.runner.dtype),
            "moves": [] if not governed or governor is None else governor.moves}


def run(governed: bool, new: int) -> dict:
    result = subprocess.run([sys.executable, "-m", "benchmarks.thread_governor", "--measure",
                             "on" if governed else "off", str(new)],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=400, help="tokens decoded per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode and condition (medians reported)")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside the engine when busy")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", nargs=2, metavar=("MODE", "NEW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0] == "on", int(args.measure[1]))))
        return
    from benchmarks.lib import emit, machine_info, medians_of_correct

    reference: list[int] | None = None
    results: dict[str, dict] = {}
    for condition in ("quiet", "busy"):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.busy if condition == "busy" else 0)]
        try:
            runs: dict[str, list[dict]] = {"governed": [], "fixed": []}
            for _ in range(args.runs):
                for mode in runs:  # alternating, so drift in the machine hits both
                    measured = run(mode == "governed", args.new)
                    reference = reference if reference is not None else measured["tokens"]
                    measured["correct"] = measured.pop("tokens") == reference
                    runs[mode].append(measured)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        entries, medians = medians_of_correct(runs, "seconds", 3,
                                              "a run's tokens differed from the first run's: no time")
        for mode, entry in entries.items():
            if entry["correct"]:
                mode_runs = runs[mode]
                entry.update({"decode_step_ms_runs": [round(r["decode_step_ms"], 2) for r in mode_runs],
                              "threads_at_start": mode_runs[0]["threads_at_start"], "dtype": mode_runs[0]["dtype"],
                              "moves_runs": [r["moves"] for r in mode_runs]})
        level: dict[str, object] = {**entries}
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
