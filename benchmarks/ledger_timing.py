"""Where a 16-stream burst's time to first token goes through helexa's pipeline, from its own ledger.

The client measures TTFT from the moment its SDK call starts. The ledger (`runs`, written by the
recorder) has, per request: `queue_ms`, from the gateway's accepting the request to the worker's
taking it, and `ttft_ms`, from the gateway's accepting it to the worker's first token. So per
stream:
  - client side: client TTFT - ledger TTFT (the SDK, HTTP, the gateway's intake before it accepts,
    and the first token's way back to the client);
  - gateway -> worker: queue_ms (JetStream and the worker's intake);
  - worker: ledger TTFT - queue_ms (the batch window, the prefill, waiting for earlier steps).
Each is the median over a burst's streams, then the median over bursts.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from pathlib import Path

import asyncpg

from benchmarks.openai_load import LoadResult

RECORDED_WAIT_S = 30.0  # the recorder writes runs a moment after they finish


def database_url(log_path: Path) -> str | None:
    """The ledger's address as `helexa up` prints it."""
    match = re.search(r"DATABASE_URL=(\S+)", log_path.read_text(errors="replace"))
    return match.group(1) if match else None


async def _runs(url: str, request_ids: list[str]) -> dict[str, tuple[float, float]]:
    connection = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + RECORDED_WAIT_S
        while True:
            rows = await connection.fetch(
                "SELECT request_id, queue_ms, ttft_ms FROM runs "
                "WHERE request_id = ANY($1::text[]) AND ttft_ms IS NOT NULL", request_ids)
            if len(rows) == len(request_ids) or time.monotonic() > deadline:
                return {r["request_id"]: (r["queue_ms"], r["ttft_ms"]) for r in rows}
            await asyncio.sleep(0.5)
    finally:
        await connection.close()


def breakdown(url: str, bursts: list[LoadResult]) -> dict:
    parts: dict[str, list[float]] = {"client_side_ms": [], "gateway_to_worker_ms": [], "worker_ms": []}
    for burst in bursts:
        ids = [s.response_id for s in burst.streams]
        runs = asyncio.run(_runs(url, ids))
        if len(runs) != len(ids):
            return {"error": f"{len(ids) - len(runs)} of {len(ids)} runs not in the ledger"}
        per_stream: dict[str, list[float]] = {name: [] for name in parts}
        for stream in burst.streams:
            queue_ms, ttft_ms = runs[stream.response_id]
            per_stream["client_side_ms"].append(stream.ttft * 1000.0 - ttft_ms)
            per_stream["gateway_to_worker_ms"].append(queue_ms)
            per_stream["worker_ms"].append(ttft_ms - queue_ms)
        for name, values in per_stream.items():
            parts[name].append(statistics.median(values))
    return {f"ttft_{name}_p50": round(statistics.median(values), 1) for name, values in parts.items()}
