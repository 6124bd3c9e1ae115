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

Consumer lag under load (`--lag-seconds`, default 30; 0 skips it): a recorder, a gateway and a
scripted worker (real frames and events, no model cost) with `--lag-clients` (64) streaming chat
clients sending requests back to back. Every 0.5 s the recorder consumer's lag (events not yet
delivered + delivered but unacked) is sampled; reported are its maximum, the medians of the first
and last thirds, the least-squares growth per second and a verdict: "no growth" when the lag grew
by less than one batch over the whole load. Gate: every client request succeeded, and `events` and
the successful `runs` match the stream and the clients exactly once the load stops.

    python -m benchmarks.recorder_throughput --runs 3 --out benchmarks/results/recorder_throughput-cpu.json
    python -m benchmarks.recorder_throughput --lag-only --lag-seconds 60    # just the lag
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
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx

from apps.bus.connection import connect
from apps.bus.declaration import ensure_topology
from apps.bus.events import AdmissionDecided, Event, RunFinished, RunStarted, event_kind
from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, BusLimits, event_subject
from apps.bus.wire import encode
from apps.embedded.nats_server import NatsServer, nats_server_binary
from apps.embedded.postgres import PostgresServer
from apps.recorder.migrate import migrate
from benchmarks.lib import emit

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


