"""No request, however hostile, changes what another request gets (issue 13's isolation tests).

While one long greedy stream runs on the real default model, each destructive case is sent: values
that pass validation but once broke the sampler for the whole batch (a temperature of 1e-38, a
repetition penalty of 1e-300, seeds at the ends of int64, a seed overflow through n=2), values the
gateway must refuse (a seed past int64, model names that once closed the gateway's NATS connection,
deeply nested JSON), and a second bus message reusing the running request's id. The long stream
still finishes with `finish_reason: "length"` and its full token count, its text is the greedy
text it has alone, the model is not poisoned, and `/ready` stays 200.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import httpx

from apps.bus import connection, roles, topology, wire
from engine.frontend.protocol import SamplingParams
from tests.e2e.conftest import System
from tests.e2e.test_chat import finished_run
from tests.system import read_chat_stream

LONG_TOKENS = 200
LONG = {"messages": [{"role": "user", "content": "Tell me everything you know about the sea."}],
        "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"a": value}
    return value


def _short(model: str, **fields: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, **fields}


def _served_cases(model: str) -> dict[str, dict]:
    """Valid requests that once broke every request sharing their batch."""
    return {
        "tiny-temperature": _short(model, temperature=1e-38),
        "tiny-repetition-penalty": _short(model, temperature=1.0, repetition_penalty=1e-300),
        "tiny-repetition-penalty-greedy": _short(model, temperature=0, repetition_penalty=1e-300),
        "largest-seed-n2": _short(model, temperature=1.0, seed=2**63 - 1, n=2),
        "smallest-seed": _short(model, temperature=1.0, seed=-(2**63)),
    }


def _refused_cases(model: str) -> dict[str, tuple[dict, str]]:
    """Invalid requests: a 400 naming the parameter, and nothing published."""
    return {
        "seed-past-int64": (_short(model, seed=2**64), "seed"),
        "model-4kb": (_short("x" * 4096), "model"),
        "model-1400-dots": (_short("." * 1400), "model"),
        "deep-json": (_short(model, extra=_nested(200)), None),
        "deep-tool-schema": (_short(model, tools=[{"type": "function", "function": {
            "name": "f", "parameters": _nested(200)}}]), None),
    }


async def _duplicate_delivery(system: System, model: str, request_id: str) -> wire.ErrorFrame:
    """A second message on the bus under the running request's id; its own reply is an error."""
    # As a gateway: workers send frames only to gateways' inboxes.
    nc = await connection.connect(system.nats_server.url_for(roles.GATEWAY), "test-duplicate", role=roles.GATEWAY)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        request = wire.GenerateRequest(request_id=request_id, model=model, reply_subject=inbox,
                                       sampling=SamplingParams(max_tokens=4), prompt="hi")
        # Its own message id: the stream's dedupe window would drop a second one under the request id.
        await nc.jetstream().publish(topology.request_subject(model), wire.encode(request),
                                     headers={"Nats-Msg-Id": uuid.uuid4().hex})
        while True:
            frame = wire.frame_decoder.decode((await sub.next_msg(timeout=60)).data)
            if isinstance(frame, wire.ErrorFrame | wire.Final):
                assert isinstance(frame, wire.ErrorFrame), frame
                return frame
    finally:
        await nc.close()


def _stream_long(system: System, first_text: threading.Event, out: dict) -> None:
    body = {"model": system.model, "stream": True, "stream_options": {"include_usage": True}, **LONG}
    with httpx.Client(base_url=system.base_url, timeout=600) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            out["request_id"] = response.headers["X-Request-Id"]
            read = read_chat_stream(response, first_text)
    assert not read.pop("errors"), read
    out.update(read)


def test_a_long_stream_survives_every_destructive_request(system: System) -> None:
    with httpx.Client(base_url=system.base_url, timeout=600) as http:
        alone = http.post("/v1/chat/completions", json={"model": system.model, **LONG}).json()
        assert alone["choices"][0]["finish_reason"] == "length"

        first_text, out = threading.Event(), {}
        long_stream = threading.Thread(target=_stream_long, args=(system, first_text, out))
        long_stream.start()
        try:
            assert first_text.wait(300), "the long stream never produced text"
            served = {}
            for name, body in _served_cases(system.model).items():
                response = http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, (name, response.text)
                served[name] = response.json()
            for name, (body, param) in _refused_cases(system.model).items():
                response = http.post("/v1/chat/completions", json=body)
                assert response.status_code == 400, (name, response.text)
                assert response.json()["error"]["param"] == param, name
            frame = asyncio.run(_duplicate_delivery(system, system.model, out["request_id"]))
            assert frame.status == 409, frame
            # Everything above happened while the long stream was still generating.
            assert long_stream.is_alive(), "the long stream ended before the destructive cases were sent"
        finally:
            long_stream.join(600)

    assert out["finish"] == "length", out
    assert out["usage"]["completion_tokens"] == LONG_TOKENS
    assert out["text"] == alone["choices"][0]["message"]["content"]
    for name, reply in served.items():
        assert all(c["finish_reason"] in ("length", "stop") for c in reply["choices"]), (name, reply)
    row = asyncio.run(finished_run(system, out["request_id"]))
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("ok", "length", LONG_TOKENS)
    ready = httpx.get(f"{system.base_url}/ready", timeout=30)
    assert ready.status_code == 200 and system.model in ready.json()["models"], ready.text
    # Still serving, not poisoned.
    after = httpx.post(f"{system.base_url}/v1/chat/completions", json=_short(system.model, temperature=0),
                       timeout=300)
    assert after.status_code == 200, after.text
