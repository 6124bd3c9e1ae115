"""Interactive TTFT with and without a batch running: what a batch costs the interactive users.

One `helexa up` (the default model, or with `--script` a scripted worker emitting a token every
`--token-delay-ms` per stream, which measures admission and the pipeline, not the engine). First
`--streams` interactive streams run at once through the OpenAI SDK on the idle system, `--runs`
times; then a batch of `--lines` chat lines is uploaded and created with the same SDK
(`/v1/files`, `/v1/batches`), and once it is in progress the same streams run again, while its
lines hold the engine. The report gives both TTFT p50s and their ratio (the issue's goal: at most
1.25x), and the batch's counts when the measurement ended (then it is cancelled; a batch already
done by then did not load the whole measurement: `batch_ran_throughout` says so). A run whose
streams did not all carry their `--max-tokens` tokens of text is reported as failed, without
figures.

    python -m benchmarks.batch_ttft --out benchmarks/results/batch_ttft-<machine>.json
    python -m benchmarks.batch_ttft --script --lines 20 --streams 4 --runs 1   # a quick proof that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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


def measured(load: OpenAILoad, streams: int, runs: int, max_tokens: int) -> dict:
    """TTFT p50 over `runs` runs of `streams` concurrent streams, or why the runs failed."""
    results: list[LoadResult] = [load.run([PROMPT] * streams, max_tokens, concurrent=True) for _ in range(runs)]
    if not all(s.text.strip() and s.completion_tokens == max_tokens for r in results for s in r.streams):
        return {"failed": "a stream had no text or not max_tokens tokens"}
    return {"runs": runs, "ttft_ms_p50": round(statistics.median(r.ttft_ms_median for r in results), 2),
            "itl_ms_p50": round(statistics.median(r.itl_ms_median for r in results), 2)}


def started_batch(client: OpenAI, model: str, lines: int, max_tokens: int) -> str:
    upload = client.files.create(file=("batch.jsonl", batch_file(model, lines, max_tokens)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + START_TIMEOUT_S
    while (batch := client.batches.retrieve(batch.id)).status != "in_progress":
        if batch.status in ("failed", "expired", "cancelled", "completed") or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch.id} is {batch.status}, not in progress")
        time.sleep(0.5)
    return batch.id


def measure(args: argparse.Namespace, scratch: Path) -> dict:
    env = {"HELEXA_RATE_LIMIT_RPS": "0", "HELEXA_MAX_NUM_SEQS": str(args.max_num_seqs),
           "HELEXA_BATCH_CONCURRENCY": str(args.batch_concurrency)}
    if args.script:
        script_path = scratch / "script.json"
        script_path.write_text(json.dumps(script(args.max_tokens, args.token_delay_ms / 1000)))
        env["HELEXA_WORKER_SCRIPT"] = str(script_path)
    os.environ.update(env)
    # A scripted worker measures no dtype: a fixed one.
    server = helexa_up(scratch / "up", free_port(), "float32" if args.script else args.dtype)
    with server, OpenAILoad(server.base_url, server.model) as load:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)
        load.run([PROMPT], args.max_tokens, concurrent=False)  # warm-up: connections, first templates
        idle = measured(load, args.streams, args.runs, args.max_tokens)
        batch_id = started_batch(client, server.model, args.lines, args.max_tokens)
        busy = measured(load, args.streams, args.runs, args.max_tokens)
        counts = client.batches.retrieve(batch_id).request_counts
        client.batches.cancel(batch_id)
        client.close()
    result: dict[str, Any] = {"idle": idle, "with_batch": busy,
              "batch_counts_at_end": counts.model_dump() if counts is not None else None,
              "server": server.details()}
    # A batch that was done before the streams were would have measured a partly idle system.
    result["batch_ran_throughout"] = counts is not None and counts.completed + counts.failed < counts.total
    if "failed" not in idle and "failed" not in busy:
        result["ttft_ratio"] = round(busy["ttft_ms_p50"] / idle["ttft_ms_p50"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the worker's HELEXA_MAX_NUM_SEQS")
    parser.add_argument("--batch-concurrency", type=int, default=32, help="lines the batch runner keeps in flight")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--script", action="store_true", help="a scripted worker instead of the model")
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="with --script: per stream")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="helexa-batch-ttft-") as scratch:
        result = measure(args, Path(scratch))
    emit({"benchmark": "batch_ttft", "machine": machine_info(),
          "inputs": {k: v for k, v in vars(args).items() if k != "out"}, "results": result}, args.out)


if __name__ == "__main__":
    main()
