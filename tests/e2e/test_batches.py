"""The Batch API end to end, with the `openai` SDK as client: a batch of a purpose=batch file's
lines runs through the gateway's own pipeline on a scripted worker, its state and lines land in the
ledger (through the recorder), its output and error files in the files bucket; owned by its
principal; cancelled mid-way it stops starting lines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import openai
import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from apps.bus import topology
from apps.bus.event_publish import publish_event
from apps.bus.events import BatchStatus
from tests.e2e.conftest import System, scripted_worker
from tests.support import REPO, eventually, eventually_async, fetch_rows
from tests.system import KeyedGateway, api_keys_file, keyed_gateway

ALICE, BOB, CAROL = "sk-alice-batches", "sk-bob-batches", "sk-carol-batches"
MODEL = "batch-scripted"
# "slow" lines hold their slot about 3 s; the others answer at once.
SCRIPT = {"rules": [{"match": "slow", "reply": "one two three four", "first_token_delay_s": 1.0,
                     "token_delay_s": 0.5}],
          "default": "a quick answer"}
CONCURRENCY = 2
# The most live batches a principal may have here (each other test has at most one at a time).
LIVE_CAP = 3
# The acceptance's 200-line batch: every valid line answered, each custom_id once.
VALID = 200


GATEWAY_ENV = {"HELEXA_BATCH_CONCURRENCY": str(CONCURRENCY), "HELEXA_MAX_LIVE_BATCHES_PER_PRINCIPAL": str(LIVE_CAP)}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return api_keys_file(tmp_path_factory.mktemp("keys"),
                         {ALICE: "batches-alice", BOB: "batches-bob", CAROL: "batches-carol"})


@pytest.fixture(scope="module")
def gateway(system: System, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedGateway]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), MODEL, SCRIPT):
        started = keyed_gateway(system, keys, ALICE, env=GATEWAY_ENV)
        try:
            yield started
        finally:
            started.process.stop()


def line(custom_id: str, text: str, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def finished(client: openai.OpenAI, batch_id: str, status: str) -> Batch | None:
    batch = client.batches.retrieve(batch_id)
    return batch if batch.status == status else None


def completed_lines(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def ledger(system: System, sql: str, *args: object) -> list[dict]:
    return [dict(row) for row in asyncio.run(fetch_rows(system.database_url, sql, *args))]


def test_a_200_line_batch_runs_to_completed_with_its_invalid_lines_as_errors(
        system: System, gateway: KeyedGateway) -> None:
    client = gateway.client()
    lines = [line(f"req-{i}", f"question {i}") for i in range(VALID)]
    lines.insert(5, line("wrong-url", "hi", url="/v1/completions"))
    lines.insert(111, {"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": MODEL}})
    upload = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"job": "nightly"})
    Batch.model_validate(created.model_dump(), strict=True)
    assert created.id.startswith("batch_") and created.status == "validating"
    assert created.metadata == {"job": "nightly"}

    done = eventually(lambda: finished(client, created.id, "completed"), 120, message="the batch never completed")
    Batch.model_validate(done.model_dump(), strict=True)
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (VALID + 2, VALID, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.output_file_id and done.error_file_id

    output = [json.loads(row) for row in client.files.content(done.output_file_id).text.splitlines()]
    assert len(output) == VALID
    assert sorted(row["custom_id"] for row in output) == sorted(f"req-{i}" for i in range(VALID))
    for row in output:
        assert row["response"]["status_code"] == 200 and row["error"] is None
        completion = ChatCompletion.model_validate(row["response"]["body"])
        assert completion.choices[0].message.content == "a quick answer"
    errors = [json.loads(row) for row in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in errors) == ["no-messages", "wrong-url"]
    assert all(row["response"] is None and row["error"]["message"] for row in errors)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # Listed by that purpose too, as the SDK types it.
    outputs = {f.id for f in client.files.list(purpose="batch_output").data}
    assert {done.output_file_id, done.error_file_id} <= outputs and upload.id not in outputs

    rows = ledger(system, "SELECT count(*) AS n, count(DISTINCT custom_id) AS ids FROM batch_lines WHERE batch_id = $1",
                  created.id)
    assert rows == [{"n": VALID + 2, "ids": VALID + 2}]
    assert created.id in [batch.id for batch in client.batches.list()]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'helexa:gateway_batch_lines_total{outcome="answered"} 200.0' in metrics
    assert 'helexa:gateway_batch_lines_total{outcome="invalid"} 2.0' in metrics


def test_another_principal_cannot_see_or_cancel_a_batch(gateway: KeyedGateway) -> None:
    alice, bob = gateway.client(), gateway.client(BOB)
    upload = alice.files.create(file=("one.jsonl", jsonl([line("only", "hi")])), purpose="batch")
    with pytest.raises(openai.NotFoundError) as borrowed:  # nor can anyone use another's file
        bob.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert borrowed.value.body["param"] == "input_file_id"
    created = alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    with pytest.raises(openai.NotFoundError) as seen:
        bob.batches.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as cancelled:
        bob.batches.cancel(created.id)
    with pytest.raises(openai.NotFoundError) as missing:
        bob.batches.retrieve("batch_" + "0" * 44)
    assert seen.value.body == missing.value.body | {"message": seen.value.body["message"]}
    assert cancelled.value.status_code == 404
    assert created.id not in [batch.id for batch in bob.batches.list()]
    eventually(lambda: finished(alice, created.id, "completed"), 120, message="the batch never completed")


def test_bounds_name_their_parameter(gateway: KeyedGateway) -> None:
    client = gateway.client()
    upload = client.files.create(file=("one.jsonl", jsonl([line("only", "hi")])), purpose="batch")
    notes = client.files.create(file=("notes.txt", b"notes"), purpose="user_data")
    cases = [({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
             ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
             ({"input_file_id": notes.id}, "input_file_id")]
    for change, param in cases:
        body = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as refused:
            client.post("/batches", cast_to=Batch, body=body)
        assert refused.value.body["param"] == param
    # The create's body has a bound of its own (64 KiB), and the 413 names that one.
    body = {"input_file_id": upload.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"pad": "x" * (64 << 10)}}
    with pytest.raises(openai.APIStatusError) as refused:
        client.post("/batches", cast_to=Batch, body=body)
    assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"
    assert "endpoint's limit of 65536 bytes" in refused.value.body["message"]


def running_slow_batch(client: openai.OpenAI, name: str) -> Batch:
    """A batch of 40 slow lines (each holds its slot about 3 s), once its first line has finished."""
    lines = [line(f"{name}-{i}", f"slow {name} question {i}") for i in range(40)]
    upload = client.files.create(file=(f"{name}.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    eventually(lambda: completed_lines(client, created.id) >= 1, 120, message="no line finished")
    return created


def test_a_cancelled_batch_stops_starting_lines_while_interactive_work_runs(
        system: System, gateway: KeyedGateway) -> None:
    client = gateway.client()
    created = running_slow_batch(client, "slow")
    # An interactive stream finishes while the batch's lines hold the worker.
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "now"}], stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "a quick answer"

    assert client.batches.cancel(created.id).status in ("cancelling", "cancelled")
    done = eventually(lambda: finished(client, created.id, "cancelled"), 120, message="the batch never cancelled")
    assert done.cancelling_at and done.cancelled_at and done.request_counts is not None
    completed = done.request_counts.completed
    assert 1 <= completed < 40 and done.request_counts.failed == 0
    output = [json.loads(row) for row in client.files.content(done.output_file_id).text.splitlines()]
    assert len(output) == completed == len({row["custom_id"] for row in output})
    # Every line that started finished and is in the output: none started after the cancel took.
    eventually(lambda: len(ledger(system, "SELECT request_id FROM runs WHERE starts_with(request_id, $1)",
                                  f"{created.id}-")) == completed, 60, message="runs of lines not in the output")


def test_a_batch_failed_elsewhere_while_it_runs_starts_no_more_lines_and_its_claim_is_done(
        system: System, gateway: KeyedGateway) -> None:
    # A gateway whose claim publish seemed to fail marks its batch failed, though the claim was
    # queued: the runner that took the claim stops starting lines once the ledger says so.
    client = gateway.client()
    created = running_slow_batch(client, "doomed")

    async def fail_it_and_wait_for_the_claim() -> None:
        nc = await nats.connect(system.nats_url)
        try:
            js = nc.jetstream()
            await publish_event(js, BatchStatus(model="-", node="gateway", batch_id=created.id, status="failed",
                                                at=int(time.time()), errors=[{"code": "not_queued",
                                                                              "message": "injected"}]),
                                required=True)

            async def claim_done() -> bool:
                return (await js.stream_info(topology.BATCHES_STREAM)).state.messages == 0
            await eventually_async(claim_done, 120, interval_s=0.5, message="the claim was never done")
        finally:
            await nc.close()

    asyncio.run(fail_it_and_wait_for_the_claim())
    done = client.batches.retrieve(created.id)
    assert done.status == "failed" and done.output_file_id is None
    assert done.errors is not None and done.errors.data and done.errors.data[0].code == "not_queued"
    runs = ledger(system, "SELECT request_id FROM runs WHERE starts_with(request_id, $1)", f"{created.id}-")
    assert 1 <= len(runs) < 40


def test_a_batch_whose_window_passes_mid_run_writes_what_is_done_and_expires_the_rest(
        system: System, gateway: KeyedGateway) -> None:
    client = gateway.client()
    total = 20
    lines = [line(f"late-{i}", f"slow late {i}") for i in range(total)]
    upload = client.files.create(file=("late.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    eventually(lambda: completed_lines(client, created.id) >= 2, 120, message="no line finished")
    # An interactive stream is under way while the window passes.
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "slow now"}],
                                            stream=True)
    # The window passes: the batch's deadline is the ledger's, moved into the past as time would.
    moved = ledger(system, "UPDATE batches SET expires_at = extract(epoch FROM now())::bigint - 1 "
                           "WHERE batch_id = $1 RETURNING expires_at", created.id)
    assert len(moved) == 1
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "one two three four"

    done = eventually(lambda: finished(client, created.id, "expired"), 120, message="the batch never expired")
    Batch.model_validate(done.model_dump(), strict=True)
    assert done.expired_at and done.request_counts is not None and done.output_file_id and done.error_file_id
    answered = done.request_counts.completed
    assert 2 <= answered < total and done.request_counts.failed == total - answered
    output = [json.loads(row) for row in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(row) for row in client.files.content(done.error_file_id).text.splitlines()]
    assert len(output) == answered and len(errors) == total - answered
    assert all(row["response"]["status_code"] == 200 for row in output)
    assert all(row["response"] is None and row["error"]["code"] == "batch_expired" for row in errors)
    # Every custom_id exactly once across both files.
    assert sorted(row["custom_id"] for row in output + errors) == sorted(f"late-{i}" for i in range(total))
    # No line started that is not in the output: each started line finished and was answered, and
    # the expired ones never ran.
    runs = ledger(system, "SELECT request_id FROM runs WHERE starts_with(request_id, $1)", f"{created.id}-")
    assert len(runs) == answered


def helexa_batches(gateway: KeyedGateway, data_dir: Path, *args: str, key: str = ALICE) -> tuple[int, list[dict]]:
    """`helexa batches ARGS` as an operator runs it, with the gateway's URL and `key` exported."""
    env = {**os.environ, "HELEXA_URL": gateway.url, "HELEXA_API_KEY": key}
    done = subprocess.run([sys.executable, "-m", "apps.cli", "--data-dir", str(data_dir), "batches", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, [json.loads(row) for row in done.stdout.splitlines() if row.startswith("{")]


def test_the_batches_command_lists_shows_and_cancels_as_the_keys_principal(
        gateway: KeyedGateway, tmp_path: Path) -> None:
    client = gateway.client()
    upload = client.files.create(file=("cli.jsonl", jsonl([line(f"cli-{i}", f"slow cli {i}") for i in range(10)])),
                                 purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")

    code, listed = helexa_batches(gateway, tmp_path, "ls")
    assert code == 0 and created.id in [row["id"] for row in listed]
    code, shown = helexa_batches(gateway, tmp_path, "show", created.id)
    assert code == 0 and Batch.model_validate(shown[0]).id == created.id
    code, refused = helexa_batches(gateway, tmp_path, "cancel", created.id, key=BOB)
    assert code == 1 and refused[0]["ok"] is False and refused[0]["error"].startswith("404")
    code, listed = helexa_batches(gateway, tmp_path, "ls", key=BOB)
    assert code == 0 and created.id not in [row["id"] for row in listed]

    code, cancelled = helexa_batches(gateway, tmp_path, "cancel", created.id)
    assert code == 0 and cancelled[0]["status"] in ("cancelling", "cancelled")
    eventually(lambda: finished(client, created.id, "cancelled"), 120, message="the batch never cancelled")
    code, shown = helexa_batches(gateway, tmp_path, "show", created.id)
    assert code == 0 and shown[0]["status"] == "cancelled"


def test_a_small_batch_on_the_real_model_answers_as_the_live_route(system: System, gateway: KeyedGateway) -> None:
    client = gateway.client()
    questions = ["What is the capital of France?", "Name a primary color.", "Count to three.", "Say hello."]
    bodies = [{"model": system.model, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
               "temperature": 0} for text in questions]
    lines = [{"custom_id": f"real-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    upload = client.files.create(file=("real.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    done = eventually(lambda: finished(client, created.id, "completed"), 180, message="the batch never completed")
    assert done.output_file_id is not None
    output = {row["custom_id"]: ChatCompletion.model_validate(row["response"]["body"])
              for row in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    assert sorted(output) == [f"real-{i}" for i in range(len(questions))]
    for i, body in enumerate(bodies):
        live = client.chat.completions.create(**body)
        assert output[f"real-{i}"].choices[0].message.content == live.choices[0].message.content
        batch_usage, live_usage = output[f"real-{i}"].usage, live.usage
        assert batch_usage is not None and live_usage is not None  # cached prompt tokens may differ
        assert (batch_usage.prompt_tokens, batch_usage.completion_tokens) == (live_usage.prompt_tokens,
                                                                              live_usage.completion_tokens)


def test_a_principal_past_its_live_batches_cap_gets_429_naming_it(gateway: KeyedGateway) -> None:
    alice, bob = gateway.client(), gateway.client(BOB)
    # Slow lines, so the first batch is still running when the cap is reached.
    upload = alice.files.create(file=("cap.jsonl", jsonl([line(f"cap-{i}", f"slow cap {i}") for i in range(10)])),
                                purpose="batch")

    def create() -> Batch:
        return alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

    live = [create() for _ in range(LIVE_CAP)]
    with pytest.raises(openai.RateLimitError) as refused:
        create()
    assert refused.value.body["param"] == "max_live_batches_per_principal"
    # The cap is per principal: another's batches are not counted.
    theirs = bob.files.create(file=("one.jsonl", jsonl([line("only", "hi")])), purpose="batch")
    bobs = bob.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions", completion_window="24h")
    bob.batches.cancel(bobs.id)

    for batch in live:
        alice.batches.cancel(batch.id)
    for batch_id in [batch.id for batch in live]:
        eventually(lambda: finished(alice, batch_id, "cancelled"), 120, message="a batch never cancelled")  # noqa: B023  # called before the loop moves on
    again = create()
    alice.batches.cancel(again.id)
    eventually(lambda: finished(alice, again.id, "cancelled"), 120, message="the batch never cancelled")
    eventually(lambda: finished(bob, bobs.id, "cancelled") or finished(bob, bobs.id, "completed"), 120,
               message="bob's batch never ended")



def test_the_live_batches_cap_holds_across_two_gateways_racing(
        system: System, gateway: KeyedGateway, keys: Path) -> None:
    other = keyed_gateway(system, keys, CAROL, env=GATEWAY_ENV)
    try:
        clients = [gateway.client(CAROL), other.client(CAROL)]
        upload = clients[0].files.create(file=("race.jsonl", jsonl([line(f"race-{i}", f"slow race {i}")
                                                                      for i in range(10)])), purpose="batch")
        attempts = 12
        start = threading.Barrier(attempts)

        def create(index: int) -> Batch | openai.RateLimitError:
            client = clients[index % 2]  # half through each gateway, all at once
            start.wait()
            try:
                return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
            except openai.RateLimitError as refused:
                return refused

        with ThreadPoolExecutor(attempts) as pool:
            results = list(pool.map(create, range(attempts)))
        made = [result for result in results if isinstance(result, Batch)]
        refused = [result for result in results if isinstance(result, openai.RateLimitError)]
        assert len(made) == LIVE_CAP and len(refused) == attempts - LIVE_CAP
        assert all(error.body["param"] == "max_live_batches_per_principal" for error in refused)
        assert len(ledger(system, "SELECT batch_id FROM batches WHERE principal = 'batches-carol' "
                                  "AND status <> ALL($1::text[])",
                          ["completed", "failed", "expired", "cancelled"])) == LIVE_CAP
        for batch in made:
            clients[0].batches.cancel(batch.id)
        for batch_id in [batch.id for batch in made]:
            eventually(lambda: finished(clients[0], batch_id, "cancelled"), 120,  # noqa: B023  # called before the loop moves on
                       message="a batch never cancelled")
    finally:
        other.process.stop()


def response_line(custom_id: str, **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "max_output_tokens": 16, **body}}


def test_a_responses_batch_answers_as_the_live_route_and_refuses_stateful_lines(gateway: KeyedGateway) -> None:
    client = gateway.client()
    valid = [response_line("plain", input="hello"), response_line("unstored", input="hi", store=False),
             response_line("items", input=[{"role": "user", "content": "hey"}], instructions="Be brief."),
             response_line("meta", input="again", metadata={"tag": "x"})]
    invalid = [response_line("no-input"), response_line("stored", input="hi", store=True),
               response_line("continued", input="hi", previous_response_id="resp_abc"),
               response_line("background", input="hi", background=True)]
    upload = client.files.create(file=("responses.jsonl", jsonl(valid + invalid)), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")

    done = eventually(lambda: finished(client, created.id, "completed"), 120, message="the batch never completed")
    assert done.request_counts is not None and done.output_file_id and done.error_file_id
    assert (done.request_counts.completed, done.request_counts.failed) == (len(valid), len(invalid))
    rows = client.files.content(done.output_file_id).text.splitlines()
    output = {row["custom_id"]: row for row in map(json.loads, rows)}
    assert sorted(output) == sorted(item["custom_id"] for item in valid)
    for row in output.values():
        assert row["response"]["status_code"] == 200 and row["error"] is None
        response = Response.model_validate(row["response"]["body"])
        assert response.status == "completed" and response.output_text == "a quick answer"
        assert response.id.startswith("resp_") and response.store is False
    live = client.responses.with_raw_response.create(model=MODEL, input="hello", max_output_tokens=16, store=False)
    live_body, batch_body = live.http_response.json(), output["unstored"]["response"]["body"]
    assert sorted(batch_body) == sorted(live_body) and batch_body["output"][0].keys() == live_body["output"][0].keys()
    assert output["items"]["response"]["body"]["instructions"] == "Be brief."
    assert output["meta"]["response"]["body"]["metadata"] == {"tag": "x"}
    errors = {row["custom_id"]: row["error"]["message"]
              for row in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert sorted(errors) == sorted(item["custom_id"] for item in invalid)
    assert "input" in errors["no-input"]
    for custom_id, param in (("stored", "store"), ("continued", "previous_response_id"),
                             ("background", "background")):
        assert param in errors[custom_id].lower()
