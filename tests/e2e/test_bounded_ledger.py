"""Bounded by construction, through real processes (issue 35): on a nats-server with the stock
1 MiB max_payload, a recorder, a scripted worker and two gateways, no client-sized event, error
text or stored response closes a connection or is lost, stored responses are bounded and erased
for real, response ids cannot be guessed, and a response made on one gateway is read on the
other while two CPU-burning processes compete for the machine.

The worker is scripted (`engine.frontend.scripted`): its delays say how long a stream lasts and its
`error_text` is as long as an engine error quoting a whole grammar, without running a model.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import httpx
import pytest
from nats.js.errors import ObjectNotFoundError
from prometheus_client.parser import text_string_to_metric_families

from apps.bus import connection, topology, wire
from apps.bus.codes import Api, FinishReason, RunStatus
from apps.bus.events import RunFinished
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from tests.support import AppProcess, declared, eventually, fetch_rows, migrated_database

MODEL = "bounds-model"
WORDS = " ".join(f"w{i}" for i in range(120))
MIB = 1 << 20


def _error_in_the_header_window() -> str:
    """An engine error whose `run.finished` body lands ~30 bytes under 1 MiB: within what nats-py
    lets through (it checks the body) and past what the server takes with the Nats-Msg-Id header,
    the window where an unmeasured publish cost the worker its connection."""
    run = RunFinished(
        model=MODEL, node="bounds-worker", request_id=f"chatcmpl-{uuid.uuid4().hex}", api=Api.CHAT_COMPLETIONS,
        principal=None, status=RunStatus.ERROR, finish_reason=FinishReason.ERROR, prompt_tokens=30,
        completion_tokens=0, cached_tokens=0, attempt=1, queue_ms=12.345, ttft_ms=None, prefill_ms=0.0,
        decode_ms=0.0, e2e_ms=45.678, error="", served=True)
    head = "structured output failed: Parser Error: max is 2000; grammar: "
    return head + "y" * (MIB - 30 - len(wire.encode(run)) - len(head))


GRAMMAR_ERROR = _error_in_the_header_window()
SCRIPT = {"rules": [{"match": "explode", "reply": "", "fault": "error", "error_text": GRAMMAR_ERROR},
                    {"match": "count", "reply": WORDS, "token_delay_s": 0.02}],
          "default": "ok"}


@dataclass
class Stack:
    nats_url: str
    database_url: str
    gateways: list[str]
    worker: AppProcess
    gateway_processes: list[AppProcess]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("bounds")
    script = folder / "script.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    database_url = asyncio.run(migrated_database(postgres, "bounds"))
    apps: list[AppProcess] = []
    with NatsServer(folder / "nats", max_payload=None) as nats:  # nats-server's own 1 MiB
        declared(nats)  # as helexa up: apps may not declare the topology
        env = {"NATS_URL": nats.url, "DATABASE_URL": database_url}
        try:
            recorder = AppProcess(["recorder"], env)
            apps.append(recorder)
            worker = AppProcess(["worker", "--script", str(script), "--served-model-name", MODEL],
                                {**env, "HELEXA_NODE_ID": "bounds-worker", "HELEXA_STATUS_INTERVAL_S": "1"})
            apps.append(worker)
            ports = [free_port(), free_port()]
            # The first gateway does not wait for ids it does not know (the guessing test tries
            # thousands of fresh-looking ids that exist nowhere, all from one address, so its request
            # rate is not limited: the ids must hold by themselves); the second waits as by default.
            gateways = [AppProcess(["gateway"], {**env, "HELEXA_PORT": str(ports[0]), "HELEXA_RESPONSE_WAIT_S": "0",
                                                 "HELEXA_RATE_LIMIT_RPS": "0"}),
                        AppProcess(["gateway"], {**env, "HELEXA_PORT": str(ports[1])})]
            apps += gateways
            for app in apps:
                app.wait_ready()
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            for url in urls:
                eventually(lambda url=url: MODEL in httpx.get(f"{url}/v1/models").text, 60, message="model listed")
            yield Stack(nats.url, database_url, urls, worker, gateways)
        finally:
            for app in reversed(apps):
                app.stop()


def chat(stream: bool, text: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream, "max_tokens": 400,
            "temperature": 0}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


async def streamed_usage(http: httpx.AsyncClient) -> tuple[int, str | None]:
    """A streamed chat completion to its end: (completion tokens, finish reason)."""
    tokens, finish = -1, None
    async with http.stream("POST", "/v1/chat/completions", json=chat(True, "count for me")) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return tokens, finish


def full_count(url: str) -> int:
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat(False, "count for me"), timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    return answer.json()["usage"]["completion_tokens"]


def counter(url: str, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def still_connected(stack: Stack) -> None:
    assert stack.worker.process.poll() is None, stack.worker.output()
    assert not any("closed by the server" in line.get("event", "") for line in stack.worker.lines)
    for url, process in zip(stack.gateways, stack.gateway_processes, strict=True):
        assert process.process.poll() is None
        assert counter(url, "helexa:gateway_bus_connections_lost_total") == 0



def test_an_engine_error_quoting_a_grammar_keeps_the_worker_on_the_bus(stack: Stack) -> None:
    """An engine error as long as a grammar, sized so its `run.finished` falls in the header window
    of a 1 MiB server: the run is recorded with the error cut to 1 KB, the worker stays connected,
    and a stream running beside it finishes with every token."""
    url = stack.gateways[0]
    expected = full_count(url)

    async def scenario() -> tuple[tuple[int, str | None], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            stream = asyncio.create_task(streamed_usage(http))
            failures = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat(False, f"explode {i}"))
                                              for i in range(3)))
            return await stream, failures

    (tokens, finish), failures = asyncio.run(scenario())
    assert [f.status_code for f in failures] == [500] * 3
    assert all(f.json()["error"]["code"] == "generation_failed" for f in failures)
    assert (tokens, finish) == (expected, "stop")

    def recorded() -> list[asyncpg.Record] | None:
        rows = asyncio.run(fetch_rows(stack.database_url,
                                      "SELECT error FROM runs WHERE error LIKE 'structured output%'"))
        return rows if len(rows) >= 3 else None

    rows = eventually(recorded, 60, message="the failed runs recorded")
    assert len(rows) == 3 and all(len(row["error"].encode()) <= 1024 for row in rows)
    still_connected(stack)


def responses_body(**fields: object) -> dict:
    return {"model": MODEL, "input": "Say ok.", "max_output_tokens": 8, **fields}


def test_oversize_ignored_input_is_refused_by_name_while_other_streams_finish(stack: Stack) -> None:
    url = stack.gateways[0]
    expected = full_count(url)
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "z" * (5 * MIB)}
    refusals = {
        "a 5 MiB reasoning item": (responses_body(input=[reasoning, {"role": "user", "content": "hi"}]), 413, "input"),
        "a metadata value of 600 characters": (responses_body(metadata={"k": "v" * 600}), 400, "metadata"),
        "a metadata key of 65 characters": (responses_body(metadata={"k" * 65: "v"}), 400, "metadata"),
        "17 metadata pairs": (responses_body(metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata"),
        "an item id of 300 characters": (
            responses_body(input=[{"role": "user", "content": "hi", "id": "m" * 300}]), 400, "input"),
        "a user of 300 characters": (responses_body(user="u" * 300), 400, "user"),
        "a NUL in stored input": (responses_body(input="nul \x00 here"), 400, "input"),
        "a NUL in instructions": (responses_body(instructions="a\x00b"), 400, "instructions"),
        # The store's byte cap is checked before any NUL is looked for.
        "a NUL in a 5 MiB body": (responses_body(input=[reasoning, {"role": "user", "content": "a\x00"}]), 413,
                                  "input"),
    }

    async def scenario() -> tuple[list[tuple[int, str | None]], dict[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            streams = [asyncio.create_task(streamed_usage(http)) for _ in range(3)]
            answers = await asyncio.gather(*(http.post("/v1/responses", json=body) for body, _, _ in refusals.values()))
            return list(await asyncio.gather(*streams)), dict(zip(refusals, answers, strict=True))

    streams, answers = asyncio.run(scenario())
    for name, (_, status, param) in refusals.items():
        answer = answers[name]
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), (name, answer.text)
    assert streams == [(expected, "stop")] * 3
    # Not stored, so nothing of them reached the ledger either: no response at all so far.
    assert not asyncio.run(fetch_rows(stack.database_url, "SELECT 1 FROM responses WHERE stored_bytes > $1", 4 * MIB))
    # Without `store`, a NUL is the model's business: the request runs.
    unstored = httpx.post(f"{url}/v1/responses", json=responses_body(input="nul \x00 here", store=False), timeout=120)
    assert unstored.status_code == 200, unstored.text
    still_connected(stack)


@pytest.mark.parametrize("pad", [MIB - 4096, MIB - 600, MIB + 64])
def test_a_response_stored_in_the_payload_window_is_stored_and_read_elsewhere(stack: Stack, pad: int) -> None:
    """An ignored input item sizes `response.stored` around the 1 MiB limit (headers included):
    every size is accepted and stored, by reference where one message cannot carry it, and the
    other gateway reads it from the ledger; three streams of other clients finish meanwhile."""
    url, other = stack.gateways
    expected = full_count(url)
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "r" * pad}
    body = responses_body(input=[reasoning, {"role": "user", "content": "hi"}])

    async def scenario() -> tuple[list[tuple[int, str | None]], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            streams = [asyncio.create_task(streamed_usage(http)) for _ in range(3)]
            answer = await http.post("/v1/responses", json=body)
            return list(await asyncio.gather(*streams)), answer

    streams, answer = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    assert streams == [(expected, "stop")] * 3
    response_id = answer.json()["id"]
    again = httpx.get(f"{other}/v1/responses/{response_id}", timeout=120)
    assert again.status_code == 200 and again.json()["id"] == response_id
    (row,) = asyncio.run(fetch_rows(stack.database_url, "SELECT input_items, stored_bytes, event_id FROM responses "
                                                   "WHERE response_id = $1", response_id))
    assert json.loads(row["input_items"])[0]["encrypted_content"] == "r" * pad and row["stored_bytes"] > pad
    # Past what one message carries (with its headers) it went through the Object Store.
    by_reference = asyncio.run(_object_exists(stack.nats_url, row["event_id"]))
    assert by_reference == (pad > MIB - 4096), (pad, row["stored_bytes"])
    still_connected(stack)


async def _object_exists(nats_url: str, name: str) -> bool:
    nc = await connection.connect(nats_url, "bounds-test", max_reconnect_attempts=0)
    try:
        store = await nc.jetstream().object_store(topology.LARGE_EVENTS_BUCKET)
        try:
            await store.get_info(name)
        except ObjectNotFoundError:
            return False
        return True
    finally:
        await nc.close()


def test_delete_erases_the_content_from_the_ledger(stack: Stack) -> None:
    url, other = stack.gateways
    marker = f"secret-{uuid.uuid4().hex}"
    made = httpx.post(f"{url}/v1/responses", json=responses_body(input=f"Remember {marker}.",
                                                                  metadata={"tag": marker}), timeout=120)
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    like = f"%{marker}%"

    def in_ledger() -> int:
        return asyncio.run(fetch_rows(stack.database_url,
                                      "SELECT count(*) AS n FROM events WHERE payload::text LIKE $1", like))[0]["n"]

    eventually(in_ledger, 60, message="the response recorded")
    assert httpx.delete(f"{url}/v1/responses/{response_id}", timeout=60).status_code == 200
    eventually(lambda: in_ledger() == 0, 60, message="the stored content erased from events")
    (row,) = asyncio.run(fetch_rows(stack.database_url, "SELECT * FROM responses WHERE response_id = $1", response_id))
    assert row["deleted_at"] is not None
    assert (row["input_items"], row["response"], row["status"], row["stored_bytes"]) == (None, None, None, 0)
    assert not asyncio.run(fetch_rows(stack.database_url, "SELECT 1 FROM responses WHERE response::text LIKE $1 "
                                                     "OR input_items::text LIKE $1", like))
    for gateway in (url, other):
        assert httpx.get(f"{gateway}/v1/responses/{response_id}", timeout=60).status_code == 404


def _derived(response_id: str, times: list[int]) -> list[str]:
    """Ids an attacker derives from `response_id`: its own random bits under the given times, and
    the id read as one number ± 1 and ± 2 (what "previous + 1" UUIDv7 ids gave away)."""
    random_part = response_id[17:]
    whole = int(response_id[5:], 16)
    width = len(response_id) - 5
    return ([f"resp_{t:012x}{random_part}" for t in times]
            + [f"resp_{whole + d:0{width}x}" for d in (-2, -1, 1, 2)])


def test_64_anonymous_clients_cannot_read_continue_or_delete_each_others_responses(stack: Stack) -> None:
    url = stack.gateways[0]

    async def make() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            answers = await asyncio.gather(*(http.post("/v1/responses", json=responses_body(input=f"client {i}"))
                                             for i in range(64)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        return [a.json()["id"] for a in answers]

    ids = asyncio.run(make())
    assert len(set(ids)) == 64
    times = sorted({int(i[5:17], 16) for i in ids})
    steps = [d for k in (1, 2, 3, 10, 100, 1000) for d in (-k, k)]
    # Every id derivable from one's own and everyone's creation times (± 1 ... ± 1000 ms in the time
    # part, every other bit one's own) is nobody's: checked exhaustively.
    everyone = set(ids)
    for mine in ids:
        candidates = set(_derived(mine, sorted({t + d for t in times for d in [0, *steps]})))
        assert not (candidates - {mine}) & everyone
    # And tried against the gateway: a sample of each client's derived ids, to read, continue, delete.
    others_time = {mine: int(ids[(n + 1) % 64][5:17], 16) for n, mine in enumerate(ids)}

    async def attack(http: httpx.AsyncClient, mine: str) -> list[int]:
        own = int(mine[5:17], 16)
        tried = [c for c in _derived(mine, [own - 1, own + 1, own - 1000, own + 1000,
                                            others_time[mine], others_time[mine] + 1]) if c != mine]
        statuses = []
        for candidate in tried:
            statuses.append((await http.get(f"/v1/responses/{candidate}")).status_code)
            continued = await http.post("/v1/responses", json=responses_body(previous_response_id=candidate))
            statuses.append(continued.status_code)
            statuses.append((await http.delete(f"/v1/responses/{candidate}")).status_code)
        return statuses

    async def everyone_attacks() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return list(await asyncio.gather(*(attack(http, mine) for mine in ids)))

    assert all(status == 404 for statuses in asyncio.run(everyone_attacks()) for status in statuses)
    # Nothing was deleted or touched: every client still reads its own.
    for mine in ids:
        assert httpx.get(f"{url}/v1/responses/{mine}", timeout=60).status_code == 200


@pytest.fixture
def burners() -> Iterator[None]:
    """Two processes that burn a CPU each for the whole test (a loaded 2-core machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_response_made_on_one_gateway_is_read_on_the_other_under_load(stack: Stack, burners: None) -> None:
    """No polling window to outlast: the other gateway waits for the recorder's notice."""
    first, second = stack.gateways
    for i in range(5):
        made = httpx.post(f"{first}/v1/responses", json=responses_body(input=f"turn {i}"), timeout=300)
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        read = httpx.get(f"{second}/v1/responses/{response_id}", timeout=300)
        assert read.status_code == 200 and read.json()["id"] == response_id, read.text
        continued = httpx.post(f"{second}/v1/responses", json=responses_body(previous_response_id=response_id),
                               timeout=300)
        assert continued.status_code == 200, continued.text
        assert continued.json()["previous_response_id"] == response_id
