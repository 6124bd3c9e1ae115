"""Where one engine step spends its time: a decode step and a mixed step at 16 sequences, in process.

The engine core runs the default model (SmolLM2-135M) on this machine's CPU. Two steps, each
measured on its own:
  - decode: 16 sequences of 128-token prompts, all decoding (one token each);
  - mixed: 15 sequences decoding (contexts 40..600 tokens, all different) beside one 512-token
    prefill chunk, the normal step under chunked prefill;
  - cached prompts: 16 prompts of 128 tokens whose first 112 the prefix cache holds (the first
    step of benchmarks/cpu_peers.py's burst after its warm-up), attended as the engine does and, for
    comparison, with every chunk through SDPA (engine.runner.attention_plan.KERNEL_CHUNK_KEYS = 0).
For each: the median wall time of a step (no profiler), then one profiled pass whose ATen time is
split into categories (matmul, attention, gathers, norms, ...) and what is left of the step's wall
time outside any ATen op: Python and dispatch ("host").

    python -m benchmarks.step_profile --out benchmarks/results/step_profile-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib import emit, machine_info
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRequest, SamplingParams
from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint
from engine.runner import attention_plan

CHUNK = 512
NUM_SEQS = 16
# ATen op name fragments -> category; the first match wins.
CATEGORIES = [
    ("matmul", ("addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "onednn",
                "bf16_linear")),
    ("attention", ("attention", "_safe_softmax", "softmax", "baddbmm")),
    ("gather", ("index_select", "index", "gather", "embedding")),
    ("kv_store", ("index_put", "scatter")),
    ("copy_cat", ("aten::cat", "aten::copy_", "contiguous", "clone", "aten::to", "_to_copy", "stack")),
    ("alloc", ("empty", "zeros", "full", "new_", "arange", "aten::tensor", "fill_")),
    ("norm", ("rsqrt", "pow", "mean", "rms_norm")),
    ("elementwise", ("mul", "add", "sub", "silu", "sigmoid", "neg", "div", "where", "masked")),
    ("sampling", ("argmax", "topk", "sort", "max", "multinomial", "log_softmax", "item")),
]


def category(op_name: str) -> str:
    for name, fragments in CATEGORIES:
        if any(fragment in op_name for fragment in fragments):
            return name
    return "other"


def request(request_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True))


def prompt_ids(checkpoint: Checkpoint, length: int, offset: int) -> list[int]:
    text = "The history of navigation is a story of people learning to read the sky and the sea. "
    ids = checkpoint.tokenizer.encode(text * (length // 8 + 8), add_special_tokens=False)
    return ids[offset:offset + length]


def decode_core(checkpoint: Checkpoint) -> EngineCore:
    """16 sequences past their 128-token prefill, each with tokens left to decode."""
    core = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=NUM_SEQS,
                                               max_num_batched_tokens=2048, enable_prefix_caching=False))
    for i in range(NUM_SEQS):
        core.add_request(request(f"d{i}", prompt_ids(checkpoint, 128, i), 10_000))
    core.step()  # the one prefill step
    return core


def mixed_core(checkpoint: Checkpoint) -> EngineCore:
    """15 decoding sequences of different lengths; each timed step adds a fresh long prompt, whose
    first 512-token chunk shares the step with the 15 decodes."""
    core = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=NUM_SEQS,
                                               max_num_batched_tokens=CHUNK + NUM_SEQS - 1,
                                               enable_prefix_caching=False))
    for i in range(NUM_SEQS - 1):
        core.add_request(request(f"m{i}", prompt_ids(checkpoint, 40 + i * 40, i), 10_000))
    while core.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    return core


class CachedPromptsStep:
    """16 prompts of 128 tokens, seen before: each step recomputes their last block, then aborts them."""

    def __init__(self, checkpoint: Checkpoint, chunk_keys: int) -> None:
        self.core = EngineCore(checkpoint, EngineConfig(model="in-memory", max_num_seqs=NUM_SEQS,
                                                        max_num_batched_tokens=2048))
        self.prompts = [prompt_ids(checkpoint, 128, i * 23) for i in range(NUM_SEQS)]
        self.chunk_keys, self.count = chunk_keys, 0

    def __call__(self) -> None:
        ids = [f"c{self.count}_{i}" for i in range(NUM_SEQS)]
        self.count += 1
        for request_id, prompt in zip(ids, self.prompts, strict=True):
            self.core.add_request(request(request_id, prompt, 1))
        default, attention_plan.KERNEL_CHUNK_KEYS = attention_plan.KERNEL_CHUNK_KEYS, self.chunk_keys
        try:
            self.core.step()
        finally:
            attention_plan.KERNEL_CHUNK_KEYS = default
        self.core.abort(ids)


class MixedStep:
    def __init__(self, core: EngineCore, checkpoint: Checkpoint) -> None:
        self.core, self.prompt, self.count = core, prompt_ids(checkpoint, 2 * CHUNK, 0), 0

    def __call__(self) -> None:
        request_id = f"long{self.count}"
        self.count += 1
        self.core.add_request(request(request_id, self.prompt, 1))
        self.core.step()
        self.core.abort([request_id])


def time_steps(step, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples


def profile_steps(step, repeats: int) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        wall_us = (time.perf_counter() - start) * 1e6 / repeats
    by_category: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total / repeats
        by_category[category(event.key)] = by_category.get(category(event.key), 0.0) + self_us
        top.append((self_us, event.key, event.count // repeats))
    aten_us = sum(by_category.values())
    top.sort(reverse=True)
    return {
        "profiled_step_ms": round(wall_us / 1000, 2),
        "ms_by_category": {k: round(v / 1000, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "host_ms_outside_aten": round((wall_us - aten_us) / 1000, 2),
        "top_ops": [{"op": name, "ms": round(us / 1000, 3), "calls_per_step": calls}
                    for us, name, calls in top[:15]],
    }


def measure(name: str, step, repeats: int) -> dict:
    for _ in range(3):
        step()  # warm up allocator and kernels
    samples = time_steps(step, repeats)
    return {"step": name, "step_ms_median": round(statistics.median(samples) * 1000, 2),
            "step_ms_min": round(min(samples) * 1000, 2), **profile_steps(step, max(repeats // 2, 3))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    checkpoint = load_checkpoint(default_model_path(), dtype=getattr(torch, args.dtype))
    decode = decode_core(checkpoint)
    mixed = mixed_core(checkpoint)
    report = {
        "benchmark": "step_profile",
        "model": checkpoint.model_id,
        "dtype": args.dtype,
        "machine": machine_info(),
        "note": "shared machine: compare categories and ratios taken in the same run, not absolute ms",
        "steps": [measure("decode_16", decode.step, args.repeats),
                  measure(f"mixed_{CHUNK}_chunk_plus_{NUM_SEQS - 1}_decodes", MixedStep(mixed, checkpoint),
                          args.repeats),
                  measure("cached_prompts_16x128", CachedPromptsStep(checkpoint, attention_plan.KERNEL_CHUNK_KEYS),
                          args.repeats),
                  measure("cached_prompts_16x128_all_chunks_sdpa", CachedPromptsStep(checkpoint, 0), args.repeats)],
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
