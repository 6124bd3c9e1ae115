"""The documented SQL, run as written against a populated ledger, with the shape and values it must return.

`QUERIES` are the six checked queries of `docs/ledger.md` and `PRUNE` its retention statement, verbatim (a
test checks they are still there as written); every ```sql block of `docs/ledger.md` and of the
README is also run as written.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from apps.bus.events import BatchCreated, BatchLine, BatchStatus, Event, FileCreated, RunPreempted, event_kind
from apps.bus.topology import event_subject
from apps.recorder.migrate import migrate
from apps.recorder.projector import project
from engine.frontend.protocol import PreemptionReason, ServiceClass
from tests.recorder.conftest import admission, bench_run, finished, node_status, response_stored, score, started
from tests.support import REPO

LATENCY = """
-- p50 / p95 time to first token and end-to-end latency per model per hour, last 24 hours
SELECT model, hour, runs, ttft_p50_ms, ttft_p95_ms, e2e_p50_ms, e2e_p95_ms
FROM run_latency_hourly
WHERE hour > now() - interval '1 day'
ORDER BY hour DESC, model;
"""

THROUGHPUT = """
-- prefill and decode speed per model per hour, last 24 hours
SELECT model, hour, runs, completion_tokens,
       round(prefill_tok_per_s) AS prefill_tok_s, round(decode_tok_per_s) AS decode_tok_s
FROM run_throughput_hourly
WHERE hour > now() - interval '1 day'
ORDER BY model, hour DESC;
"""

REJECTIONS = """
-- who got turned away, and why: each principal's decisions by reason over the last day
SELECT coalesce(principal, '(anonymous)') AS principal, decision, count(*) AS decisions,
       round(100.0 * count(*) / sum(count(*)) OVER (PARTITION BY principal), 1) AS pct_of_principal
FROM admission_events
WHERE ts > now() - interval '1 day'
GROUP BY principal, decision
ORDER BY 1, decisions DESC, decision;
"""

BENCH = """
-- the latest bench result per model and scenario (and target), one row per metric
SELECT model, scenario, target, run_id, finished_at, metric, value, unit, scorer
FROM bench_latest
ORDER BY model, scenario, target, metric;
"""

FAILURES = """
-- what went wrong in the last day, per model and node
SELECT model, node, status, finish_reason, error, count(*) AS runs
FROM runs
WHERE last_event_at > now() - interval '1 day' AND status <> 'ok'
GROUP BY model, node, status, finish_reason, error
ORDER BY runs DESC, model, node, status, error;
"""

PRUNE = """
-- retention: drop raw events and projection rows older than 90 days
SELECT * FROM helexa_prune(interval '90 days');
"""

BATCH_PROGRESS = """
-- progress of each batch: lines answered, failed and left, and how long it has run
SELECT b.batch_id, b.principal, b.status, b.total,
       count(l.line) FILTER (WHERE l.status_code = 200) AS answered,
       count(l.line) FILTER (WHERE l.status_code IS DISTINCT FROM 200) AS failed,
       b.total - count(l.line) AS left_to_run,
       to_timestamp(b.in_progress_at) AS started
