"""The projector against a real PostgreSQL: exact rows whatever the duplicates and arrival order."""

from __future__ import annotations

import json

import asyncpg
import pytest

from apps.bus.events import BatchCreated, BatchLine, BatchStatus, FileCreated, FileDeleted
from apps.bus.topology import event_subject
from apps.recorder.projections import PROJECTIONS
from apps.recorder.projector import Recorded, event_kind, project, rebuild
from tests.recorder.conftest import (
    admission,
    bench_run,
    finished,
    node_status,
    on_subjects,
    preempted,
    response_deleted,
    response_stored,
    score,
    started,
)
from tests.recorder.workload import expected_rows, table_rows


async def test_duplicates_are_recorded_once(conn: asyncpg.Connection) -> None:
    start, finish = started("r1"), finished("r1")
    assert await project(conn, on_subjects(start, start, finish)) == 2
    assert await project(conn, on_subjects(finish, start)) == 0
    assert await conn.fetchval("SELECT count(*) FROM events") == 2
    row = await conn.fetchrow("SELECT * FROM runs")
    assert (row["request_id"], row["status"], row["completion_tokens"]) == ("r1", "ok", 7)
    raw = await conn.fetchrow("SELECT kind, subject, payload FROM events WHERE event_id = $1", start.event_id)
    assert raw["kind"] == "run.started"
    assert raw["subject"] == event_subject("run.started", "tiny")
    assert '"request_id": "r1"' in raw["payload"]


@pytest.mark.parametrize("order", ["started_first", "finished_first", "same_batch"])
async def test_started_and_finished_merge_in_any_order(conn: asyncpg.Connection, order: str) -> None:
    start = started("r2", ts=1_700_000_000.0)
    finish = finished("r2", ts=1_700_000_001.0, node="node-a", status="error", finish_reason="error", error="boom")
    if order == "same_batch":
        await project(conn, on_subjects(finish, start))
    else:
        first, second = (start, finish) if order == "started_first" else (finish, start)
        await project(conn, on_subjects(first))
        await project(conn, on_subjects(second))
    row = await conn.fetchrow("SELECT * FROM runs WHERE request_id = 'r2'")
    assert row["status"] == "error" and row["finish_reason"] == "error" and row["error"] == "boom"
    assert row["started_at"].timestamp() == 1_700_000_000.0
    assert row["finished_at"].timestamp() == 1_700_000_001.0
    assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (12, 7, 4)
    assert (row["ttft_ms"], row["e2e_ms"], row["attempt"], row["principal"]) == (20.0, 63.0, 1, "alice")
    assert await conn.fetchval("SELECT count(*) FROM runs") == 1


async def test_a_run_row_says_on_how_many_ranks_it_was_served(conn: asyncpg.Connection) -> None:
    """run.started and run.finished carry the engine's tensor-parallel ranks (migration 0012); a
    finish a gateway published for a dead worker does not know them (NULL)."""
    await project(conn, on_subjects(started("tp3", tensor_parallel=3), finished("tp3", tensor_parallel=3),
                                    started("tp-unknown"), finished("tp-unknown")))
    rows = await conn.fetch("SELECT request_id, tensor_parallel FROM runs WHERE request_id LIKE 'tp%' ORDER BY 1")
    assert [tuple(r) for r in rows] == [("tp-unknown", None), ("tp3", 3)]
    attempt = await conn.fetchval("SELECT tensor_parallel FROM run_attempts WHERE request_id = 'tp3'")
    assert attempt == 3


async def test_started_alone_is_running(conn: asyncpg.Connection) -> None:
    await project(conn, on_subjects(started("r3")))
    row = await conn.fetchrow("SELECT status, finished_at, attempt FROM runs WHERE request_id = 'r3'")
    assert tuple(row) == ("running", None, 1)


