"""What a client can make the system compile or tokenize is bounded, through the whole system on the
default model: grammars past their bounds are a 4xx before any compile (the gateway's and the
workers' compile counters on /metrics and in the node entry do not move) while /health keeps
answering; a string schema nested 5000 deep is a 400, not a 500; the 16 choices of one grammar
compile once; a 1 MB prompt sent to a worker gets a clean 400 while another stream goes on to its
full length; a 7 MB /tokenize is a quick 400. Each runs beside a stream that must finish whole."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pytest

from apps.bus import connection, large_requests, roles, topology, wire
from apps.bus.codes import Api
from engine.frontend.protocol import SamplingParams
from tests.e2e.conftest import System
from tests.support import eventually

NODE = "e2e-worker"
STREAM_TOKENS = 48
# The loose bound: /health answers within this while hostile requests are refused.
HEALTH_BOUND_S = 2.0


def chat(system: System, **fields: Any) -> dict:
    return {"model": system.model, "messages": [{"role": "user", "content": "Answer yes or no: is the sea blue?"}],
            "max_tokens": 8, **fields}


@contextmanager
def concurrent_stream(system: System) -> Iterator[None]:
    """A stream of STREAM_TOKENS greedy tokens that runs while the block does; on the way out it
    must have finished with all of them ('length')."""
    started = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        body = chat(system, max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": "Tell me about lighthouses."}])
        try:
            with httpx.stream("POST", f"{system.base_url}/v1/chat/completions", json=body, timeout=300) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    started.set()
                    result["usage"] = chunk.get("usage") or result.get("usage")
                    for choice in chunk.get("choices", []):
                        result["finish"] = choice.get("finish_reason") or result.get("finish")
        finally:
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120), "the concurrent stream never started"
    try:
        yield
    finally:
        thread.join(300)
    assert result.get("status") == 200, result
    assert result.get("finish") == "length", result
    assert result["usage"]["completion_tokens"] == STREAM_TOKENS, result


@contextmanager
def health_watched(system: System) -> Iterator[list[float]]:
    """Polls /health while the block runs; yields the latencies (each checked by the caller)."""
    latencies: list[float] = []
    failures: list[str] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=system.base_url, timeout=30) as http:
            while not done.is_set():
                start = time.monotonic()
                status = http.get("/health").status_code
                latencies.append(time.monotonic() - start)
                if status != 200:
                    failures.append(f"/health answered {status}")
                done.wait(0.05)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join(60)
    assert not failures, failures


def metric(system: System, name: str) -> float:
    """The sum of a Prometheus sample over its labels on the gateway's /metrics (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{system.base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def node_status(system: System) -> wire.NodeStatus:
    async def read() -> wire.NodeStatus:
        nc = await connection.connect(system.nats_url, name="test-node-status")
        try:
            entry = await (await nc.jetstream().key_value(topology.NODES_BUCKET)).get(NODE)
            return wire.node_decoder.decode(entry.value)
        finally:
            await nc.close()

    return asyncio.run(read())


def worker_compiles(system: System, since: float) -> tuple[int, int]:
    """(grammar compiles, shared compiles) of the worker's model, from a node entry written after `since`."""
    status = eventually(lambda: (s := node_status(system)).updated_at > since and s, 30,
                        message="the worker's node entry was not refreshed")
    model = next(m for m in status.models if m.model == system.model)
    return model.grammar_compiles, model.grammar_cache_hits


