"""The host's share of a decode step: what the engine core does around the device's work.

On a GPU a decode step is the forward and the LM head on the device plus the host's part: schedule,
lay out the step's inputs, sample, advance the requests, build the outputs. The device waits for
the host part (the H200 runs measured 0.28 ms of a 5.4 ms batch-1 step and 0.89 ms of an 8.2 ms step
at 64 streams). That part is the same Python on any machine, so it is measured here on the CPU: the
default model's engine core, the forward and the LM head replaced by fixed tensors (their time is
the device's), N sequences of 512-token prompts decoding one token a step.

Each tree (this checkout, and `--base`, a `git worktree add <dir> <commit>` checkout) runs in its
own process with its own `engine` package; the two alternate, `--runs` times each. A run counts only
if every step gave each sequence exactly the token its fixed logits row says, and ended none.

    python -m benchmarks.host_step --base /tmp/host-base --out benchmarks/results/host_step-<machine>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 512
WARM_STEPS = 10


def measure(num_seqs: int, steps: int) -> dict:
    """One run in this process: the median host time of a decode step at `num_seqs` sequences."""
    import torch

    from engine.core.engine_core import EngineCore
    from engine.frontend.engine_config import EngineConfig
    from engine.frontend.protocol import EngineRequest, SamplingParams
    from engine.loading.default_model import default_model_path
    from engine.loading.loader import load_checkpoint

    torch.manual_seed(0)
    # One thread: the host part's tensors are small, and a second thread waiting on a busy core
    # (a parallel region's barrier) would time the scheduler of this machine, not the engine's work.
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(default_model_path(), dtype=torch.float32)
    context = PROMPT_TOKENS + WARM_STEPS + steps + 1
    blocks = num_seqs * (context // 16 + 2)
    core = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=num_seqs,
                                               max_num_batched_tokens=num_seqs * PROMPT_TOKENS,
                                               enable_prefix_caching=False, num_kv_blocks=blocks))
    # The device's work, replaced: hidden states of zeros, then a fixed logits row per sequence
    # whose argmax is the token that sequence must get every step.
    hidden = torch.zeros(num_seqs * PROMPT_TOKENS, checkpoint.config.hidden_size)
    logits = torch.randn(num_seqs, 64)
    want = logits.argmax(-1).tolist()
    core.runner.forward = lambda inputs, caches: hidden[:inputs.input_ids.shape[0]]  # type: ignore[method-assign]
    core.runner.model.compute_logits = lambda rows: logits[:rows.shape[0]]  # type: ignore[assignment]
    for i in range(num_seqs):
        prompt = [1000 + 37 * i + 5 * j for j in range(PROMPT_TOKENS)]
        core.add_request(EngineRequest(f"s{i}", prompt, SamplingParams(max_tokens=context, temperature=0.0,
                                                                       ignore_eos=True)))
    core.step()  # every prompt in one step
    order = {f"s{i}": i for i in range(num_seqs)}
    correct = True
    times = []
    for step in range(WARM_STEPS + steps):
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        if step >= WARM_STEPS:
            times.append(elapsed)
        correct &= (len(outputs) == num_seqs and all(
            o.new_token_ids == [want[order[o.request_id]]] and not o.finished for o in outputs))
    core.close()
    return {"host_step_ms": statistics.median(times) * 1e3, "correct": correct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--levels", default="1,16,64,256", help="sequences decoding at once")
    parser.add_argument("--runs", type=int, default=5, help="runs per tree and level (medians reported)")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", nargs=2, type=int, metavar=("NUM_SEQS", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    from benchmarks.lib import emit, measure_in_tree, medians_of_correct, tree_comparison, with_ratio

    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, **({"base": args.base.resolve()} if args.base else {})}
    levels = [int(level) for level in args.levels.split(",")]
    results: dict[str, dict] = {}
    for num_seqs in levels:
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():  # alternating, so drift in the machine hits both
                runs[name].append(measure_in_tree(__file__, tree, [str(num_seqs), str(args.steps)]))
        entries, medians = medians_of_correct(runs, "host_step_ms", 4,
                                              "a step gave a wrong token or ended a sequence: no time")
        results[str(num_seqs)] = with_ratio(entries, medians)
    emit(tree_comparison("host_step", {
        "levels": levels, "prompt_tokens": PROMPT_TOKENS, "timed_steps_per_run": args.steps,
        "warm_steps": WARM_STEPS, "runs": args.runs, "model": "SmolLM2-135M (default), float32",
        "device_work": "replaced: forward returns zeros, the LM head a fixed [N, 64] logits row"}, trees, results),
        args.out)


if __name__ == "__main__":
    main()