FROM batches b LEFT JOIN batch_lines l USING (batch_id)
WHERE b.event_id IS NOT NULL
GROUP BY b.batch_id
ORDER BY b.batch_id DESC;
"""

QUERIES = {"latency": LATENCY, "throughput": THROUGHPUT, "rejections": REJECTIONS, "bench": BENCH, "failures": FAILURES,
           "batch progress": BATCH_PROGRESS}


def _nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(p * len(ordered)), 1) - 1]


def _ledger() -> tuple[list[Event], dict[str, list[float]]]:
    """Two models over two recent hours, admission decisions, bench runs, a node; and the TTFTs per model."""
    hour = math.floor(time.time() / 3600) * 3600 - 2 * 3600  # two whole hours ago, on the hour
    events: list[Event] = []
    ttfts: dict[str, list[float]] = {"tiny": [], "small": []}
    for i in range(40):
        model = "tiny" if i % 2 else "small"
        ts = hour + 600 + i * 30  # all within the first hour
        ttft = float(10 + (i * 37) % 100)
        events += [
            started(f"q{i}", model=model, ts=ts - 2),
            finished(f"q{i}", model=model, ts=ts, ttft_ms=ttft, e2e_ms=ttft + 100, completion_tokens=21,
                     prompt_tokens=100, cached_tokens=20, prefill_ms=40.0, decode_ms=200.0),
        ]  # fmt: skip
        ttfts[model].append(ttft)
    events.append(finished("q-late", model="tiny", ts=hour + 3600 + 60))  # the second hour
    events.append(finished("q-err", model="tiny", ts=hour + 700, status="error", finish_reason="error", error="boom"))
    decisions = [("alice", "admitted")] * 6 + [("alice", "queue_full")] * 2 + [(None, "admitted")] * 3
    for i, (principal, decision) in enumerate([*decisions, ("bob", "principal_cap")]):
        events.append(admission(f"a{i}", principal=principal, decision=decision, ts=hour + 900 + i))
    events += [
        bench_run("old", scenario="chat:128", finished_at=hour + 100, ts=hour + 100),
        bench_run("new", scenario="chat:128", finished_at=hour + 200, ts=hour + 200),
        score("old", "ttft_p50_ms", 30.0, ts=hour + 101),
        score("new", "ttft_p50_ms", 25.0, ts=hour + 201),
        score("new", "quality", 6.0, unit=None, scorer="alice", ts=hour + 202),
        score("new", "quality", 8.0, unit=None, scorer="alice", ts=hour + 203),  # a re-score replaces it
        bench_run("unscored", scenario="swap", finished_at=hour + 300, ts=hour + 300),
        node_status("node-a", ts=hour + 5),
    ]
    return events, ttfts


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    await migrate(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SET TIME ZONE 'UTC'")
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def ledger(conn: asyncpg.Connection) -> dict[str, list[float]]:
    """The populated ledger; its value is the TTFTs recorded per model."""
    events, ttfts = _ledger()
    await project(conn, [(event_subject(event_kind(e), e.model), e) for e in events])
    return ttfts


async def test_latency_percentiles_per_model_per_hour(conn: asyncpg.Connection, ledger: dict) -> None:
    rows = await conn.fetch(LATENCY)
    assert list(rows[0].keys()) == ["model", "hour", "runs", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "e2e_p95_ms"]
    assert [(r["model"], r["runs"]) for r in rows] == [("tiny", 1), ("small", 20), ("tiny", 20)]
    for row in rows[1:]:
        values = ledger[row["model"]]
        assert row["ttft_p50_ms"] == _nearest_rank(values, 0.5)
        assert row["ttft_p95_ms"] == _nearest_rank(values, 0.95)
        assert row["e2e_p95_ms"] == _nearest_rank(values, 0.95) + 100


async def test_throughput_per_model_per_hour(conn: asyncpg.Connection, ledger: dict) -> None:
    rows = await conn.fetch(THROUGHPUT)
    assert [(r["model"], r["runs"], r["completion_tokens"]) for r in rows] == [
        ("small", 20, 420), ("tiny", 1, 7), ("tiny", 20, 420),
    ]  # fmt: skip
    # 80 uncached prompt tokens in 40 ms; 20 tokens after the first in 200 ms.
    assert (rows[0]["prefill_tok_s"], rows[0]["decode_tok_s"]) == (2000.0, 100.0)


async def test_rejections_per_principal_and_reason(conn: asyncpg.Connection, ledger: dict) -> None:
    rows = [(*r.values(),) for r in await conn.fetch(REJECTIONS)]
    assert [(p, d, n, float(pct)) for p, d, n, pct in rows] == [
        ("(anonymous)", "admitted", 3, 100.0),
        ("alice", "admitted", 6, 75.0),
        ("alice", "queue_full", 2, 25.0),
        ("bob", "principal_cap", 1, 100.0),
    ]


async def test_latest_bench_result_per_model_and_scenario(conn: asyncpg.Connection, ledger: dict) -> None:
    rows = [(r["scenario"], r["run_id"], r["metric"], r["value"], r["scorer"]) for r in await conn.fetch(BENCH)]
    assert rows == [
        ("chat:128", "new", "quality", 8.0, "alice"),
        ("chat:128", "new", "ttft_p50_ms", 25.0, "helexa-bench"),
        ("swap", "unscored", None, None, None),
    ]


async def test_failures_per_model_and_node(conn: asyncpg.Connection, ledger: dict) -> None:
    rows = [tuple(r) for r in await conn.fetch(FAILURES)]
    assert rows == [("tiny", "node-a", "error", "error", "boom", 1)]


async def test_prune_keeps_recent_rows_and_drops_old_ones(conn: asyncpg.Connection, ledger: dict) -> None:
    ancient = time.time() - 100 * 86400
    old = [started("ancient", ts=ancient), admission("ancient", ts=ancient),
           RunPreempted(model="tiny", node="node-a", ts=ancient, request_id="ancient",
                        reason=PreemptionReason.INTERACTIVE_WAITING, service_class=ServiceClass.BATCH, tokens_kept=3),
           response_stored("resp_ancient", ts=ancient), response_stored("resp_recent", ts=time.time()),
           # A file is kept until deleted, whatever its age: its row and the event it is rebuilt from.
           FileCreated(model="-", node="gateway", ts=ancient, file_id="file-ancient", principal="alice",
                       filename="a.jsonl", purpose="batch", bytes=1, created_at=int(ancient)),
           # A batch that ended long ago goes with its lines and events; one still running keeps its events.
           *[BatchCreated(model="-", node="gateway", ts=ancient, batch_id=batch_id, principal="alice",
                          input_file_id="file-ancient", endpoint="/v1/chat/completions", completion_window="24h",
                          created_at=int(ancient), expires_at=int(ancient) + 86400)
             for batch_id in ("batch_ended", "batch_running")],
           BatchStatus(model="-", node="gateway", ts=ancient, batch_id="batch_ended", status="completed",
                       at=int(ancient)),
           BatchLine(model="-", node="gateway", ts=ancient, batch_id="batch_ended", line=1, custom_id="c1",
                     status_code=200)]
    await project(conn, [(event_subject(event_kind(e), e.model), e) for e in old])
    counts = {r["table_name"]: r["deleted"] for r in await conn.fetch(PRUNE)}
    assert counts == {"events": 7, "runs": 1, "run_attempts": 1, "admission_events": 1, "nodes": 0, "bench_runs": 0,
                      "scores": 0, "responses": 1, "preemptions": 1, "batch_lines": 1, "batches": 1}
    assert await conn.fetchval("SELECT array_agg(batch_id) FROM batches") == ["batch_running"]
    assert await conn.fetchval("SELECT count(*) FROM events WHERE kind LIKE 'batch.%'") == 1
    assert await conn.fetchval("SELECT count(*) FROM runs") == 42
    assert await conn.fetchval("SELECT array_agg(response_id) FROM responses") == ["resp_recent"]
    assert await conn.fetchval("SELECT count(*) FROM events WHERE kind = 'file.created'") == 1
    assert await conn.fetchval("SELECT array_agg(file_id) FROM files") == ["file-ancient"]


async def test_batch_progress(conn: asyncpg.Connection) -> None:
    gateway = {"model": "-", "node": "gateway"}
    events: list[Event] = [
        BatchCreated(**gateway, batch_id="batch_a", principal="alice", input_file_id="file-a",
                     endpoint="/v1/chat/completions", completion_window="24h", created_at=1000, expires_at=87400),
        BatchStatus(**gateway, batch_id="batch_a", status="in_progress", at=1010, total=4),
        *[BatchLine(**gateway, event_id=f"batch_a.{n}", batch_id="batch_a", line=n, custom_id=f"c{n}",
                    status_code=code) for n, code in ((1, 200), (2, 200), (3, 400))],
        # Line 2 answered again (a runner that took the batch over): still one row.
        BatchLine(**gateway, event_id="batch_a.2.again", batch_id="batch_a", line=2, custom_id="c2", status_code=200),
    ]
    await project(conn, [(event_subject(event_kind(e), e.model), e) for e in events])
    rows = [tuple(r)[:7] for r in await conn.fetch(BATCH_PROGRESS)]
    assert rows == [("batch_a", "alice", "in_progress", 4, 2, 1, 1)]


LEDGER_DOC = REPO / "docs" / "ledger.md"
# Where SQL is shown to users: every ```sql block of these files is run.
SQL_DOCS = (LEDGER_DOC, REPO / "README.md")


def _statements(path: Path) -> list[str]:
    blocks = re.findall(r"```sql\n(.*?)```", path.read_text(), re.S)
    return [s.strip() for block in blocks for s in block.split(";") if re.sub(r"--[^\n]*", "", s).strip()]


def test_the_checked_queries_are_the_documented_ones() -> None:
    text = LEDGER_DOC.read_text()
    for name, sql in {**QUERIES, "prune": PRUNE}.items():
        assert sql.strip() in text, f"the {name} query is no longer in {LEDGER_DOC.name} as written"


@pytest.mark.parametrize("path", SQL_DOCS, ids=lambda p: p.name)
async def test_every_documented_statement_runs_as_written(conn: asyncpg.Connection, ledger: dict,
                                                          path: Path) -> None:
    statements = _statements(path)
    assert statements, f"{path.name} shows no SQL"
    for statement in statements:
        await conn.fetch(statement)
