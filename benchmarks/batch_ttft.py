"""Interactive TTFT with and without a batch running: what a batch costs the interactive users.

One `helexa up` (the default model, or with `--script` a scripted worker emitting a token every
`--token-delay-ms` per stream, which measures admission and the pipeline, not the engine). The two
conditions are interleaved in one run, ABBA (idle, busy, busy, idle, ...: `--runs` of each), so
drift of the host (other work on shared cores, a warming cache) falls on both alike: an idle round
runs `--streams` interactive streams at once through the OpenAI SDK on a system with no batch; a
busy round runs the same streams while a batch of `--lines` chat lines (uploaded and created with
the same SDK, `/v1/files`, `/v1/batches`) is in progress and holds the engine. Between a busy round
and an idle one the batch is cancelled and waited out (`cancelled`: its running lines finished);
the next busy round starts a new one. Each round records the host's load average before and after.

The report gives both TTFT p50s (median over the rounds of each round's median) and their ratio
(the issue's goal: at most 1.25x) only when every check held: every stream of every round carried
its `--max-tokens` tokens of text, and every busy round ended with its batch still in progress
(not done early, which would have measured a partly idle system). Otherwise it reports `failed`
with the reasons and no figures, and exits 1.

    python -m benchmarks.batch_ttft --out benchmarks/results/batch_ttft-<machine>.json
    python -m benchmarks.batch_ttft --script --lines 20 --streams 4 --runs 2   # a quick proof that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from benchmarks.frame_window import script
from benchmarks.lib import emit, machine_info
from benchmarks.openai_load import LoadResult, OpenAILoad
from benchmarks.servers import free_port, helexa_up

PROMPT = [1, 2, 3]
# How long the batch may take to be in progress (validated, its first lines sent) at most.
START_TIMEOUT_S = 300.0


def batch_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = ({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": f"Line {i}: write about the sea."}]}}
            for i in range(lines))
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def round_of(load: OpenAILoad, streams: int, max_tokens: int) -> dict:
    """One round of `streams` concurrent streams: its TTFT and ITL medians, host load around it,
    and whether every stream carried its tokens."""
    load_before = os.getloadavg()[0]
    result: LoadResult = load.run([PROMPT] * streams, max_tokens, concurrent=True)
    ok = all(s.text.strip() and s.completion_tokens == max_tokens for s in result.streams)
    return {"ok": ok, "ttft_ms_p50": round(result.ttft_ms_median, 2), "itl_ms_p50": round(result.itl_ms_median, 2),
            "load1_before": round(load_before, 2), "load1_after": round(os.getloadavg()[0], 2)}


def started_batch(client: OpenAI, model: str, lines: int, max_tokens: int) -> str:
    upload = client.files.create(file=("batch.jsonl", batch_file(model, lines, max_tokens)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + START_TIMEOUT_S
    while (batch := client.batches.retrieve(batch.id)).status != "in_progress" or not batch.request_counts:
        if batch.status in ("failed", "expired", "cancelled", "completed") or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch.id} is {batch.status}, not in progress")
        time.sleep(0.5)
    return batch.id


def still_running(client: OpenAI, batch_id: str) -> bool:
    batch = client.batches.retrieve(batch_id)
    counts = batch.request_counts
    return batch.status == "in_progress" and counts is not None and counts.completed + counts.failed < counts.total


def ended(client: OpenAI, batch_id: str) -> dict:
    """Cancel the batch and wait until it is `cancelled` (its running lines finished); its counts."""
    client.batches.cancel(batch_id)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (batch := client.batches.retrieve(batch_id)).status not in ("cancelled", "completed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} is still {batch.status}")
        time.sleep(0.5)
    return batch.request_counts.model_dump() if batch.request_counts is not None else {}


def order(runs: int) -> list[str]:
    """ABBA: idle, busy, busy, idle, idle, busy, ... `runs` of each."""
    pairs = [("idle", "busy") if i % 2 == 0 else ("busy", "idle") for i in range(runs)]
    return [condition for pair in pairs for condition in pair]


def summary(rounds: list[dict]) -> dict:
    """The figures, or why there are none."""
    reasons = sorted({f"{r['condition']} round {r['index']}: a stream had no text or not max_tokens tokens"
                      for r in rounds if not r["ok"]}
                     | {f"busy round {r['index']}: the batch was no longer in progress at its end"
                        for r in rounds if r["condition"] == "busy" and not r["batch_ran_throughout"]})
    if reasons:
        return {"failed": reasons}
    p50 = {condition: round(statistics.median(r["ttft_ms_p50"] for r in rounds if r["condition"] == condition), 2)
           for condition in ("idle", "busy")}
    itl = {condition: round(statistics.median(r["itl_ms_p50"] for r in rounds if r["condition"] == condition), 2)
           for condition in ("idle", "busy")}
    return {"idle_ttft_ms_p50": p50["idle"], "with_batch_ttft_ms_p50": p50["busy"],
            "idle_itl_ms_p50": itl["idle"], "with_batch_itl_ms_p50": itl["busy"],
            "ttft_ratio": round(p50["busy"] / p50["idle"], 3)}


def measure(args: argparse.Namespace, scratch: Path) -> dict:
    env = {"HELEXA_RATE_LIMIT_RPS": "0", "HELEXA_MAX_NUM_SEQS": str(args.max_num_seqs),
           "HELEXA_BATCH_CONCURRENCY": str(args.batch_concurrency),
           "HELEXA_INTERACTIVE_RESERVE": str(args.interactive_reserve),
           "HELEXA_BATCH_STEP_INTERVAL": str(args.batch_step_interval),
           "HELEXA_BATCH_PREFILL_TOKENS": str(args.batch_prefill_tokens),
           "HELEXA_BATCH_NARROW_S": str(args.batch_narrow_s),
           "HELEXA_BATCH_NARROW_TOKENS": str(args.batch_narrow_tokens)}
    if args.script:
        script_path = scratch / "script.json"
        script_path.write_text(json.dumps(script(args.max_tokens, args.token_delay_ms / 1000)))
        env["HELEXA_WORKER_SCRIPT"] = str(script_path)
    os.environ.update(env)
    # A scripted worker measures no dtype: a fixed one.
    server = helexa_up(scratch / "up", free_port(), "float32" if args.script else args.dtype)
    rounds: list[dict] = []
    batches: list[dict] = []
    with server, OpenAILoad(server.base_url, server.model) as load:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)
        load.run([PROMPT], args.max_tokens, concurrent=False)  # warm-up: connections, first templates
        batch_id: str | None = None
        for index, condition in enumerate(order(args.runs)):
            if condition == "busy" and batch_id is None:
                batch_id = started_batch(client, server.model, args.lines, args.max_tokens)
            if condition == "idle" and batch_id is not None:
                batches.append({"batch_id": batch_id, "counts_at_end": ended(client, batch_id)})
                batch_id = None
            measured = {"index": index, "condition": condition, **round_of(load, args.streams, args.max_tokens)}
            if batch_id is not None:
                measured["batch_ran_throughout"] = still_running(client, batch_id)
            rounds.append(measured)
            print(json.dumps(measured), file=sys.stderr, flush=True)
        if batch_id is not None:
            batches.append({"batch_id": batch_id, "counts_at_end": ended(client, batch_id)})
        client.close()
    return {**summary(rounds), "rounds": rounds, "batches": batches, "server": server.details()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the worker's HELEXA_MAX_NUM_SEQS")
    parser.add_argument("--batch-concurrency", type=int, default=32, help="lines the batch runner keeps in flight")
    parser.add_argument("--interactive-reserve", type=int, default=-1,
                        help="the worker's HELEXA_INTERACTIVE_RESERVE (-1: its default, a quarter of max_num_seqs)")
    parser.add_argument("--batch-step-interval", type=int, default=8,
                        help="the worker's HELEXA_BATCH_STEP_INTERVAL (1: batch sequences in every step)")
    parser.add_argument("--batch-prefill-tokens", type=int, default=64,
                        help="the worker's HELEXA_BATCH_PREFILL_TOKENS (batch prompt tokens a step computes at most)")
    parser.add_argument("--batch-narrow-s", type=float, default=10.0,
                        help="the worker's HELEXA_BATCH_NARROW_S (0: batch steps never narrow)")
    parser.add_argument("--batch-narrow-tokens", type=int, default=16,
                        help="the worker's HELEXA_BATCH_NARROW_TOKENS (batch tokens of a narrow step)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--script", action="store_true", help="a scripted worker instead of the model")
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="with --script: per stream")
    parser.add_argument("--label", default="", help="what this run is (the machine, its load, a smaller scale)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="helexa-batch-ttft-") as scratch:
        result = measure(args, Path(scratch))
    emit({"benchmark": "batch_ttft", "machine": machine_info(), "label": args.label,
          "inputs": {k: v for k, v in vars(args).items() if k not in ("out", "label")}, "results": result}, args.out)
    if "failed" in result:
        sys.exit(1)


if __name__ == "__main__":
    main()
