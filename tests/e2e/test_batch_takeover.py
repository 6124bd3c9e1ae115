"""A batch survives the gateway that runs it: SIGKILLed mid-batch, its claim on the BATCHES work
queue comes back after the ack wait (`SESSION_BUS`: 15 s) to the gateway started again, which
runs the lines the ledger does not have; every custom_id is answered exactly once in the output.
A batch still claimed an hour past its window ends with what is recorded. (The
session's own gateway runs no batches, so the one killed here is the one that held the batch.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from openai.types import Batch

from apps.embedded import free_port
from apps.gateway.batch_runner import GIVE_UP_AFTER_EXPIRY_S
from tests.e2e.conftest import System, scripted_worker
from tests.support import eventually, fetch_rows
from tests.system import api_keys_file, keyed_gateway

KEY = "sk-takeover"
MODEL = "batch-takeover"
# Each line holds its slot about 2 s.
SCRIPT = {"rules": [{"match": "", "reply": "one two three", "first_token_delay_s": 1.0, "token_delay_s": 0.3}],
          "default": ""}
LINES = 16
DOOMED = "e2e-workerkill-a"


def lines_done(system: System, batch_id: str) -> int:
    rows = asyncio.run(fetch_rows(system.database_url, "SELECT count(*) AS n FROM batch_lines WHERE batch_id = $1",
                                  batch_id))
    return int(rows[0]["n"])


def start_batch(client: openai.OpenAI, model: str) -> Batch:
    """A batch of LINES chat lines for `model`, created."""
    content = b"".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": f"q{i}"}]}}).encode() + b"\n"
        for i in range(LINES))
    upload = client.files.create(file=("batch.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def completed_with_every_line_once(client: openai.OpenAI, batch_id: str, after: str) -> list[dict]:
    """Waits for `batch_id` to complete; asserts every line was answered once; returns the output lines."""
    done: Batch = eventually(lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b, 300,
                             message=f"the batch never completed after {after}")
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (LINES, LINES)
    assert done.output_file_id is not None
    output = [json.loads(row) for row in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(f"line-{i}" for i in range(LINES))
    return output


def test_a_batch_completes_after_its_gateway_is_killed_and_started_again(
        system: System, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    keys = api_keys_file(tmp_path_factory.mktemp("keys"), {KEY: "carol"})
    port = free_port()
    env = {"HELEXA_BATCH_CONCURRENCY": "2"}
    with scripted_worker(system, tmp_path, MODEL, SCRIPT):
        first = keyed_gateway(system, keys, KEY, port=port, env=env)
        created = start_batch(first.client(), MODEL)
        eventually(lambda: lines_done(system, created.id) >= 2, 120, message="no line finished")
        first.process.kill()
        assert lines_done(system, created.id) < LINES

        second = keyed_gateway(system, keys, KEY, port=port, env=env)
        try:
            completed_with_every_line_once(second.client(), created.id, "the restart")
        finally:
            second.process.stop()


def running_on(system: System, batch_id: str, node: str) -> bool:
    rows = asyncio.run(fetch_rows(system.database_url, "SELECT count(*) AS n FROM run_attempts WHERE"
                                  " starts_with(request_id, $1) AND node = $2 AND status = 'running'",
                                  f"{batch_id}-", node))
    return int(rows[0]["n"]) > 0


def test_a_batch_completes_after_a_worker_is_killed_with_one_served_run_per_line(
        system: System, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two workers serve the batch's model; one is SIGKILLed while it holds lines. Its lines migrate
    (text already sent) or are redelivered (none yet) to the other; no line is answered twice."""
    keys = api_keys_file(tmp_path_factory.mktemp("keys"), {KEY: "carol"})
    model = "batch-workerkill"
    with scripted_worker(system, tmp_path_factory.mktemp("a"), model, SCRIPT,
                         env={"HELEXA_NODE_ID": DOOMED}) as doomed, \
            scripted_worker(system, tmp_path_factory.mktemp("b"), model, SCRIPT,
                            env={"HELEXA_NODE_ID": "e2e-workerkill-b"}):
        gateway = keyed_gateway(system, keys, KEY, env={"HELEXA_BATCH_CONCURRENCY": "4"})
        try:
            client = gateway.client()
            created = start_batch(client, model)
            eventually(lambda: lines_done(system, created.id) >= 2 and running_on(system, created.id, DOOMED), 120,
                       message="no line running on the worker to kill")
            doomed.kill()
            assert lines_done(system, created.id) < LINES

            output = completed_with_every_line_once(client, created.id, "its worker was killed")
            assert all(row["response"]["body"]["choices"][0]["message"]["content"] == "one two three"
                       for row in output)
            # Each line's answer is its request's run, and that run is the one served (`ok`).
            served = (
                "SELECT l.custom_id, r.status FROM batch_lines l JOIN runs r USING (request_id)"
                " WHERE l.batch_id = $1 AND r.status = 'ok'")
            rows = eventually(lambda: (found := asyncio.run(fetch_rows(system.database_url, served, created.id)))
                              and len(found) == LINES and found, 60, message="a line's run is not served")
            assert sorted(row["custom_id"] for row in rows) == sorted(f"line-{i}" for i in range(LINES))
            runs = asyncio.run(fetch_rows(system.database_url, "SELECT count(*) AS n FROM runs"
                                          " WHERE starts_with(request_id, $1) AND status = 'ok'", f"{created.id}-"))
            assert runs[0]["n"] == LINES  # no line ran to an answer twice
            moved = asyncio.run(fetch_rows(
                system.database_url, "SELECT request_id FROM run_attempts WHERE starts_with(request_id, $1)"
                " GROUP BY request_id HAVING count(DISTINCT node) = 2", f"{created.id}-"))
            assert moved, "no line held by the killed worker was answered by the other"
        finally:
            gateway.process.stop()


def test_a_batch_still_claimed_an_hour_past_its_window_ends_with_what_is_recorded(
        system: System, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A batch made through the session's gateway (which runs none), its window moved past the
    give-up bound in the ledger (which owns the deadline): the first runner to claim it ends it
    `expired` with an error saying why, running no line, instead of it coming back forever."""
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused")
    created = start_batch(client, MODEL)
    moved = eventually(lambda: asyncio.run(fetch_rows(
        system.database_url, "UPDATE batches SET expires_at = extract(epoch FROM now())::bigint - $2::bigint"
        " WHERE batch_id = $1 RETURNING batch_id", created.id, int(GIVE_UP_AFTER_EXPIRY_S) + 60)), 30,
        message="the batch never reached the ledger")
    assert moved
    keys = api_keys_file(tmp_path_factory.mktemp("keys"), {KEY: "carol"})
    runner = keyed_gateway(system, keys, KEY, env={"HELEXA_BATCH_CONCURRENCY": "2"})
    try:
        ended: Batch = eventually(lambda: (b := client.batches.retrieve(created.id)).status == "expired" and b, 120,
                                  message="the batch was not given up")
    finally:
        runner.process.stop()
    assert ended.errors is not None and ended.errors.data
    assert ended.errors.data[0].code == "batch_incomplete"
    assert lines_done(system, created.id) == 0  # no line ran on a claim past the bound
