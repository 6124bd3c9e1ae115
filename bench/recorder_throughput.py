"""Recorder throughput: events/s from the first publish to the last committed row, by batch size.

Starts its own NATS server (JetStream) and PostgreSQL from their wheels, then for each batch size
(HELEXA_RECORDER_BATCH = 1, 100, 1000 by default) and each run: a fresh database (migrated
beforehand), an empty EVENTS stream and a new durable consumer, one `helexa recorder` child
process, and a fixed, seeded workload published as fast as core NATS takes it: per request an
admission decision, a run.started and a run.finished (3 events), the order one request produces.

Reported per batch size: the median over --runs of events/s, from the first publish until
`events` holds every event, with each run's figures. The clock stops on committed rows; the
recorder acks right after its commit.

Correctness gate: after each run every event must have been acked, and `events`, `runs` and
`admission_events` must hold exactly the expected rows with every run finished. A batch size with a
run that fails the gate gets no rate printed, and the script exits non-zero.

    python bench/recorder_throughput.py --runs 3 --out bench/results/recorder_throughput-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, connect, ensure_topology, event_subject  # noqa: E402
from apps.bus.wire import AdmissionDecided, Event, RunFinished, RunStarted, encode, event_kind  # noqa: E402
from apps.embedded.nats_server import NatsServer, nats_server_binary  # noqa: E402
from apps.embedded.postgres import PostgresServer  # noqa: E402
from apps.recorder.migrate import migrate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.02
EVENTS_PER_REQUEST = 3


def workload(num_requests: int, base_ts: float = 1_700_000_000.0) -> list[Event]:
    events: list[Event] = []
    for i in range(num_requests):
        rid, ts, model, principal = f"req-{i:07d}", base_ts + i * 0.001, f"model-{i % 4}", f"key-{i % 50}"
        events += [
            AdmissionDecided(
                ts=ts, model=model, node="gateway", request_id=rid, principal=principal, decision="admitted",
                pending=i % 64, in_flight=i % 16, waited_ms=float(i % 40),
            ),
            RunStarted(
                ts=ts + 0.0005, model=model, node="node-a", request_id=rid, api="chat.completions",
                principal=principal, prompt_tokens=100 + i % 900, attempt=1, queue_ms=1.5,
            ),
            RunFinished(
                ts=ts + 0.9, model=model, node="node-a", request_id=rid, api="chat.completions",
                principal=principal, status="ok", finish_reason="stop", prompt_tokens=100 + i % 900,
                completion_tokens=1 + i % 400, cached_tokens=i % 64, attempt=1, queue_ms=1.5,
                ttft_ms=20.0 + i % 300, prefill_ms=15.0, decode_ms=400.0, e2e_ms=900.0,
            ),
        ]  # fmt: skip
    return events


class Recorder:
    """`helexa recorder` as a child process, ready once it logged `ready`."""

    def __init__(self, nats_url: str, database_url: str, batch_size: int) -> None:
        env = {
            **os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url,
            "HELEXA_RECORDER_BATCH": str(batch_size), "HELEXA_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        }  # fmt: skip
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", "--log-level", "INFO", "recorder"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if '"event": "ready"' in line:
                # Keep reading so a chatty recorder never blocks on a full pipe.
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"recorder did not become ready (exit code {self.process.poll()})")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _fresh_database(admin_url: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    await migrate(url)
    return url


async def _wait(condition, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def one_run(nats_url: str, admin_url: str, batch_size: int, events: list[Event], num_requests: int) -> dict:
    nc = await connect(nats_url, "bench-recorder")
    js = nc.jetstream()
    await ensure_topology(js)
    await js.purge_stream(EVENTS_STREAM)
    try:
        await js.delete_consumer(EVENTS_STREAM, RECORDER_CONSUMER)
    except Exception:  # noqa: BLE001 - absent on the first run
        pass
    url = await _fresh_database(admin_url)
    payloads = [(event_subject(event_kind(e), e.model), encode(e)) for e in events]
    recorder = Recorder(nats_url, url, batch_size)
    conn = await asyncpg.connect(url)
    try:
        await asyncio.to_thread(recorder.wait_ready)
        started = time.perf_counter()
        for i, (subject, data) in enumerate(payloads):
            await nc.publish(subject, data)
            if i % 1000 == 999:
                await nc.flush()
        await nc.flush()
        published_s = time.perf_counter() - started

        async def all_committed() -> bool:
            return await conn.fetchval("SELECT count(*) FROM events") >= len(events)

        await _wait(all_committed, 600, "every event committed")
        elapsed_s = time.perf_counter() - started

        async def all_acked() -> bool:
            info = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await _wait(all_acked, 120, "every event acked")
        counts = {
            "stream": (await js.stream_info(EVENTS_STREAM)).state.messages,
            "events": await conn.fetchval("SELECT count(*) FROM events"),
            "runs_finished": await conn.fetchval(
                "SELECT count(*) FROM runs WHERE status = 'ok' AND started_at IS NOT NULL"
            ),
            "runs": await conn.fetchval("SELECT count(*) FROM runs"),
            "admission_events": await conn.fetchval("SELECT count(*) FROM admission_events"),
        }  # fmt: skip
    finally:
        await conn.close()
        recorder.stop()
        await nc.close()
    expected = {
        "stream": len(events), "events": len(events), "runs_finished": num_requests,
        "runs": num_requests, "admission_events": num_requests,
    }  # fmt: skip
    return {
        "correct": counts == expected,
        "counts": counts,
        "expected": expected,
        "elapsed_s": round(elapsed_s, 3),
        "publish_s": round(published_s, 3),
        "events_per_s": round(len(events) / elapsed_s, 1),
    }


async def _server_facts(admin_url: str) -> dict:
    conn = await asyncpg.connect(admin_url)
    try:
        return {
            "postgres": await conn.fetchval("SHOW server_version"),
            "fsync": await conn.fetchval("SHOW fsync"),
            "synchronous_commit": await conn.fetchval("SHOW synchronous_commit"),
        }
    finally:
        await conn.close()


async def main_async(args: argparse.Namespace) -> int:
    loadavg = os.getloadavg()
    data = Path(tempfile.mkdtemp(prefix="helexa-bench-recorder-"))
    results: dict[str, dict] = {}
    failed = False
    try:
        with NatsServer(data / "nats") as nats, PostgresServer(data / "pg") as pg:
            facts = await _server_facts(pg.url)
            for batch_size, num_requests in zip(args.batch_sizes, args.requests, strict=True):
                events = workload(num_requests)
                runs = []
                for _ in range(args.runs):
                    run = await one_run(nats.url, pg.url, batch_size, events, num_requests)
                    runs.append(run)
                    print(json.dumps({"batch_size": batch_size, **run}), file=sys.stderr, flush=True)
                entry: dict = {"events": len(events), "requests": num_requests, "runs": runs}
                if all(r["correct"] for r in runs):
                    entry["events_per_s_median"] = statistics.median(r["events_per_s"] for r in runs)
                else:
                    entry["refused"] = "a run's row counts were wrong: no rate reported"
                    failed = True
                results[str(batch_size)] = entry
    finally:
        shutil.rmtree(data, ignore_errors=True)
    nats_version = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "recorder_throughput",
        "metric": "events/s from first publish to every event committed in `events` (median of runs)",
        "inputs": {
            "batch_sizes": args.batch_sizes, "requests": args.requests, "events_per_request": EVENTS_PER_REQUEST,
            "runs": args.runs, "publisher": "core NATS publish into the EVENTS stream, flush every 1000",
            "recorder": "one `helexa recorder` child process", **facts,
            "nats_server": nats_version,
        },  # fmt: skip
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_at_start": loadavg,
        },  # fmt: skip
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--requests", type=int, nargs="+", default=[1000, 10_000, 20_000],
                        help="requests (3 events each) per run, one figure per batch size")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    sys.exit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