async def test_a_later_attempt_supersedes_an_earlier_one(conn: asyncpg.Connection) -> None:
    first = started("r4", node="node-a", attempt=1, ts=100.0)
    retry = started("r4", node="node-b", attempt=2, ts=105.0)
    done = finished("r4", node="node-b", attempt=2, ts=110.0)
    # The retry's outcome arrives first and the first attempt's start last.
    await project(conn, on_subjects(done))
    await project(conn, on_subjects(retry))
    await project(conn, on_subjects(first))
    row = await conn.fetchrow("SELECT node, attempt, status, started_at, finished_at FROM runs")
    assert (row["node"], row["attempt"], row["status"]) == ("node-b", 2, "ok")
    assert (row["started_at"].timestamp(), row["finished_at"].timestamp()) == (100.0, 110.0)


async def test_a_retry_starting_clears_the_previous_attempts_outcome(conn: asyncpg.Connection) -> None:
    await project(conn, on_subjects(finished("r5", attempt=1, status="error", finish_reason="error", error="lost")))
    await project(conn, on_subjects(started("r5", node="node-b", attempt=2)))
    row = await conn.fetchrow("SELECT node, attempt, status, finish_reason, error, finished_at FROM runs")
    assert tuple(row) == ("node-b", 2, "running", None, None, None)


async def test_admission_node_and_bench_events_become_rows_once(conn: asyncpg.Connection) -> None:
    events = [
        admission(
            "r6", decision="queue_full", principal=None, pending=9, in_flight=4, retry_after_s=12.0, detail="full"
        ),
        node_status("node-a", models=["tiny", "small"], free_slots=3, kv_usage=0.5),
        bench_run("b1", scenario="chat:512", results={"ttft_ms": [1.5]}),
        score("b1", "ttft_p50_ms", 1.5, scenario="chat:512"),
    ]
    assert await project(conn, on_subjects(*events, *events)) == 4
    assert await project(conn, [(*pair, 7) for pair in on_subjects(*events)]) == 0
    for table, expected in expected_rows(events).items():
        assert await table_rows(conn, table) == expected, table
    row = await conn.fetchrow("SELECT decision, principal, retry_after_s FROM admission_events")
    assert tuple(row) == ("queue_full", None, 12.0)
    assert await conn.fetchval("SELECT models FROM nodes") == ["tiny", "small"]


async def test_stream_seq_is_the_first_copys(conn: asyncpg.Connection) -> None:
    event = started("r7")
    subject = event_subject(event_kind(event), event.model)
    await project(conn, [Recorded(subject, event, 5), Recorded(subject, event, 9)])
    assert await conn.fetchval("SELECT stream_seq FROM events") == 5


async def test_stream_seq_is_the_earliest_copys_whichever_batch_commits_first(conn: asyncpg.Connection) -> None:
    """Batches commit in any order (a recorder's concurrent writers, or several recorders); the later
    copy committing first is corrected by the earlier one, which still counts as nothing new."""
    start, finish = started("r8"), finished("r8")
    subject = event_subject(event_kind(start), start.model)
    assert await project(conn, [Recorded(subject, start, 9), Recorded(subject, finish, 10)]) == 2
    assert await project(conn, [Recorded(subject, start, 4)]) == 0
    assert await project(conn, [Recorded(subject, start, 12)]) == 0
    assert await conn.fetchval("SELECT stream_seq FROM events WHERE event_id = $1", start.event_id) == 4
    assert await conn.fetchval("SELECT count(*) FROM events") == 2
    row = await conn.fetchrow("SELECT status, completion_tokens FROM runs WHERE request_id = 'r8'")
    assert (row["status"], row["completion_tokens"]) == ("ok", 7)


@pytest.mark.parametrize("order", ["older_first", "newer_first", "same_batch"])
async def test_a_republished_bench_run_keeps_its_latest_copy(conn: asyncpg.Connection, order: str) -> None:
    older = bench_run("b2", ts=100.0, results={"decode_tok_s": 50.0})
    newer = bench_run("b2", ts=200.0, results={"decode_tok_s": 60.0})
    if order == "same_batch":
        await project(conn, on_subjects(newer, older))
    else:
        for event in (older, newer) if order == "older_first" else (newer, older):
            await project(conn, on_subjects(event))
    row = await conn.fetchrow("SELECT event_id, results FROM bench_runs")
    assert row["event_id"] == newer.event_id
    assert row["results"] == '{"decode_tok_s": 60.0}'


