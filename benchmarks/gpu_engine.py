"""Engine benchmark on a GPU: our engine against HF transformers `generate`, same random weights.

For each model (Qwen3-0.6B and Qwen3-8B sizes; a Qwen3.5-style hybrid when `engine.models` has
`qwen3_5`), the script builds an HF model with random weights on the device (nothing is
downloaded), copies those weights into our engine's model, and in this one process measures:

- output tokens/s, TTFT and ITL medians at each concurrency (default 1, 16, 64, 256): that many
  requests of --prompt random tokens submitted at once, --new tokens each, greedy, ignore_eos;
  ours (EngineCore stepped in-process) and HF `generate` on one batch of the same prompts;
- batch-1 decode as a fraction of the HBM roofline: the weight bytes a decode step reads, over
  the bandwidth of a large device-to-device copy measured here, against our batch-1 ITL;
- our engine with decode CUDA graphs on and off (--graphs-off levels);
- with --profile, where a decode step's time goes at those levels (benchmarks/gpu_step_profile.py:
  kernel time against the step's wall time, launches, syncs, the top kernels and host ops).

Each level also reports decode tokens/s (concurrency / ITL: the rate while every request
decodes, without the prefill that output tokens/s over the wall time includes) and its TTFT
median (p50), and `bounds`: the fewest seconds that level's run can take on this device (every
forward reads the weights at the measured copy bandwidth, every token's matmuls run at the
measured matmul rate; `time_bounds`) as output tokens/s, prefill and decode overlapped or one
after the other; `headline` repeats batch 1's fraction of the roofline and the largest level's
figures. HF `generate` runs at --peer-concurrency levels only (default: all).

Correctness gate, before any timing: on a short prompt, our last-position logits must match HF's
(cosine) and our greedy tokens (graphs on and off) must equal HF's up to the first step where
HF's top two logits are within a near-tie margin. A model that fails gets no speed printed
(its timings are not even run) and the script exits non-zero.

Every figure is the median over --runs timed runs, after one untimed warm-up run. The JSON report
(inputs, machine, results, ratios against HF in the same process) is printed and written to
--out, or without it to $OUT/gpu_engine.json when $OUT is set; it is rewritten after each
concurrency level, so a run cut off by a time limit still leaves what it finished. --budget-s
skips what would start past the budget.

    python -m benchmarks.gpu_engine --runs 3                   # on the GPU
    python -m benchmarks.gpu_engine --tiny                     # CPU smoke test (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path

import torch

from benchmarks.core_timing import RunResult, StepClock, run_greedy
from benchmarks.gpu_models import (
    QWEN3_06B,
    QWEN3_5_HYBRID,
    QWEN3_8B,
    TINY_QWEN3,
    TINY_QWEN3_5,
    build_pair,
    weight_bytes_per_decode_step,
)
from benchmarks.gpu_step_profile import profile_decode_steps
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.loading.loader import Checkpoint
from engine.models import MODEL_REGISTRY
from engine.runner import ops
from engine.runner.model_runner import allocate_caches, kv_bytes_per_token
from engine.runner.state_cache import HybridCaches
from engine.runner.step_metadata import AttentionMetadata

CHECK_PROMPT, CHECK_NEW = 16, 24


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes/s of a large device-to-device copy (read + write), median of 10."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(11):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(time.perf_counter() - start)
    del src, dst
    return 2 * n * 2 / statistics.median(samples[1:])


def matmul_throughput(device: str, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (what the library reaches here), median of 10."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    samples = []
    for _ in range(11):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        samples.append(time.perf_counter() - start)
    del a, b
    return 2 * n ** 3 / statistics.median(samples[1:])


def time_bounds(checkpoint: Checkpoint, concurrency: int, prompt: int, new: int, bandwidth: float,
                flops: float) -> dict[str, float]:
    """The fewest seconds a level's run can take on this device, and the output tokens/s that allows.

    Memory: every sequence needs `new` forwards one after another (a prefill, then new - 1 decodes),
    each reading every weight once, and each decode reads its sequence's K/V. Compute: 2 FLOPs per
    weight per token (the LM head only at sampled rows). Attention FLOPs and a hybrid's recurrent
    state are left out, so both stay lower bounds (for dense models, as these shapes are: an MoE
    step reads only its routed experts). `overlapped` assumes prefill compute hides under decode
    reads perfectly (the larger of all reads and all compute); `serial` prefills everything first
    and then decodes (each phase as long as its larger part), the shape an all-at-once submission
    takes."""
    config = checkpoint.config
    weights = weight_bytes_per_decode_step(checkpoint)
    element = next(checkpoint.model.parameters()).element_size()
    head = config.vocab_size * config.hidden_size  # LM-head parameters
    body = weights // element - head
    kv = kv_bytes_per_token(config, next(checkpoint.model.parameters()).dtype)
    decode_kv = concurrency * kv * sum(prompt + j for j in range(1, new))
    prefill_flops = 2 * concurrency * (body * prompt + head)
    decode_flops = 2 * concurrency * (body + head) * (new - 1)
    decode_bytes = (new - 1) * weights + decode_kv
    overlapped = max((weights + decode_bytes) / bandwidth, (prefill_flops + decode_flops) / flops)
    serial = (max(prefill_flops / flops, weights / bandwidth)
              + max(decode_flops / flops, decode_bytes / bandwidth))
    tokens = concurrency * new
    return {"overlapped_s": round(overlapped, 6), "serial_s": round(serial, 6),
            "output_tokens_per_s_overlapped": round(tokens / overlapped, 1),
            "output_tokens_per_s_serial": round(tokens / serial, 1)}


# --- runs ------------------------------------------------------------------------------------

def make_core(checkpoint: Checkpoint, device: str, concurrency: int, prompt: int, new: int,
              cuda_graphs: bool) -> EngineCore:
    block_size = 16
    per_seq = -(-(prompt + new) // block_size)
    config = EngineConfig(model="in-memory", device=device, block_size=block_size,
                          num_kv_blocks=concurrency * per_seq + 8, max_num_seqs=concurrency,
                          max_num_batched_tokens=max(8192, prompt), max_model_len=prompt + new,
                          enable_prefix_caching=False, cuda_graphs=cuda_graphs)
    return EngineCore(checkpoint, config)


def run_ours(core: EngineCore, prompts: list[list[int]], new: int, device: str) -> RunResult:
    return run_greedy(core, [(f"r{i}", prompt, new) for i, prompt in enumerate(prompts)],
                      sync=lambda: _sync(device))


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], new: int, device: str,
           scores: list[torch.Tensor] | None = None) -> RunResult:
    """One batch of equal-length prompts (no padding), greedy, exactly `new` tokens each."""
    from transformers import LogitsProcessorList

    input_ids = torch.tensor(prompts, device=device)
    clock = StepClock(lambda: _sync(device))
    result = RunResult()
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0,
                          logits_processor=LogitsProcessorList([clock]),
                          output_scores=scores is not None, return_dict_in_generate=True)
    _sync(device)
    result.wall_s = time.perf_counter() - start
    width = input_ids.shape[1]
    for row in range(len(prompts)):
        result.tokens[f"r{row}"] = out.sequences[row, width:].tolist()
        result.ttft_s.append(clock.times[0] - start)
        result.itl_s.extend(b - a for a, b in pairwise(clock.times))
    if scores is not None:
        scores.extend(s[0].float() for s in out.scores)
    return result


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def summarize(runs: list[RunResult], new: int) -> dict[str, float]:
    tokens = sum(len(t) for t in runs[0].tokens.values())
    assert all(len(t) == new for t in runs[0].tokens.values()), "a request stopped early"
    return {
        "output_tokens_per_s": round(statistics.median(tokens / r.wall_s for r in runs), 1),
        "wall_s": round(statistics.median(r.wall_s for r in runs), 3),
        "ttft_ms_median": round(statistics.median(statistics.median(r.ttft_s) for r in runs) * 1e3, 2),
        "itl_ms_median": round(statistics.median(statistics.median(r.itl_s) for r in runs) * 1e3, 3),
    }


# --- correctness -----------------------------------------------------------------------------

@torch.inference_mode()
def our_last_logits(checkpoint: Checkpoint, prompt: list[int], device: str) -> torch.Tensor:
    model, block_size = checkpoint.model, 16
    blocks = -(-len(prompt) // block_size)
    dtype = next(model.parameters()).dtype
    caches = allocate_caches(model, blocks, block_size, 1, dtype, device)
    if isinstance(caches, HybridCaches):  # the one sequence in state slot 0
        caches.slot_indices = torch.zeros(1, dtype=torch.int32, device=device)
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [list(range(blocks))], block_size,
                                   device)
    positions = torch.arange(len(prompt), device=device)
    hidden = model(torch.tensor(prompt, device=device), positions, caches, meta)
    return model.compute_logits(hidden[-1:])[0].float()


def greedy_agreement(ours: list[int], theirs: list[int], scores: list[torch.Tensor],
                     tie_margin: float) -> dict[str, object]:
    """Tokens must match until the first step where HF's choice leads ours by <= tie_margin
    (a near-tie that rounding may flip); after such a step the continuations may differ."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            continue
        margin = (scores[i][b] - scores[i][a]).item()
        return {"matched_tokens": i, "diverged_at": i, "hf_margin": round(margin, 4),
                "passed": margin <= tie_margin}
    return {"matched_tokens": len(ours), "passed": True}


