"""A mixed, realistic set of events for the recorder tests, with the rows they must become.

The expected rows are worked out here in plain Python from the projection rules, independently
of the SQL that produces them, so a test can compare whole tables.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from apps.bus.events import (
    AdmissionDecided,
    BenchRunRecorded,
    Event,
    FileCreated,
    FileDeleted,
    NodeStatusChanged,
    ResponseDeleted,
    ResponseStored,
    ScoreRecorded,
)
from tests.recorder.conftest import (
    admission,
    bench_run,
    finished,
    node_status,
    response_deleted,
    response_stored,
    score,
    started,
)

BASE_TS = 1_700_000_000.0
DECISIONS = ("admitted", "queue_full", "principal_cap", "timeout", "context_exceeded", "cancelled")
PRINCIPALS = ("alice", "bob", None)


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def expected_rows(events: list[Event]) -> dict[str, dict[str, tuple]]:
    """The rows of the append-only projections and `bench_runs`, by primary key, from distinct events
    (jsonb columns as Python values)."""
    rows: dict[str, dict[str, tuple]] = {"admission_events": {}, "nodes": {}, "bench_runs": {}, "scores": {},
                                         "responses": {}, "files": {}}
    stored: dict[str, ResponseStored] = {}
    deleted: dict[str, ResponseDeleted] = {}
    for e in events:
        # responses: the latest stored event and the earliest deletion of each id, by (ts, event_id).
        if isinstance(e, ResponseStored):
            held = stored.get(e.response_id)
            if held is None or (e.ts, e.event_id) > (held.ts, held.event_id):
                stored[e.response_id] = e
        elif isinstance(e, ResponseDeleted):
            held = deleted.get(e.response_id)
            if held is None or (e.ts, e.event_id) < (held.ts, held.event_id):
                deleted[e.response_id] = e
    for response_id in stored.keys() | deleted.keys():
        s, d = stored.get(response_id), deleted.get(response_id)
        kept = (s.event_id, at(s.ts), s.model, s.principal, s.previous_response_id, s.response.get("status"),
                s.input_items, s.response) if s else (None,) * 8
        if d is not None:
            kept = (*kept[:5], None, None, None)  # a deleted response's content is erased
        rows["responses"][response_id] = (response_id, *kept, at(d.ts) if d else None, d.event_id if d else None)
    # files: the first created event and the earliest deletion of each id, by (ts, event_id).
    created: dict[str, FileCreated] = {}
    removed: dict[str, FileDeleted] = {}
    for e in events:
        if isinstance(e, FileCreated):
            if e.file_id not in created or (e.ts, e.event_id) < (created[e.file_id].ts, created[e.file_id].event_id):
                created[e.file_id] = e
        elif isinstance(e, FileDeleted):
            if e.file_id not in removed or (e.ts, e.event_id) < (removed[e.file_id].ts, removed[e.file_id].event_id):
                removed[e.file_id] = e
    for file_id in created.keys() | removed.keys():
        c, r = created.get(file_id), removed.get(file_id)
        file = (c.event_id, at(c.ts), c.principal, c.filename, c.purpose, c.bytes, c.created_at) if c else (None,) * 7
        rows["files"][file_id] = (file_id, *file, at(r.ts) if r else None, r.event_id if r else None)
    for e in events:
        if isinstance(e, AdmissionDecided):
            rows["admission_events"][e.event_id] = (
                e.event_id, at(e.ts), e.model, e.node, e.request_id, e.principal, str(e.decision), e.detail,
                e.pending, e.in_flight, e.retry_after_s, e.waited_ms,
            )  # fmt: skip
        elif isinstance(e, NodeStatusChanged):
            rows["nodes"][e.event_id] = (
                e.event_id, at(e.ts), e.node, e.model, e.status, e.version, e.models, e.slots, e.free_slots, e.kv_usage,
            )  # fmt: skip
        elif isinstance(e, BenchRunRecorded):
            rows["bench_runs"][e.run_id] = (
                e.run_id, e.event_id, at(e.ts), e.model, e.node, e.target, e.scenario, e.config, e.results,
                at(e.started_at), at(e.finished_at),
            )  # fmt: skip
        elif isinstance(e, ScoreRecorded):
            rows["scores"][e.event_id] = (
                e.event_id, at(e.ts), e.run_id, e.model, e.node, e.scenario, e.metric, e.value, e.unit, e.scorer,
            )  # fmt: skip
    return rows


@dataclass(slots=True)
class Workload:
    events: list[Event] = field(default_factory=list)
    # request_id → the `runs` row it must end up as (columns named as in the table).
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (request_id, attempt) → the `run_attempts` row.
    attempts: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def with_duplicates(self, n: int, rng: random.Random) -> list[Event]:
        """Every event once plus `n` of them again (same event_id, separate messages), shuffled."""
        sent = self.events + rng.sample(self.events, n)
        rng.shuffle(sent)
        return sent


def _outcome(finish: Any, first_start_ts: float | None, last_ts: float) -> dict:
    return dict(
        request_id=finish.request_id, model=finish.model, node=finish.node, principal=finish.principal,
        api=finish.api, status=finish.status, finish_reason=finish.finish_reason, prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens, cached_tokens=finish.cached_tokens,
        reasoning_tokens=finish.reasoning_tokens, queue_ms=finish.queue_ms, ttft_ms=finish.ttft_ms,
        prefill_ms=finish.prefill_ms, decode_ms=finish.decode_ms, e2e_ms=finish.e2e_ms, attempt=finish.attempt,
        error=finish.error, started_at=at(first_start_ts) if first_start_ts is not None else None,
        finished_at=at(finish.ts), last_event_at=at(last_ts), decided_by=finish.event_id,
        tensor_parallel=finish.tensor_parallel,
    )  # fmt: skip


def _run_row(request_id: str, finish: Any, first_start_ts: float | None, last_ts: float) -> dict:
    assert finish.request_id == request_id
    return {**_outcome(finish, first_start_ts, last_ts), "served_attempt": finish.attempt if finish.served else None}


def _attempt_row(finish: Any, start_ts: float | None) -> dict:
    return {**_outcome(finish, start_ts, finish.ts), "served": finish.served}


def _running_row(start: Any) -> dict:
    return dict(
        request_id=start.request_id, model=start.model, node=start.node, principal=start.principal, api=start.api,
        status="running", finish_reason=None, prompt_tokens=start.prompt_tokens, completion_tokens=None,
        cached_tokens=None, reasoning_tokens=None, queue_ms=start.queue_ms, ttft_ms=None, prefill_ms=None,
        decode_ms=None, e2e_ms=None, attempt=start.attempt, error=None, started_at=at(start.ts), finished_at=None,
        last_event_at=at(start.ts), decided_by=start.event_id, tensor_parallel=start.tensor_parallel,
    )  # fmt: skip


def mixed(num_requests: int = 1500, seed: int = 7, base_ts: float = BASE_TS) -> Workload:
    """Runs (plain, retried, still running, rejected), admission decisions, node changes, bench results
    and stored responses.

    With the defaults: 4,500 distinct events.
    """
    rng = random.Random(seed)
    w = Workload()
    ts = base_ts
    n_plain, n_retried, n_running = num_requests * 2 // 3, num_requests * 2 // 15, num_requests * 2 // 15
    # The rest (num_requests - n_plain - n_retried - n_running) are rejected: the last branch below.
    for i in range(num_requests):
        rid = f"req-{seed}-{i:05d}"
        model = ("tiny", "small")[i % 2]
        principal = PRINCIPALS[i % 3]
        tokens = rng.randint(1, 300)
        ts += 0.25
        common = dict(model=model, principal=principal)
        if i < n_plain:
            s = started(rid, ts=ts, node="node-a", prompt_tokens=tokens, **common)
            f = finished(
                rid, ts=ts + 1.5, node="node-a", prompt_tokens=tokens, completion_tokens=rng.randint(1, 500),
                ttft_ms=float(rng.randint(5, 900)), e2e_ms=float(rng.randint(900, 9000)), reasoning_tokens=i % 5,
                **common,
            )  # fmt: skip
            w.events += [s, f]
            w.runs[rid] = _run_row(rid, f, s.ts, f.ts)
            w.attempts[rid, 1] = _attempt_row(f, s.ts)
        elif i < n_plain + n_retried and i % 2:
            # Redelivered after its first worker was lost: the second attempt serves.
            s1 = started(rid, ts=ts, node="node-a", **common)
            f1 = finished(
                rid, ts=ts + 0.5, node="node-a", status="error", finish_reason="error", error="lost", **common
            )
            s2 = started(rid, ts=ts + 0.75, node="node-b", attempt=2, **common)
            f2 = finished(rid, ts=ts + 2.0, node="node-b", attempt=2, completion_tokens=tokens, **common)
            w.events += [s1, f1, s2, f2]
            w.runs[rid] = _run_row(rid, f2, s1.ts, f2.ts)
            w.attempts[rid, 1], w.attempts[rid, 2] = _attempt_row(f1, s1.ts), _attempt_row(f2, s2.ts)
        elif i < n_plain + n_retried:
            # The first worker went silent, a second attempt started, and the first one served the
            # client after all; the redundant second attempt finishes last and is not the run's truth.
            s1 = started(rid, ts=ts, node="node-a", **common)
            s2 = started(rid, ts=ts + 0.5, node="node-b", attempt=2, **common)
            f1 = finished(rid, ts=ts + 1.0, node="node-a", completion_tokens=tokens, served=True, **common)
            f2 = finished(rid, ts=ts + 1.5, node="node-b", attempt=2, status="cancelled", finish_reason="abort",
                          completion_tokens=0, served=False, **common)  # fmt: skip
            w.events += [s1, s2, f1, f2]
            w.runs[rid] = _run_row(rid, f1, s1.ts, f2.ts)
            w.attempts[rid, 1], w.attempts[rid, 2] = _attempt_row(f1, s1.ts), _attempt_row(f2, s2.ts)
        elif i < n_plain + n_retried + n_running:
            s = started(rid, ts=ts, node="node-c", prompt_tokens=tokens, queue_ms=1.25, **common)
            w.events.append(s)
            w.runs[rid] = {**_running_row(s), "served_attempt": None}
            w.attempts[rid, 1] = {**_running_row(s), "served": None}
        else:
            f = finished(
                rid, ts=ts, node="node-a", status="rejected", finish_reason="error", error="context_length_exceeded",
                completion_tokens=0, ttft_ms=None, **common,
            )  # fmt: skip
            w.events.append(f)
            w.runs[rid] = _run_row(rid, f, None, f.ts)
            w.attempts[rid, 1] = _attempt_row(f, None)
    n_admission = num_requests * 2 // 3
    for i in range(n_admission):
        decision = DECISIONS[i % len(DECISIONS)] if i % 2 else "admitted"
        retry = float(2 * (i % 7 + 1)) if decision in ("queue_full", "principal_cap", "timeout") else None
        w.events.append(
            admission(
                f"adm-{seed}-{i:05d}", ts=base_ts + i * 0.5, model=("tiny", "small")[i % 2],
                principal=PRINCIPALS[i % 3], decision=decision, pending=i % 40, in_flight=i % 16,
                retry_after_s=retry, waited_ms=float(i % 100), detail=None if decision == "admitted" else "full",
            )  # fmt: skip
        )
    # Stored responses (below) take the place of some node events, so the defaults stay at 4,500 events.
    n_responses = max(num_requests // 20, 6)
    n_response_events = n_responses + 2 * len(range(0, n_responses, 5)) + 1
    n_files = max(num_requests // 50, 4)
    n_file_events = n_files + len(range(0, n_files, 3)) + 1
    n_nodes = num_requests // 7 - 14 - n_response_events - n_file_events
    for i in range(n_nodes):
        w.events.append(
            node_status(f"node-{'abc'[i % 3]}", ts=base_ts + i, free_slots=i % 17, kv_usage=(i % 8) / 8,
                        status=("ready", "degraded", "stopping")[i % 3])
        )  # fmt: skip
    n_bench = num_requests // 30
    scenarios = ("chat:128", "chat:2048", "concurrency:8", "capability:haiku", "swap")
    n_scores = 0
    for i in range(n_bench):
        run_id = f"bench-{seed}-{i:03d}"
        scenario, model = scenarios[i % len(scenarios)], ("tiny", "small")[i % 2]
        w.events.append(
            bench_run(run_id, ts=base_ts + 10 * i, model=model, scenario=scenario,
                      started_at=base_ts + 10 * i - 8.5, finished_at=base_ts + 10 * i - 0.25,
                      results={"samples": i, "ttft_ms": [1.5 * i, 2.5 * i]}, config={"samples": 3, "seed": i})
        )  # fmt: skip
        for metric, value, unit in (("ttft_p50_ms", 10.0 + i, "ms"), ("decode_tok_s", 100.0 - i, "tok/s"),
                                    ("quality", float(i % 10), None)):  # fmt: skip
            w.events.append(score(run_id, metric, value, ts=base_ts + 10 * i + 1, model=model, scenario=scenario,
                                  unit=unit, scorer="manual" if metric == "quality" else "helexa-bench"))  # fmt: skip
            n_scores += 1
    # Stored responses, some following another; some deleted (twice, the second deletion sent
    # first), one of them by a deletion older than its stored event, and one known only by its deletion.
    for i in range(n_responses):
        response_id = f"resp_{seed}_{i:04d}"
        ts = base_ts + 3 * i
        w.events.append(response_stored(
            response_id, ts=ts, model=("tiny", "small")[i % 2], principal=PRINCIPALS[i % 3],
            previous_response_id=f"resp_{seed}_{i - 1:04d}" if i % 4 else None,
        ))  # fmt: skip
        if i % 5 == 0:
            first = ts - 1.0 if i == 0 else ts + 1.0
            w.events += [response_deleted(response_id, ts=first + 0.5), response_deleted(response_id, ts=first)]
    w.events.append(response_deleted(f"resp_{seed}_gone", ts=base_ts))
    # Uploaded files; every third deleted (the first by a deletion older than its creation), and one
    # known only by its deletion.
    for i in range(n_files):
        file_id, ts = f"file-{seed}-{i:04d}", base_ts + 2 * i
        w.events.append(FileCreated(model="-", node="gateway", ts=ts, file_id=file_id,
                                         principal=PRINCIPALS[i % 3], filename=f"f{i}.jsonl",
                                         purpose=("batch", "user_data")[i % 2], bytes=100 * i, created_at=int(ts)))
        if i % 3 == 0:
            w.events.append(FileDeleted(model="-", node="gateway", ts=ts + (-1.0 if i == 0 else 1.0),
                                             file_id=file_id, principal=PRINCIPALS[i % 3]))
    w.events.append(FileDeleted(model="-", node="gateway", ts=base_ts, file_id=f"file-{seed}-gone",
                                     principal=None))
    w.counts = dict(
        events=len(w.events), runs=num_requests, run_attempts=len(w.attempts), admission_events=n_admission,
        nodes=n_nodes, bench_runs=n_bench, scores=n_scores, responses=n_responses + 1,
        files=n_files + 1,
        preemptions=0, batches=0, batch_lines=0,
    )  # fmt: skip
    return w


async def table_rows(conn: Any, table: str) -> dict[str, tuple]:
    """A table's rows by primary key (its first column), jsonb columns decoded (without
    `responses.stored_bytes`, PostgreSQL's own measure of its jsonb text)."""
    rows = {}
    for record in await conn.fetch(f"SELECT * FROM {table}"):
        values = tuple(json.loads(v) if k in ("config", "results", "input_items", "response") and v is not None
                       else v for k, v in record.items() if k != "stored_bytes")
        rows[values[0]] = values
    return rows


async def assert_projections(url: str, workload: Workload) -> None:
    """Every projection holds exactly the rows the workload's distinct events must give."""
    conn = await asyncpg.connect(url)
    try:
        for table, count in workload.counts.items():
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == count, table
        runs = {r["request_id"]: dict(r) for r in await conn.fetch("SELECT * FROM runs")}
        assert runs == workload.runs
        attempts = {(r["request_id"], r["attempt"]): dict(r) for r in await conn.fetch("SELECT * FROM run_attempts")}
        assert attempts == workload.attempts
        for table, expected in expected_rows(workload.events).items():
            assert await table_rows(conn, table) == expected, table
    finally:
        await conn.close()
