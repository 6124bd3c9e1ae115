"""The CPU kernels' first build and the decode step they give: this checkout against `--base`.

A build is what a first start waits for (`python -m helexa_kernels.cpu`, as `make setup` runs it),
timed in a fresh cache folder of its own, so each run compiles everything. The decode step is the
default model's engine core on the kernels that tree built (its C++ decoder stack, float32): the
median step at 16 sequences of 128-token prompts and at one sequence, after a warm-up. A tree's
decode run counts only if its tokens are the ones the other tree's runs gave (greedy: the kernels
must compute the same thing however they were compiled).

Each tree (this checkout, and `--base`, a `git worktree add <dir> <commit>` checkout) runs in its
own processes with its own sources; the two alternate, `--runs` times each.

    python -m benchmarks.kernel_build --base /tmp/kernels-base --out benchmarks/results/kernel_build-<machine>.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARM_STEPS = 5
TIMED_STEPS = 40


def measure_decode() -> dict:
    """One decode run in this process, on the kernels of the tree this file runs from."""
    import torch

    from benchmarks.step_profile import decode_core, prompt_ids, request
    from engine.core.engine_core import EngineCore
    from engine.frontend.engine_config import EngineConfig
    from engine.loading.default_model import default_model_path
    from engine.loading.loader import load_checkpoint
    from helexa_kernels import cpu as cpu_kernels

    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not load")
    torch.manual_seed(0)
    checkpoint = load_checkpoint(default_model_path(), dtype=torch.float32)

    def timed(core: EngineCore) -> tuple[float, list]:
        for _ in range(WARM_STEPS):
            core.step()
        times, tokens = [], []
        for _ in range(TIMED_STEPS):
            started = time.perf_counter()
            outputs = core.step()
            times.append(time.perf_counter() - started)
            tokens.append(sorted((o.request_id, o.new_token_ids) for o in outputs))
        core.close()
        return statistics.median(times) * 1e3, tokens

    step_16_ms, tokens_16 = timed(decode_core(checkpoint))
    single = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=1, max_num_batched_tokens=2048,
                                                 enable_prefix_caching=False))
    single.add_request(request("one", prompt_ids(checkpoint, 128, 0), 10_000))
    single.step()  # the prefill
    step_1_ms, tokens_1 = timed(single)
    digest = hashlib.sha256(json.dumps([tokens_16, tokens_1]).encode()).hexdigest()[:16]
    return {"step_16_ms": step_16_ms, "step_1_ms": step_1_ms, "tokens": digest}


def timed_build(tree: Path, cache: Path) -> dict:
    """A build from nothing (the cache folder emptied first) of `tree`'s kernels, in a fresh process
    with XDG_CACHE_HOME=`cache`."""
    shutil.rmtree(cache / "helexa" / "kernels", ignore_errors=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "helexa_kernels.cpu"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(cache)})
    return {"build_s": time.perf_counter() - started, "correct": done.returncode == 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of the commit to compare with (required)")
    parser.add_argument("--runs", type=int, default=3, help="builds and decode runs per tree (medians reported)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure_decode()))
        return
    if args.base is None:
        parser.error("--base is required")
    from benchmarks.lib import emit, measure_in_tree, medians_of_correct, tree_comparison, with_ratio

    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, "base": args.base.resolve()}
    with tempfile.TemporaryDirectory(prefix="kernel-build-") as folder:
        caches = {name: Path(folder, name) for name in trees}
        builds: dict[str, list[dict]] = {name: [] for name in trees}
        decodes: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():  # alternating, so drift in the machine hits both
                builds[name].append(timed_build(tree, caches[name]))
        for _ in range(args.runs):
            for name, tree in trees.items():
                decodes[name].append(measure_in_tree(__file__, tree, [], {"XDG_CACHE_HOME": str(caches[name])}))
    reference = decodes["base"][0].get("tokens")
    for measured in decodes.values():
        for run in measured:
            run["correct"] = run["tokens"] == reference
    results: dict[str, dict] = {}
    for key, runs, digits in (("build_s", builds, 1), ("step_16_ms", decodes, 2), ("step_1_ms", decodes, 2)):
        entries, medians = medians_of_correct(runs, key, digits, "failed its check (a build error, or tokens "
                                              "that differ from the other tree's): no figure")
        results[key] = with_ratio(entries, medians)
    emit(tree_comparison("kernel_build", {
        "runs": args.runs, "model": "SmolLM2-135M (default), float32",
        "decode": f"16 sequences of 128-token prompts, and 1; {WARM_STEPS} warm steps, median of {TIMED_STEPS}"},
        trees, results), args.out)


if __name__ == "__main__":
    main()