def check_model(hf: torch.nn.Module, checkpoint: Checkpoint, device: str, tiny: bool) -> dict:
    prompt = random_prompts(1, CHECK_PROMPT, checkpoint.config.vocab_size, seed=1)
    scores: list[torch.Tensor] = []
    theirs = run_hf(hf, prompt, CHECK_NEW, device, scores).tokens["r0"]
    logits = our_last_logits(checkpoint, prompt[0], device)
    cosine = torch.nn.functional.cosine_similarity(logits, scores[0], dim=0).item()
    max_abs = (logits - scores[0]).abs().max().item()
    # fp32 (tiny, CPU): SPEC §7's parity bound; bf16: rounding through every layer.
    min_cosine, tie_margin = (0.9999, 1e-3) if tiny else (0.99, 0.1)
    report: dict[str, object] = {
        "prompt_tokens": CHECK_PROMPT, "new_tokens": CHECK_NEW,
        "last_logits": {"cosine": round(cosine, 6), "max_abs": round(max_abs, 5),
                        "min_cosine": min_cosine,
                        "passed": cosine >= min_cosine and (not tiny or max_abs < 1e-3)},
        "tie_margin": tie_margin,
    }
    graph_settings = (True, False) if device == "cuda" else (False,)
    for graphs in graph_settings:
        key = f"greedy_cuda_graphs_{'on' if graphs else 'off'}"
        try:
            core = make_core(checkpoint, device, 1, CHECK_PROMPT, CHECK_NEW, graphs)
        except Exception as exc:
            if not graphs:
                raise
            # Capture failed: the figures are then taken eagerly, and the run still fails.
            traceback.print_exc()
            report[key] = {"capture_error": f"{type(exc).__name__}: {exc}"}
            _free(device)
            continue
        ours = run_ours(core, prompt, CHECK_NEW, device).tokens["r0"]
        del core
        report[key] = greedy_agreement(ours, theirs, scores, tie_margin)
    report["passed"] = all(v["passed"] for v in report.values() if isinstance(v, dict) and "passed" in v)
    return report