class App:
    """A `helexa <app>` child process, ready once it logged `ready`."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        env = {**os.environ, "HELEXA_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", **env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", "--log-level", "INFO", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if '"event": "ready"' in line:
                # Keep reading so a chatty app never blocks on a full pipe.
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"{self.process.args} did not become ready (exit code {self.process.poll()})")

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the child has used so far; None where /proc is missing."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_recorder(nats_url: str, database_url: str, batch_size: int) -> App:
    return App(["recorder"], {"NATS_URL": nats_url, "DATABASE_URL": database_url,
                              "HELEXA_RECORDER_BATCH": str(batch_size)})


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


async def _wait(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def _fresh_start(nats_url: str, admin_url: str, client_name: str) -> tuple:
    """An empty EVENTS stream with no recorder consumer, and a freshly migrated database:
    (NATS connection, JetStream context, database URL)."""
    nc = await connect(nats_url, client_name)
    js = nc.jetstream()
    await ensure_topology(js, BusLimits())
    await js.purge_stream(EVENTS_STREAM)
    try:
        await js.delete_consumer(EVENTS_STREAM, RECORDER_CONSUMER)
    except Exception:  # absent on the first run
        pass
    return nc, js, await _fresh_database(admin_url)


async def one_run(nats_url: str, admin_url: str, batch_size: int, events: list[Event], num_requests: int) -> dict:
    nc, js, url = await _fresh_start(nats_url, admin_url, "bench-recorder")
    payloads = [(event_subject(event_kind(e), e.model), encode(e)) for e in events]
    recorder = start_recorder(nats_url, url, batch_size)
    conn = await asyncpg.connect(url)
    try:
        await asyncio.to_thread(recorder.wait_ready)
        cpu_before = recorder.cpu_s()
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
        cpu_after = recorder.cpu_s()

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
        # Less sensitive to a busy machine than the wall clock: what the recorder process itself spent.
        "recorder_cpu_us_per_event": (
            round((cpu_after - cpu_before) * 1e6 / len(events), 1) if cpu_before is not None and cpu_after else None
        ),
    }


LAG_MODEL = "lag-probe"
# What the scripted worker streams back to every request: about 32 tokens, then EOS.
LAG_REPLY = "The recorder keeps up when its consumer lag stays flat while clients stream without pause. " * 2


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares growth of lag per second over the samples."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t if var_t else 0.0


async def lag_run(nats_url: str, admin_url: str, batch_size: int, clients: int, seconds: float,
                  folder: Path, sample_s: float = 0.5) -> dict:
    """Consumer lag of the recorder while `clients` streaming clients send requests back to back for
    `seconds` through a real gateway and a scripted worker (the events of real traffic, without a
    model's cost). Lag = events not yet delivered to the recorder + delivered but not yet acked."""
    from apps.bench.client import StreamFailed, chat_body, http_client, stream_chat
    from apps.embedded import free_port

    nc, js, url = await _fresh_start(nats_url, admin_url, "bench-recorder-lag")
    script = folder / "lag-script.json"
    script.write_text(json.dumps({"rules": [], "default": LAG_REPLY}))
    port = free_port()
    env = {"NATS_URL": nats_url, "DATABASE_URL": url}
    apps = [
        start_recorder(nats_url, url, batch_size),
        App(["worker", "--script", str(script), "--served-model-name", LAG_MODEL],
            {**env, "HELEXA_NODE_ID": "lag-worker", "HELEXA_MAX_NUM_SEQS": str(clients)}),
        App(["gateway", "--port", str(port)], env),
    ]  # fmt: skip
    samples: list[tuple[float, int]] = []
    done = failed = 0
    conn = await asyncpg.connect(url)
    try:
        for app in apps:
            await asyncio.to_thread(app.wait_ready)
        started = time.monotonic()
        stop_at = started + seconds

        async def client(http: httpx.AsyncClient, i: int) -> None:
            nonlocal done, failed
            n = 0
            while time.monotonic() < stop_at:
                try:
                    await stream_chat(http, chat_body(LAG_MODEL, f"client {i} request {n}", 64), timeout_s=120)
                    done += 1
                except StreamFailed:
                    failed += 1
                n += 1

        async def sampler() -> None:
            while time.monotonic() < stop_at:
                info = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
                samples.append((round(time.monotonic() - started, 2), info.num_pending + info.num_ack_pending))
                await asyncio.sleep(sample_s)

        async with http_client(f"http://127.0.0.1:{port}/v1", None, clients) as http:
            await asyncio.gather(sampler(), *(client(http, i) for i in range(clients)))
        load_s = time.monotonic() - started
        stream_events = (await js.stream_info(EVENTS_STREAM)).state.messages

        async def caught_up() -> bool:
            return await conn.fetchval("SELECT count(*) FROM events") >= stream_events

        await _wait(caught_up, 120, "the recorder to catch up")
        drain_s = time.monotonic() - started - load_s
        counts = {
            "events": await conn.fetchval("SELECT count(*) FROM events"),
            "runs_ok": await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'ok'"),
        }
    finally:
        await conn.close()
        for app in reversed(apps):
            app.stop()
        await nc.close()
    third = max(len(samples) // 3, 1)
    lags = [v for _, v in samples]
    growth = _slope(samples)
    first_third, last_third = statistics.median(lags[:third]), statistics.median(lags[-third:])
    return {
        "correct": counts == {"events": stream_events, "runs_ok": done} and failed == 0,
        "clients": clients,
        "requests_ok": done,
        "requests_failed": failed,
        "load_s": round(load_s, 2),
        "events": stream_events,
        "events_per_s_offered": round(stream_events / load_s, 1),
        "drain_after_load_s": round(drain_s, 3),
        "lag_max": max(lags),
        "lag_median_first_third": first_third,
        "lag_median_last_third": last_third,
        "lag_growth_per_s": round(growth, 3),
        # Growing by less than one batch over the whole load is noise, not a recorder falling behind.
        "verdict": "no growth" if growth * load_s < batch_size else "grows",
        "samples": samples,
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
                if args.lag_only:
                    break
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
            if args.lag_seconds > 0:
                lag = await lag_run(nats.url, pg.url, args.lag_batch, args.lag_clients, args.lag_seconds, data)
                print(json.dumps({k: v for k, v in lag.items() if k != "samples"}), file=sys.stderr, flush=True)
                if not lag["correct"]:
                    lag = {"refused": "events or runs did not match what the clients got: no lag reported",
                           **{k: lag[k] for k in ("requests_ok", "requests_failed", "events")}}
                    failed = True
                results["lag"] = lag
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
            "lag": {"clients": args.lag_clients, "seconds": args.lag_seconds, "batch_size": args.lag_batch,
                    "load": "streaming chat clients back to back -> gateway -> scripted worker (about 32 tokens)",
                    "lag": "recorder consumer num_pending + num_ack_pending, sampled every 0.5 s"},
        },  # fmt: skip
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_at_start": loadavg,
        },  # fmt: skip
        "results": results,
    }
    emit(report, Path(args.out) if args.out else None)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--requests", type=int, nargs="+", default=[1000, 10_000, 20_000],
                        help="requests (3 events each) per run, one figure per batch size")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--lag-seconds", type=float, default=30.0,
                        help="also measure consumer lag under streaming clients for this long (0 = skip)")
    parser.add_argument("--lag-clients", type=int, default=64)
    parser.add_argument("--lag-batch", type=int, default=256, help="HELEXA_RECORDER_BATCH for the lag run")
    parser.add_argument("--lag-only", action="store_true", help="skip the throughput runs")
    sys.exit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
