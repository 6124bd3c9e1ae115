"""Tensor parallelism: TP = 1 against TP = N on the same machine, the engine core in-process.

Workload (fixed): one stream, then 16 at once; each a distinct prompt of PROMPT_TOKENS tokens and
--tokens new ones, greedy, ignore_eos, float32. Reported per TP: output tokens/s at 1 and 16
streams, and per rank the weight and KV-cache bytes it holds and its process's resident memory;
then the ratios TP=N / TP=1. Correctness gate: TP=N's greedy tokens must equal TP=1's for every
stream, or no speed is printed (the first difference is). On a machine with fewer cores than the
ranks want (2 cores here), expect no speed-up: the figure is for larger machines.

On a GPU (`--device cuda --random`, gpu_run.sh's `tp` stage) the same run is the GPU check of
tensor parallelism, on a small random llama written to a temporary folder (the GPU machine has
no checkpoint): ranks sharing one GPU use gloo over CUDA tensors (NCCL refuses two ranks on one
device), one GPU a rank uses NCCL. tests/engine/test_tensor_parallel.py runs it on CPU.

    python -m benchmarks.tensor_parallel --tensor-parallel 3 --out benchmarks/results/tensor_parallel-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.core_timing import run_greedy
from benchmarks.lib import emit, machine_info
from engine.core.core_process import build_core
from engine.frontend.engine_config import EngineConfig
from engine.loading.default_model import default_model_path

PROMPT_TOKENS = 32
STREAMS = (1, 16)


def save_random_llama(directory: Path) -> str:
    """A small random llama whose sharded dimensions divide by 2, 3 and 4, in float32."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=384, intermediate_size=1152, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=12, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    # The engine runs on token ids; the loader still wants a tokenizer: a one-word one will do.
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    return str(directory)


def requests(streams: int, tokens: int) -> list[tuple[str, list[int], int]]:
    return [(f"s{i}", [(97 * i + 13 * t) % 4000 + 100 for t in range(PROMPT_TOKENS)], tokens)
            for i in range(streams)]


def measure(model: str, world: int, device: str, tokens: int) -> dict:
    config = EngineConfig(model=model, dtype="float32", device=device, max_num_seqs=16,
                          num_kv_blocks=512, tensor_parallel=world)
    core = build_core(config)
    try:
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        run_greedy(core, requests(2, 4), sync)  # warm-up
        runs = {streams: run_greedy(core, requests(streams, tokens), sync) for streams in STREAMS}
        runner = core.runner
        ranks = [{"rank": 0, "weight_bytes": runner.weight_bytes, "kv_bytes": runner.kv_bytes,
                  "rss_bytes": psutil.Process().memory_info().rss}]
        if runner.followers is not None:
            for report, pid in zip(runner.followers.reports, runner.followers.pids, strict=True):
                ranks.append({"rank": report.rank, "weight_bytes": report.weight_bytes,
                              "kv_bytes": report.kv_bytes, "rss_bytes": psutil.Process(pid).memory_info().rss})
        return {
            "tensor_parallel": world,
            "tokens": {streams: run.tokens for streams, run in runs.items()},
            "tok_per_s": {str(streams): round(sum(len(t) for t in run.tokens.values()) / run.wall_s, 2)
                          for streams, run in runs.items()},
            "ranks": ranks,
        }
    finally:
        core.close()
        del core
        gc.collect()


def first_difference(ours: dict[str, list[int]], reference: dict[str, list[int]]) -> str | None:
    for request_id, tokens in reference.items():
        if ours[request_id] != tokens:
            at = next((i for i, (a, b) in enumerate(zip(ours[request_id], tokens, strict=False)) if a != b),
                      min(len(tokens), len(ours[request_id])))
            return f"{request_id} differs at token {at}"
    return None


def main(argv: list[str] | None = None) -> dict:
    """The report, printed (and written to --out); exits 1 when TP=N's tokens differ from TP=1's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: SmolLM2-135M)")
    parser.add_argument("--tensor-parallel", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--random", action="store_true", help="a small random llama instead of --model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="helexa-tp-bench-") as scratch:
        model = save_random_llama(Path(scratch)) if args.random else args.model or str(default_model_path())
        return compare(model, args)


def compare(model: str, args: argparse.Namespace) -> dict:
    machine = machine_info()
    started = time.perf_counter()
    one = measure(model, 1, args.device, args.tokens)
    many = measure(model, args.tensor_parallel, args.device, args.tokens)
    differences = {streams: first_difference(many["tokens"][streams], one["tokens"][streams]) for streams in STREAMS}
    agree = all(d is None for d in differences.values())
    report: dict = {
        "benchmark": "tensor_parallel", "model": model, "device": args.device, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.tokens, "streams": list(STREAMS), "machine": machine,
        "greedy_identical": agree,
        "note": ("the ranks share the machine's cores, fewer than two a rank: no speed-up to expect "
                 "here; the figure is for larger machines") if (machine["cpus"] or 1) < 2 * args.tensor_parallel
        and args.device == "cpu" else "",
    }
    for entry in (one, many):
        entry.pop("tokens")
        if not agree:
            entry.pop("tok_per_s")
    report["tp1"], report[f"tp{args.tensor_parallel}"] = one, many
    if agree:
        report["ratio_tok_per_s"] = {str(s): round(many["tok_per_s"][str(s)] / one["tok_per_s"][str(s)], 3)
                                     for s in STREAMS}
    else:
        report["differences"] = {str(s): d for s, d in differences.items() if d is not None}
    report["per_rank_weight_ratio"] = round(many["ranks"][0]["weight_bytes"] / one["ranks"][0]["weight_bytes"], 3)
    report["per_rank_kv_ratio"] = round(many["ranks"][0]["kv_bytes"] / one["ranks"][0]["kv_bytes"], 3)
    report["load_average_1m_after"] = round(psutil.getloadavg()[0], 2)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    emit(report, args.out)
    if not agree:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