# --- one model -------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.deadline


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def timed(fn, runs: int) -> list[RunResult]:
    fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    return [fn() for _ in range(runs)]


def bench_model(name: str, family: str, sizes: dict, args: argparse.Namespace, device: str,
                dtype: torch.dtype, budget: Budget, bandwidth: float | None, flops: float | None,
                save: Callable[[dict], None]) -> dict:
    """One model's check and figures; `save(entry)` after each level keeps what is done."""
    entry: dict[str, object] = {"model": name, "family": family, "config": sizes,
                                "dtype": str(dtype).removeprefix("torch.")}
    hf, checkpoint = build_pair(family, sizes, device, dtype)
    entry["weight_bytes_per_decode_step"] = weight_bytes_per_decode_step(checkpoint)
    entry["check"] = check_model(hf, checkpoint, device, args.tiny)
    if not entry["check"]["passed"]:
        entry["withheld"] = "outputs failed the correctness check: no speed measured"
        return entry
    graphs = device == "cuda" and "capture_error" not in entry["check"].get("greedy_cuda_graphs_on", {})
    if device == "cuda" and not graphs:
        entry["cuda_graphs_error"] = entry["check"]["greedy_cuda_graphs_on"]["capture_error"]
    vocab = checkpoint.config.vocab_size
    ours, theirs, ratios, skipped, profiles = {}, {}, {}, [], {}
    entry.update(ours=ours, hf_generate=theirs, ours_vs_hf_output_tokens_per_s=ratios)
    for c in args.concurrency:
        if not budget.left():
            skipped.append(c)
            continue
        prompts = random_prompts(c, args.prompt, vocab, seed=c)
        core = make_core(checkpoint, device, c, args.prompt, args.new, graphs)
        # cuBLAS against the Triton one-row product per weight shape (engine.runner.gpu_linear)
        entry.setdefault("batch1_gemv", core.runner.gemv_choices)
        ours[c] = summarize(timed(partial(run_ours, core, prompts, args.new, device), args.runs), args.new)
        ours[c]["decode_tokens_per_s"] = round(c * 1e3 / ours[c]["itl_ms_median"], 1)
        if c in args.profile:
            try:
                profiles[c] = profile_decode_steps(core, prompts, args.new, args.profile_steps,
                                                   lambda: _sync(device), device)
            except Exception as exc:  # a profiler failure must not lose the timings
                traceback.print_exc()
                profiles[c] = {"error": f"{type(exc).__name__}: {exc}"}
            entry["step_profile"] = profiles
        del core
        _free(device)
        if c in args.peer_concurrency:
            theirs[c] = summarize(timed(partial(run_hf, hf, prompts, args.new, device), args.runs), args.new)
            _free(device)
            ratios[c] = round(ours[c]["output_tokens_per_s"] / theirs[c]["output_tokens_per_s"], 2)
        print(f"{name} c={c}: ours {ours[c]['output_tokens_per_s']} tok/s "
              f"(ITL {ours[c]['itl_ms_median']} ms, TTFT {ours[c]['ttft_ms_median']} ms), "
              f"hf {theirs[c]['output_tokens_per_s'] if c in theirs else '-'} tok/s",
              file=sys.stderr, flush=True)
        save(entry)
    if skipped:
        entry["skipped_concurrency"] = {"levels": skipped, "why": "past --budget-s"}
    if 1 in ours and bandwidth:
        roofline = bandwidth / entry["weight_bytes_per_decode_step"]
        measured = 1e3 / ours[1]["itl_ms_median"]
        entry["batch1_decode_roofline"] = {
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "roofline_tokens_per_s": round(roofline, 1),
            "measured_tokens_per_s": round(measured, 1),
            "fraction_of_roofline": round(measured / roofline, 3),
            "note": "weights only; the batch-1 KV reads (prompt + new tokens) are left out",
        }
    if bandwidth and flops:
        entry["bounds"] = bounds = {}
        for c, figures in ours.items():
            bounds[c] = time_bounds(checkpoint, c, args.prompt, args.new, bandwidth, flops)
            bounds[c]["measured_share_of_overlapped"] = round(
                figures["output_tokens_per_s"] / bounds[c]["output_tokens_per_s_overlapped"], 3)
    entry["headline"] = headline(entry, ours)
    save(entry)
    if graphs:
        entry["cuda_graphs"] = graphs_on_off(checkpoint, args, device, budget, ours)
    elif device == "cuda":
        entry["cuda_graphs"] = "capture failed: every figure above is eager"
    else:
        entry["cuda_graphs"] = "not used on CPU"
    del hf, checkpoint
    _free(device)
    return entry


