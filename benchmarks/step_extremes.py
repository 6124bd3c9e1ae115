"""What one request's parameters cost the other rows of a step, on the host: the sampler and the
step's block tables, this checkout against `--base` (a `git worktree add <dir> <commit>` checkout).

Cases, each the median time of one call over `--steps` steps (logits fixed per step, seeded):
- `greedy16`: 16 greedy rows (the floor);
- `wide_top_k`: 15 rows sampling with top_k 40 beside one with top_k = vocabulary - 1;
- `penalties_8k`: 16 greedy rows with 8,192-token prompts, repetition and frequency penalties, the
  output growing one token a step;
- `penalties_96`: the same with 96 rows of 4,096-token prompts (more penalized rows than the
  sampler keeps states for beyond a step's own);
- `block_tables`: a step's attention metadata for 256 decoding sequences, one of them 8,192 blocks
  long and the others 3.

A case's time counts only where both trees gave the same tokens (and tables) step for step: each
run reports a digest of them, and a tree whose digest differs from the other's gets no figure. Each
figure is the median call; the first call of a run (a penalty state built from the prompt) is in
`first_ms`.

    python -m benchmarks.step_extremes --base /tmp/base --out benchmarks/results/step_extremes-<machine>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import time
from pathlib import Path

VOCAB = 49152
CASES = ("greedy16", "wide_top_k", "penalties_8k", "penalties_96", "block_tables")


def measure(case: str, steps: int) -> dict:
    """One run in this process: the median time of the case's call, and a digest of what it gave."""
    import torch

    from engine.frontend.protocol import SamplingParams
    from engine.runner.sampler import Sampler, SamplingRow
    from engine.runner.step_metadata import AttentionMetadata

    torch.set_num_threads(1)
    digest = hashlib.sha256()
    times = []
    if case == "block_tables":
        tables = [list(range(8192))] + [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(255)]
        seq_lens = [8192 * 16] + [40] * 255
        for _ in range(steps):
            started = time.perf_counter()
            meta = AttentionMetadata.build([1] * 256, seq_lens, tables, 16)
            times.append(time.perf_counter() - started)
        digest.update(meta.block_tables.numpy().tobytes())
        return {"ms": statistics.median(times) * 1e3, "first_ms": times[0] * 1e3, "digest": digest.hexdigest(),
                "correct": True}
    generator = torch.Generator().manual_seed(0)
    keeps_ids = "request_id" in {f.name for f in dataclasses.fields(SamplingRow)}
    if case == "greedy16":
        options = [SamplingParams(temperature=0.0)] * 16
    elif case == "wide_top_k":
        options = [SamplingParams(temperature=1.0, top_k=40, seed=i) for i in range(15)]
        options.append(SamplingParams(temperature=1.0, top_k=VOCAB - 1, seed=15))
    else:
        count = 96 if case == "penalties_96" else 16
        options = [SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2)] * count
    prompt_len = {"penalties_8k": 8192, "penalties_96": 4096}.get(case, 16)
    prompts = [torch.randint(0, VOCAB, (prompt_len,), generator=generator).tolist() for _ in options]
    outputs: list[list[int]] = [[] for _ in options]
    sampler = Sampler(seed=0)
    for _ in range(steps):
        logits = torch.randn(len(options), VOCAB, generator=generator) * 3
        rows = [SamplingRow(o, p, out, [], **({"request_id": f"r{i}"} if keeps_ids else {}))
                for i, (o, p, out) in enumerate(zip(options, prompts, outputs, strict=True))]
        started = time.perf_counter()
        tokens = sampler(logits, rows).token_ids
        times.append(time.perf_counter() - started)
        digest.update(json.dumps(tokens).encode())
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    return {"ms": statistics.median(times) * 1e3, "first_ms": times[0] * 1e3, "digest": digest.hexdigest(),
            "correct": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--runs", type=int, default=5, help="runs per tree and case (medians reported)")
    parser.add_argument("--steps", type=int, default=40, help="timed calls per run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return
    from benchmarks.lib import emit, measure_in_tree, medians_of_correct, tree_comparison, with_ratio

    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, **({"base": args.base.resolve()} if args.base else {})}
    results: dict[str, dict] = {}
    for case in CASES:
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():  # alternating, so drift in the machine hits both
                runs[name].append(measure_in_tree(__file__, tree, [case, str(args.steps)]))
        digests = {run["digest"] for measured in runs.values() for run in measured}
        if len(digests) > 1:  # the trees disagree on the tokens: neither time is a figure
            for measured in runs.values():
                for run in measured:
                    run["correct"] = False
        entries, medians = medians_of_correct(runs, "ms", 3, "the trees gave different tokens or tables: no time")
        for name, entry in entries.items():
            if entry["correct"]:
                entry["first_ms_runs"] = [round(run["first_ms"], 3) for run in runs[name]]
        results[case] = with_ratio(entries, medians)
    emit(tree_comparison("step_extremes", {
        "cases": list(CASES), "vocab": VOCAB, "runs": args.runs, "timed_calls_per_run": args.steps,
        "threads": 1, "logits": "seeded randn x 3, one [rows, vocab] float32 per step"}, trees, results), args.out)


if __name__ == "__main__":
    main()