async def test_a_preemption_is_a_row_with_its_reason(conn: asyncpg.Connection) -> None:
    first, second = preempted("r9", tokens_kept=3), preempted("r9", reason="kv_cache_full", tokens_kept=8)
    assert await project(conn, on_subjects(first, second, first)) == 2
    rows = await conn.fetch("SELECT request_id, model, node, reason, service_class, tokens_kept FROM preemptions "
                            "ORDER BY tokens_kept")
    assert [tuple(r) for r in rows] == [("r9", "tiny", "node-a", "interactive_waiting", "batch", 3),
                                        ("r9", "tiny", "node-a", "kv_cache_full", "batch", 8)]


def batch_created(batch_id: str) -> BatchCreated:
    return BatchCreated(model="-", node="gateway", batch_id=batch_id, principal="alice", input_file_id="file-1",
                             endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"},
                             created_at=100, expires_at=100 + 86400)


def batch_status(batch_id: str, status: str, at: int, **fields: object) -> BatchStatus:
    return BatchStatus(model="-", node="gateway", batch_id=batch_id, status=status, at=at, **fields)


def batch_line(batch_id: str, line: int, custom_id: str, event_id: str | None = None) -> BatchLine:
    return BatchLine(event_id=event_id or f"{batch_id}.{line}", model="-", node="gateway", batch_id=batch_id,
                          line=line, custom_id=custom_id, status_code=200, request_id=f"req-{line}", body={"ok": line})


async def test_a_batch_keeps_its_furthest_status_and_one_row_per_line(conn: asyncpg.Connection) -> None:
    """Statuses in any order and any batching: the furthest in OpenAI's order wins, each status's
    first time stays; a line published twice (same event id) or answered twice (a runner that took
    the batch over: another event, same line and custom_id) is one row."""
    await project(conn, on_subjects(batch_status("batch_1", "completed", 30, output_file_id="file-out"),
                               batch_status("batch_1", "in_progress", 10, total=2)))
    await project(conn, on_subjects(batch_created("batch_1"), batch_status("batch_1", "in_progress", 12),
                               batch_status("batch_1", "finalizing", 20)))
    await project(conn, on_subjects(batch_line("batch_1", 1, "a"), batch_line("batch_1", 1, "a"),
                               batch_line("batch_1", 2, "b")))
    await project(conn, on_subjects(batch_line("batch_1", 2, "b", event_id="retaken-2"),
                               batch_line("batch_1", 3, "a", event_id="repeated-custom-id")))
    row = await conn.fetchrow("SELECT principal, status, total, output_file_id, in_progress_at, finalizing_at, "
                              "completed_at, metadata FROM batches WHERE batch_id = 'batch_1'")
    assert tuple(row) == ("alice", "completed", 2, "file-out", 10, 20, 30, '{"k": "v"}')
    lines = await conn.fetch("SELECT line, custom_id, event_id FROM batch_lines ORDER BY line")
    assert [tuple(r) for r in lines] == [(1, "a", "batch_1.1"), (2, "b", "batch_1.2")]