def headline(entry: dict, ours: dict) -> dict[str, object]:
    """Batch 1 against the weight-read roofline, and the largest level measured."""
    result: dict[str, object] = {}
    if "batch1_decode_roofline" in entry:
        result["batch1_itl_ms"] = ours[1]["itl_ms_median"]
        result["batch1_fraction_of_roofline"] = entry["batch1_decode_roofline"]["fraction_of_roofline"]
    if ours:
        top = max(ours)
        result[f"c{top}_output_tokens_per_s"] = ours[top]["output_tokens_per_s"]
        result[f"c{top}_decode_tokens_per_s"] = ours[top]["decode_tokens_per_s"]
        result[f"c{top}_ttft_ms_p50"] = ours[top]["ttft_ms_median"]
        result[f"c{top}_itl_ms"] = ours[top]["itl_ms_median"]
        if top in entry.get("bounds", {}):
            bound = entry["bounds"][top]
            result[f"c{top}_output_tokens_per_s_bound"] = {
                "overlapped": bound["output_tokens_per_s_overlapped"], "serial": bound["output_tokens_per_s_serial"]}
    return result


def graphs_on_off(checkpoint: Checkpoint, args: argparse.Namespace, device: str, budget: Budget,
                  ours: dict) -> dict:
    result = {}
    for c in args.graphs_off:
        if c not in ours or not budget.left():
            continue
        prompts = random_prompts(c, args.prompt, checkpoint.config.vocab_size, seed=c)
        core = make_core(checkpoint, device, c, args.prompt, args.new, False)
        off = summarize(timed(partial(run_ours, core, prompts, args.new, device), args.runs), args.new)
        del core
        _free(device)
        on = ours[c]
        result[c] = {"on": on, "off": off,
                     "itl_speedup": round(off["itl_ms_median"] / on["itl_ms_median"], 2)}
    return result


