"""Engine throughput on SmolLM2: our continuous-batching engine against HF transformers `generate`.

Workload (fixed, seeded): 32 requests, prompt lengths spread over 32–256 tokens, max_tokens spread
over 16–128, greedy, ignore_eos, all submitted at once. Contenders, all in this one process:
  - ours, max_num_seqs 16 and 32 (EngineCore in-process, stepping until done)
  - transformers, padded batches of 16 (each batch runs to its longest request)
  - transformers, batch 1, one request after another
Reported: useful output tokens/s (only the tokens each request asked for), TTFT and inter-token
latency medians, each the median over --runs runs, and ratios to the best transformers figure.
Single-stream decode (one request alone) is measured for ours and for transformers batch 1.

Correctness gate: every contender's tokens are compared with transformers batch 1 (the reference).
A contender whose outputs disagree on a request's first CHECK_TOKENS tokens gets no speed printed.

    python -m benchmarks.engine_throughput --runs 3 --out benchmarks/results/engine_throughput-cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

from benchmarks.core_timing import RunResult, StepClock, run_greedy
from benchmarks.lib import TEXT, emit
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint

NUM_REQUESTS = 32
CHECK_TOKENS = 16


@dataclass
class Work:
    request_id: str
    prompt: list[int]
    max_tokens: int


def useful_tokens(run: RunResult, work: list[Work]) -> int:
    return sum(min(len(run.tokens[w.request_id]), w.max_tokens) for w in work)


def workload(checkpoint: Checkpoint) -> list[Work]:
    ids = checkpoint.tokenizer.encode(TEXT * 8, add_special_tokens=False)
    rng = random.Random(0)
    prompt_lens = [32 + round(i * (256 - 32) / (NUM_REQUESTS - 1)) for i in range(NUM_REQUESTS)]
    max_tokens = [16 + round(i * (128 - 16) / (NUM_REQUESTS - 1)) for i in range(NUM_REQUESTS)]
    rng.shuffle(prompt_lens)
    rng.shuffle(max_tokens)
    work = []
    for i, (length, new) in enumerate(zip(prompt_lens, max_tokens, strict=True)):
        start = (i * 37) % (len(ids) - length)
        work.append(Work(f"r{i}", ids[start:start + length], new))
    return work


def run_ours(checkpoint: Checkpoint, work: list[Work], max_num_seqs: int) -> RunResult:
    config = EngineConfig(model="in-memory", max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                          enable_prefix_caching=False)
    core = EngineCore(checkpoint, config)
    return run_greedy(core, [(w.request_id, w.prompt, w.max_tokens) for w in work])


def run_hf(hf_model: torch.nn.Module, work: list[Work], batch_size: int, pad_id: int) -> RunResult:
    from transformers import LogitsProcessorList

    result = RunResult()
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(w.prompt) for w in batch)
        # Left padding, as decoder-only batching needs.
        input_ids = torch.tensor([[pad_id] * (width - len(w.prompt)) + w.prompt for w in batch])
        mask = torch.tensor([[0] * (width - len(w.prompt)) + [1] * len(w.prompt) for w in batch])
        clock = StepClock()
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max(w.max_tokens for w in batch),
                do_sample=False, pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        for row, w in enumerate(batch):
            result.tokens[w.request_id] = out[row, width:width + w.max_tokens].tolist()
            # A request's token k exists once step k has run; later steps serve only its companions.
            steps = clock.times[:w.max_tokens]
            result.ttft_s.append(steps[0] - start)
            result.itl_s.extend(b - a for a, b in pairwise(steps))
    result.wall_s = time.perf_counter() - start
    return result


def single_stream_decode(run: RunResult) -> float:
    return 1.0 / statistics.median(run.itl_s)


def mismatches(result: RunResult, reference: RunResult) -> list[str]:
    bad = []
    for request_id, ref in reference.tokens.items():
        if result.tokens[request_id][:CHECK_TOKENS] != ref[:CHECK_TOKENS]:
            bad.append(request_id)
    return bad


def summarize(name: str, runs: list[RunResult], work: list[Work], reference: RunResult | None) -> dict:
    bad = sorted({rid for r in runs for rid in (mismatches(r, reference) if reference else [])})
    useful = useful_tokens(runs[0], work)
    entry: dict = {"name": name, "useful_output_tokens": useful, "correct": not bad}
    if bad:
        entry["mismatched_requests"] = bad
        entry["withheld"] = f"outputs differ from the reference in the first {CHECK_TOKENS} tokens"
        return entry
    entry.update(
        output_tokens_per_s=round(statistics.median(useful / r.wall_s for r in runs), 2),
        wall_s=round(statistics.median(r.wall_s for r in runs), 3),
        ttft_ms_median=round(statistics.median(statistics.median(r.ttft_s) for r in runs) * 1000, 1),
        itl_ms_median=round(statistics.median(statistics.median(r.itl_s) for r in runs) * 1000, 2),
    )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    checkpoint = load_checkpoint(path)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # ignore_eos: run every request to its max_tokens without masking the eos logit.
    hf_model.generation_config.eos_token_id = None
    work = workload(checkpoint)
    pad_id = checkpoint.tokenizer.eos_token_id

    results: dict[str, list[RunResult]] = {k: [] for k in ("hf_batch1", "hf_padded16", "ours_seqs16", "ours_seqs32")}
    for _ in range(args.runs):
        results["hf_batch1"].append(run_hf(hf_model, work, 1, pad_id))
        results["hf_padded16"].append(run_hf(hf_model, work, 16, pad_id))
        results["ours_seqs16"].append(run_ours(checkpoint, work, 16))
        results["ours_seqs32"].append(run_ours(checkpoint, work, 32))
    reference = results["hf_batch1"][0]
    contenders = [summarize(name, runs, work, reference if name != "hf_batch1" else None)
                  for name, runs in results.items()]

    # Single stream: one 128-token prompt, 128 new tokens, alone.
    single = [Work("solo", work[0].prompt[:32] * 4, 128)]
    ours_single = [run_ours(checkpoint, single, 1) for _ in range(args.runs)]
    hf_single = [run_hf(hf_model, single, 1, pad_id) for _ in range(args.runs)]
    single_ok = not mismatches(ours_single[0], hf_single[0])

    by_name = {c["name"]: c for c in contenders}
    speeds = {n: c.get("output_tokens_per_s") for n, c in by_name.items()}
    best_hf = max((v for n, v in speeds.items() if n.startswith("hf") and v), default=None)
    best_ours = max((v for n, v in speeds.items() if n.startswith("ours") and v), default=None)
    report = {
        "benchmark": "engine_throughput",
        "model": checkpoint.model_id,
        "workload": {
            "requests": NUM_REQUESTS, "prompt_tokens": "32-256 (spread)", "max_tokens": "16-128 (spread)",
            "sampling": "greedy, ignore_eos", "dtype": "float32", "submitted": "all at once",
            "check": f"first {CHECK_TOKENS} tokens of every request equal transformers batch 1",
        },
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "runs": args.runs,
        "contenders": contenders,
        "single_stream_decode_tok_per_s": {
            "correct": single_ok,
            "ours": round(statistics.median(single_stream_decode(r) for r in ours_single), 2) if single_ok else None,
            "hf_batch1": round(statistics.median(single_stream_decode(r) for r in hf_single), 2),
        },
        "ratios": {
            "ours_best_vs_hf_best_throughput": round(best_ours / best_hf, 2) if best_ours and best_hf else None,
        },
    }
    ss = report["single_stream_decode_tok_per_s"]
    if ss["ours"]:
        report["ratios"]["ours_vs_hf_single_stream_decode"] = round(ss["ours"] / ss["hf_batch1"], 2)
    emit(report, args.out)


if __name__ == "__main__":
    main()