async def test_rebuild_recomputes_every_projection_from_events(conn: asyncpg.Connection) -> None:
    run = [finished("r8", attempt=2, ts=9.0), started("r8", ts=1.0), started("r8", attempt=2, ts=5.0)]
    await project(conn, on_subjects(*run))
    await project(conn, on_subjects(admission("r8"), node_status("node-a"), bench_run("b3"),
                                    score("b3", "quality", 7.0)))
    await project(conn, on_subjects(response_stored("resp_1"), response_deleted("resp_1"), response_stored("resp_2")))
    await project(conn, on_subjects(file_created("file-1"), file_deleted("file-1"), file_created("file-2")))
    await project(conn, on_subjects(preempted("r8")))
    await project(conn, on_subjects(batch_created("batch_2"), batch_status("batch_2", "in_progress", 5, total=1),
                                    batch_line("batch_2", 1, "x")))
    before = {t: [tuple(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1, 2")] for t in PROJECTIONS}
    await conn.execute("UPDATE runs SET status = 'bogus'; DELETE FROM nodes; DELETE FROM scores; "
                       "DELETE FROM responses; DELETE FROM files; DELETE FROM batches; DELETE FROM batch_lines")

    assert await rebuild(conn) == {"runs": 1, "run_attempts": 2, "admission_events": 1, "nodes": 1, "bench_runs": 1,
                                   "scores": 1, "responses": 2, "files": 2,
                                   "preemptions": 1, "batches": 1, "batch_lines": 1}
    after = {t: [tuple(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1, 2")] for t in PROJECTIONS}
    assert after == before
    row = await conn.fetchrow("SELECT attempt, status, started_at, finished_at, last_event_at FROM runs")
    assert (row["attempt"], row["status"]) == (2, "ok")
    assert [row[c].timestamp() for c in ("started_at", "finished_at", "last_event_at")] == [1.0, 9.0, 9.0]


@pytest.mark.parametrize("order", ["stored_first", "deleted_first", "same_batch"])
async def test_a_deleted_response_stays_deleted_whatever_the_order(conn: asyncpg.Connection, order: str) -> None:
    stored = response_stored("resp_9", ts=10.0, previous_response_id="resp_8")
    early, late = response_deleted("resp_9", ts=20.0), response_deleted("resp_9", ts=30.0)
    if order == "same_batch":
        await project(conn, on_subjects(late, stored, early))
    else:
        first = [stored] if order == "stored_first" else [late, early]
        for event in first + ([early, late] if order == "stored_first" else [stored]):
            await project(conn, on_subjects(event))
    row = await conn.fetchrow("SELECT * FROM responses")
    assert (row["event_id"], row["previous_response_id"], row["principal"]) == (stored.event_id, "resp_8", "alice")
    assert (row["deleted_at"].timestamp(), row["deleted_by"]) == (20.0, early.event_id)
    # Its content is erased, from its row and from the ledger's copy of its event, whatever the order.
    assert (row["status"], row["input_items"], row["response"], row["stored_bytes"]) == (None, None, None, 0)
    payload = json.loads(await conn.fetchval("SELECT payload FROM events WHERE event_id = $1", stored.event_id))
    assert (payload["input_items"], payload["response"], payload["erased"]) == ([], {}, True)
    assert payload["response_id"] == "resp_9" and stored.input_items and stored.response


async def test_a_response_stored_again_keeps_its_latest_copy(conn: asyncpg.Connection) -> None:
    newer = response_stored("resp_7", ts=200.0, response={"id": "resp_7", "status": "incomplete"})
    await project(conn, on_subjects(newer))
    await project(conn, on_subjects(response_stored("resp_7", ts=100.0)))
    row = await conn.fetchrow("SELECT event_id, status, deleted_at FROM responses")
    assert (row["event_id"], row["status"], row["deleted_at"]) == (newer.event_id, "incomplete", None)


def file_created(file_id: str, ts: float = 10.0, principal: str | None = "alice") -> FileCreated:
    return FileCreated(model="-", node="gateway", ts=ts, file_id=file_id, principal=principal,
                            filename="in.jsonl", purpose="batch", bytes=42, created_at=int(ts))


def file_deleted(file_id: str, ts: float = 20.0) -> FileDeleted:
    return FileDeleted(model="-", node="gateway", ts=ts, file_id=file_id, principal="alice")


async def test_files_merge_creation_and_deletion_in_either_order(conn: asyncpg.Connection) -> None:
    # The deletion first, in its own batch; then the creation, twice (a redelivery and a replayed copy).
    await project(conn, on_subjects(file_deleted("file-a", ts=30.0)))
    row = await conn.fetchrow("SELECT * FROM files WHERE file_id = 'file-a'")
    assert row["event_id"] is None and row["deleted_at"] is not None
    created = file_created("file-a")
    await project(conn, on_subjects(created, created, file_deleted("file-a", ts=25.0)))
    row = await conn.fetchrow("SELECT * FROM files WHERE file_id = 'file-a'")
    assert (row["principal"], row["filename"], row["purpose"], row["bytes"], row["created_at"]) == (
        "alice", "in.jsonl", "batch", 42, 10)
    assert row["deleted_at"].timestamp() == 25.0