# --- main ------------------------------------------------------------------------------------

def machine(device: str) -> dict:
    import transformers
    import triton
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "kernels": ops.backend_for(device)}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / (1 << 30), 1),
                    cuda=torch.version.cuda)
    else:
        info["device"] = "cpu"
    return info


def write(report: dict, out: Path | None) -> None:
    """To --out, or without it to $OUT/gpu_engine.json when $OUT is set."""
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "gpu_engine.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


def levels(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke test)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3.5-hybrid")
    parser.add_argument("--peer-concurrency", default=None,
                        help="levels at which HF generate runs too (default: every level)")
    parser.add_argument("--graphs-off", default="1,16",
                        help="levels measured again with CUDA graphs off (GPU only)")
    parser.add_argument("--profile", default="",
                        help="levels at which decode steps are profiled (gpu_step_profile)")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new measurement after this many seconds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        parser.error("real sizes need a GPU; use --tiny for the CPU smoke test")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.runs, args.concurrency, args.prompt, args.new = 1, "1,4", 24, 8
        args.profile_steps = min(args.profile_steps, 4)
        models = {"tiny-qwen3": ("qwen3", TINY_QWEN3), "tiny-qwen3.5-hybrid": ("qwen3_5", TINY_QWEN3_5)}
        dtype = torch.float32
    else:
        known = {"qwen3-0.6b": ("qwen3", QWEN3_06B), "qwen3-8b": ("qwen3", QWEN3_8B),
                 "qwen3.5-hybrid": ("qwen3_5", QWEN3_5_HYBRID)}
        models = {m: known[m] for m in args.models.split(",") if m}
        dtype = torch.bfloat16
    args.concurrency = levels(args.concurrency)
    args.peer_concurrency = (args.concurrency if args.peer_concurrency is None
                             else levels(args.peer_concurrency))
    args.graphs_off, args.profile = levels(args.graphs_off), levels(args.profile)
    budget = Budget(args.budget_s)
    bandwidth = copy_bandwidth(device, 0.0625 if args.tiny else 4.0)
    flops = matmul_throughput(device, dtype, 256 if args.tiny else 8192)
    report: dict[str, object] = {
        "benchmark": "gpu_engine", "tiny": args.tiny,
        "inputs": {"concurrency": args.concurrency, "peer_concurrency": args.peer_concurrency,
                   "prompt_tokens": args.prompt,
                   "new_tokens": args.new, "sampling": "greedy, ignore_eos", "runs": args.runs,
                   "prompts": "random token ids, all submitted at once",
                   "peer": "HF transformers generate, one batch, same weights, same process"},
        "machine": machine(device), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "matmul_tflops": round(flops / 1e12, 2),
        "models": [],
    }
    failed = False
    for name, (family, sizes) in models.items():
        if family not in MODEL_REGISTRY:
            report["models"].append({"model": name, "skipped": f"engine.models has no {family}"})
            continue
        if not budget.left():
            report["models"].append({"model": name, "skipped": "past --budget-s"})
            continue
        done = list(report["models"])

        def save(progress: dict) -> None:
            report["models"] = [*done, progress]  # noqa: B023  (called only during this iteration)
            write(report, args.out)

        try:
            entry = bench_model(name, family, sizes, args, device, dtype, budget, bandwidth, flops, save)
        except Exception as exc:  # one model's failure must not lose the others' figures
            traceback.print_exc()  # into the log: the JSON keeps the one line
            entry = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
            _free(device)
        failed |= any(key in entry for key in ("error", "withheld", "cuda_graphs_error"))
        save(entry)
    report["all_passed"] = not failed
    write(report, args.out)
    print(json.dumps(report, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