def post(system: System, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{system.base_url}{path}", json=body, timeout=120)


HOSTILE: dict[str, Callable[[System], tuple[str, dict, str]]] = {
    "chat-100k-choices": lambda s: ("/v1/chat/completions",
                                    chat(s, guided_choice=[f"choice {i}" for i in range(100_000)]), "guided_choice"),
    "chat-1mb-regex": lambda s: ("/v1/chat/completions", chat(s, structured_outputs={"regex": "a" * 1_000_000}),
                                 "structured_outputs"),
    "completions-100k-choices": lambda s: ("/v1/completions", {"model": s.model, "prompt": "Is it?", "max_tokens": 4,
                                           "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
                                           "structured_outputs"),
    "tokenize-60k-choices": lambda s: ("/tokenize", chat(s, guided_choice=[f"choice {i}" for i in range(60_000)]),
                                       "guided_choice"),
}


def test_grammars_past_their_bounds_are_refused_before_any_compile(system: System) -> None:
    gateway_before = metric(system, "helexa:gateway_grammar_compiles_total")
    worker_before = worker_compiles(system, 0.0)
    with concurrent_stream(system), health_watched(system) as latencies:
        for name, case in HOSTILE.items():
            path, body, param = case(system)
            response = post(system, path, body)
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == param, (name, response.text)
            assert len(response.content) < 2048, (name, "the refusal quotes what it refused")
        refused_at = time.time()
    assert latencies and max(latencies) < HEALTH_BOUND_S, max(latencies)
    assert metric(system, "helexa:gateway_grammar_compiles_total") == gateway_before
    assert worker_compiles(system, refused_at)[0] == worker_before[0]


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_string_schema_nested_5000_deep_is_a_400(system: System, field: str) -> None:
    schema = "[" * 5000
    body = chat(system, **({field: schema} if field == "guided_json" else {field: {"json": schema}}))
    response = post(system, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_the_choices_of_one_grammar_compile_once(system: System) -> None:
    tag = uuid.uuid4().hex[:6]  # a grammar no earlier test compiled
    choices = [f"yes {tag}", f"no {tag}"]
    gateway_before = metric(system, "helexa:gateway_grammar_compiles_total")
    compiles, shared = worker_compiles(system, 0.0)
    # Room for any tokenization of a choice: sampled at temperature 1 a choice may take a token per
    # character, and the default 8 cut one answer short ('length') in CI.
    body = chat(system, n=16, temperature=1.0, max_tokens=32, guided_choice=choices)
    response = post(system, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answers = [c["message"]["content"] for c in response.json()["choices"]]
    assert [c["finish_reason"] for c in response.json()["choices"]] == ["stop"] * 16, response.text
    assert len(answers) == 16 and set(answers) <= set(choices)
    assert metric(system, "helexa:gateway_grammar_compiles_total") == gateway_before + 1
    eventually(lambda: worker_compiles(system, 0.0)[1] >= shared + 15, 30,
               message="the worker's node entry did not show the 15 shared compiles")
    assert worker_compiles(system, time.time()) == (compiles + 1, shared + 15)
    assert metric(system, "helexa:grammar_compiles_total") >= compiles + 1


def _publish_to_worker(system: System, request: wire.GenerateRequest) -> list[wire.ReplyFrame]:
    """Publish `request` on the model's queue as a gateway would and collect its reply frames until
    a final or an error frame."""

    async def go() -> list[wire.ReplyFrame]:
        # As a gateway: workers send frames only to gateways' inboxes.
        nc = await connection.connect(system.nats_server.url_for(roles.GATEWAY), name="test-large-prompt",
                                    role=roles.GATEWAY)
        frames: list[wire.ReplyFrame] = []
        done = asyncio.Event()

        async def on_frame(msg: Any) -> None:
            frame = wire.frame_decoder.decode(msg.data)
            frames.append(frame)
            if isinstance(frame, wire.Final | wire.ErrorFrame):
                done.set()

        try:
            inbox = nc.new_inbox()
            await nc.subscribe(inbox, cb=on_frame)
            addressed = msgspec.structs.replace(request, reply_subject=inbox, deadline=time.time() + 120)
            await large_requests.publish_request(nc.jetstream(), nc, addressed)
            await asyncio.wait_for(done.wait(), 120)
            return frames
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_1mb_prompt_to_a_worker_is_refused_cleanly_while_other_streams_go_on(system: System) -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 25_000)[:1_000_000]
    request = wire.GenerateRequest(request_id=f"large-{uuid.uuid4().hex}", model=system.model, reply_subject="",
                                   messages=[wire.ChatMessage(role="user", content=text)],
                                   sampling=SamplingParams(max_tokens=4), api=Api.CHAT_COMPLETIONS)
    with concurrent_stream(system):
        frames = _publish_to_worker(system, request)
    error = frames[-1]
    assert isinstance(error, wire.ErrorFrame), frames[-1]
    assert error.status == 400 and error.code == "context_length_exceeded", error
    # Through the gateway the same prompt never reaches a worker.
    response = post(system, "/v1/chat/completions", chat(system, messages=[{"role": "user", "content": text}]))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


def test_tokenize_of_7mb_is_a_quick_400(system: System) -> None:
    text = "tok " * (7_000_000 // 4)
    with concurrent_stream(system):
        start = time.monotonic()
        response = post(system, "/tokenize", {"model": system.model, "prompt": text})
        elapsed = time.monotonic() - start
    assert response.status_code in (400, 413), response.text
    assert response.json()["error"]["param"] == "prompt"
    assert elapsed < 15, f"{elapsed:.1f} s: the refusal waited on something"


def test_token_endpoints_never_compile_a_grammar(system: System) -> None:
    before = metric(system, "helexa:gateway_grammar_compiles_total")
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    tokenized = post(system, "/tokenize", chat(system, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}))
    assert tokenized.status_code == 200, tokenized.text
    counted = post(system, "/v1/messages/count_tokens", {
        "model": system.model, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}})
    assert counted.status_code == 200, counted.text
    assert metric(system, "helexa:gateway_grammar_compiles_total") == before


def test_a_7mb_tokenize_sent_to_a_worker_is_a_413_not_a_lost_reply(system: System) -> None:
    """Past the gateway (a client on the bus): the worker tokenizes 7 MB in its pool, and the ids
    (more than the bus's 8 MiB) come back as a 413 instead of a reply the server refuses."""
    ask = wire.TokenizeRequest(model=system.model, request=wire.GenerateRequest(
        request_id="tokenize-big", model=system.model, reply_subject="", sampling=SamplingParams(),
        prompt="1 2 3 4 " * (7_000_000 // 8), api=Api.COMPLETIONS))

    async def go() -> wire.TokenizeReply:
        nc = await connection.connect(system.nats_url, name="test-tokenize-big")
        try:
            msg = await nc.request(topology.node_endpoint(NODE, "tokenize"), wire.encode(ask), timeout=120)
            return wire.tokenize_reply_decoder.decode(msg.data)
        finally:
            await nc.close()

    with concurrent_stream(system):
        reply = asyncio.run(go())
    assert reply.error is not None and reply.error.status == 413, reply.error
    assert not reply.token_ids
