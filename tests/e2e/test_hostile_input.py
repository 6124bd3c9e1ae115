"""Hostile input, on every generation endpoint, through a gateway without keys and one with keys:
each case gets its documented 4xx in its API's envelope, says nothing about internals, and is
never published (the REQUESTS stream's last sequence does not move), so no worker ever sees it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.bus import connection, topology
from apps.embedded import free_port
from engine.frontend.protocol import MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.e2e.conftest import System, scripted_worker
from tests.support import AppProcess, eventually

TARGET = "hostile-target"
KEY = "sk-hostile-0123456789"
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
RESPONSES, TOKENIZE = "/v1/responses", "/tokenize"
# SmolLM2's vocabulary (the scripted worker uses its tokenizer and reports the size).
VOCAB = 49152
LEAKS = ("Traceback", 'File "', "nats", "msgspec", "asyncpg", "Exception", "Recursion", "apps.", "engine.",
         "litestar")


# A stream the target answers slowly, beside hostile requests.
SLOW, SLOW_REPLY = "a slow stream, please", "one two three four five six seven eight nine ten"
# Past the scripted target's prompt bound (8192 tokens x 16 characters).
LONG = 8192 * 16 + 1


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def chat(**fields: Any) -> dict:
    return {"model": TARGET, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict:
    return {"model": TARGET, "prompt": "hi", "max_tokens": 4, **fields}


def response(**fields: Any) -> dict:
    return {"model": TARGET, "input": "hi", "max_output_tokens": 4, **fields}


def message(**fields: Any) -> dict:
    return {"model": TARGET, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


@dataclass(frozen=True)
class Case:
    path: str
    body: dict | bytes
    status: int = 400
    param: str | None = None
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})


def tool(name: str, parameters: Any = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def anthropic_tool(name: str, schema: Any = None) -> dict:
    return {"name": name, "input_schema": schema or {"type": "object"}}


TEXT = {"Content-Type": "text/plain"}
CASES: dict[str, Case] = {
    # chat completions
    "chat-text-plain": Case(CHAT, json.dumps(chat()).encode(), 415, headers=TEXT),
    "chat-form": Case(CHAT, b"model=x", 415, headers={"Content-Type": "application/x-www-form-urlencoded"}),
    "chat-no-content-type": Case(CHAT, json.dumps(chat()).encode(), 415, headers={}),
    "chat-model-257-bytes": Case(CHAT, chat(model="m" * 257), param="model"),
    "chat-model-4kb": Case(CHAT, chat(model="x" * 4096), param="model"),
    "chat-model-1400-dots": Case(CHAT, chat(model="." * 1400), param="model"),
    "chat-model-space": Case(CHAT, chat(model="hostile target"), param="model"),
    "chat-model-newline": Case(CHAT, chat(model="a\r\nPUB x 1"), param="model"),
    "chat-model-unicode": Case(CHAT, chat(model="модель"), param="model"),
    "chat-deep-body": Case(CHAT, chat(extra=nested(100))),
    "chat-deep-tool-parameters": Case(CHAT, chat(tools=[tool("f", {"type": "object", "x": nested(100)})])),
    "chat-deep-tool-call-arguments": Case(CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[" * 200 + "]" * 200}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]), param="messages"),
    # Text the chat template renders besides `content` counts toward the prompt's bound.
    "chat-tool-call-name-past-context": Case(CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f" * LONG, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]), param="messages"),
    "chat-tool-call-id-past-context": Case(CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c" * LONG, "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]), param="messages"),
    "chat-message-name-past-context": Case(CHAT, chat(messages=[{"role": "user", "content": "hi", "name": "n" * LONG}]),
                                           param="messages"),
    "chat-whole-logprobs-past-bound": Case(CHAT, chat(n=16, logprobs=True, top_logprobs=20, max_tokens=1000),
                                           param="top_logprobs"),
    "chat-17-stops": Case(CHAT, chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), param="stop"),
    "chat-stop-257-chars": Case(CHAT, chat(stop="x" * (MAX_STOP_STRING_BYTES + 1)), param="stop"),
    "chat-stop-300-bytes": Case(CHAT, chat(stop=["€" * 100]), param="stop"),
    "chat-stop-500kb": Case(CHAT, chat(stop=["y" * 500_000]), param="stop"),
    "chat-empty-stop": Case(CHAT, chat(stop=[""]), param="stop"),
    "chat-65-stop-token-ids": Case(CHAT, chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
                                   param="stop_token_ids"),
    "chat-150k-stop-token-ids": Case(CHAT, chat(stop_token_ids=[1] * 150_000), param="stop_token_ids"),
    "chat-stop-token-id-past-vocab": Case(CHAT, chat(stop_token_ids=[VOCAB]), param="stop_token_ids"),
    "chat-negative-stop-token-id": Case(CHAT, chat(stop_token_ids=[-1]), param="stop_token_ids"),
    "chat-logit-bias-1025-tokens": Case(CHAT, chat(logit_bias={str(i): 1 for i in range(1025)}), param="logit_bias"),
    "chat-logit-bias-not-a-token": Case(CHAT, chat(logit_bias={"abc": 1}), param="logit_bias"),
    "chat-logit-bias-past-100": Case(CHAT, chat(logit_bias={"5": 101}), param="logit_bias"),
    "chat-logit-bias-id-past-int64": Case(CHAT, chat(logit_bias={str(2**64): 1}), param="logit_bias"),
    "chat-logit-bias-past-vocab": Case(CHAT, chat(logit_bias={str(VOCAB): 1}), param="logit_bias"),
    "completions-logit-bias-negative-id": Case(COMPLETIONS, completion(logit_bias={"-3": 1}), param="logit_bias"),
    "chat-template-kwargs-own-variable": Case(CHAT, chat(chat_template_kwargs={"messages": []}),
                                              param="chat_template_kwargs"),
    "chat-template-kwargs-17": Case(CHAT, chat(chat_template_kwargs={f"v{i}": 1 for i in range(17)}),
                                    param="chat_template_kwargs"),
    "chat-template-kwargs-5kb": Case(CHAT, chat(chat_template_kwargs={"doc": "d" * 5000}),
                                     param="chat_template_kwargs"),
    "chat-template-kwargs-odd-name": Case(CHAT, chat(chat_template_kwargs={"a b": 1}), param="chat_template_kwargs"),
    "chat-reasoning-effort-33-chars": Case(CHAT, chat(reasoning_effort="e" * 33), param="reasoning_effort"),
    "chat-129-tools": Case(CHAT, chat(tools=[tool(f"f{i}") for i in range(129)]), param="tools"),
    "chat-2049-messages": Case(CHAT, chat(messages=[{"role": "user", "content": "hi"}] * 2049), param="messages"),
    "chat-no-messages": Case(CHAT, chat(messages=[]), param="messages"),
    "chat-seed-2-64": Case(CHAT, chat(seed=2**64), param="seed"),
    "chat-n-17": Case(CHAT, chat(n=17), param="n"),
    "chat-temperature-3": Case(CHAT, chat(temperature=3), param="temperature"),
    "chat-malformed-json": Case(CHAT, b'{"model": "hostile-target", "messages": ['),
    "chat-unknown-model": Case(CHAT, chat(model="no-such-hostile-model"), 404, param="model"),
    # text completions
    "completions-text-plain": Case(COMPLETIONS, json.dumps(completion()).encode(), 415, headers=TEXT),
    "completions-model-4kb": Case(COMPLETIONS, completion(model="x" * 4096), param="model"),
    "completions-prompt-id-past-vocab": Case(COMPLETIONS, completion(prompt=[1, 2, VOCAB + 7]), param="prompt"),
    "completions-negative-prompt-id": Case(COMPLETIONS, completion(prompt=[1, -5]), param="prompt"),
    "completions-17-stops": Case(COMPLETIONS, completion(stop=["a"] * 17), param="stop"),
    "completions-stop-token-id-past-vocab": Case(COMPLETIONS, completion(stop_token_ids=[10**9]),
                                                 param="stop_token_ids"),
    "completions-deep-body": Case(COMPLETIONS, completion(prompt=nested(80))),
    "completions-zero-max-tokens": Case(COMPLETIONS, completion(max_tokens=0), param="max_tokens"),
    "completions-malformed-json": Case(COMPLETIONS, b"{]"),
    # Anthropic messages
    "messages-text-plain": Case(MESSAGES, json.dumps(message()).encode(), 415, headers=TEXT),
    "messages-model-4kb": Case(MESSAGES, message(model="x" * 4096)),
    "messages-model-dots": Case(MESSAGES, message(model="." * 1400)),
    "messages-thinking-type-33-chars": Case(MESSAGES, message(thinking={"type": "t" * 33}), param="thinking"),
    "messages-60k-stop-sequences": Case(MESSAGES, message(stop_sequences=["z"] * 60_000)),
    "messages-stop-sequence-300-bytes": Case(MESSAGES, message(stop_sequences=["€" * 100])),
    "messages-stop-sequence-500kb": Case(MESSAGES, message(stop_sequences=["q" * 500_000])),
    "messages-129-tools": Case(MESSAGES, message(tools=[anthropic_tool(f"t{i}") for i in range(129)])),
    "messages-deep-tool-schema": Case(MESSAGES, message(tools=[anthropic_tool("t", {"x": nested(100)})])),
    "messages-deep-tool-use-input": Case(MESSAGES, message(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "t", "input": {"x": nested(100)}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}])),
    "messages-tool-use-name-past-context": Case(MESSAGES, message(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "t" * LONG, "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}])),
    "messages-2049-messages": Case(MESSAGES, message(messages=[{"role": "user", "content": "hi"}] * 2049)),
    "messages-zero-max-tokens": Case(MESSAGES, message(max_tokens=0)),
    "messages-temperature-1.5": Case(MESSAGES, message(temperature=1.5)),
    "messages-malformed-json": Case(MESSAGES, b'{"model": '),
    # the Responses API
    "responses-text-plain": Case(RESPONSES, json.dumps(response()).encode(), 415, headers=TEXT),
    "responses-model-4kb": Case(RESPONSES, response(model="x" * 4096), param="model"),
    "responses-deep-body": Case(RESPONSES, response(input=[{"role": "user", "content": "hi", "x": nested(100)}])),
    "responses-2049-items": Case(RESPONSES, response(input=[{"role": "user", "content": "hi"}] * 2049), param="input"),
    "responses-129-tools": Case(RESPONSES, response(tools=[{"type": "function", "name": f"f{i}"} for i in range(129)]),
                                param="tools"),
    "responses-deep-function-arguments": Case(RESPONSES, response(input=[
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * 200 + "]" * 200},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]), param="input"),
    "responses-function-call-name-past-context": Case(RESPONSES, response(input=[
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f" * LONG, "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]), param="input"),
    # More arrays and objects than a body may hold (decoding builds each, in one call on the loop),
    # in a tool's untyped schema, and in tool-call arguments that are each within the bound.
    "chat-tool-parameters-300k-objects": Case(CHAT, chat(tools=[tool("f", {"type": "object",
                                                                           "x": [{}] * 300_000})])),
    "messages-input-schema-300k-arrays": Case(MESSAGES, message(tools=[anthropic_tool("f", {"type": "object",
                                                                                          "x": [[]] * 300_000})])),
    "responses-function-call-arguments-300k-arrays": Case(RESPONSES, response(input=[
        {"role": "user", "content": "hi"},
        *({"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": json.dumps([[]] * 100_000)}
          for i in range(3)),
        {"type": "function_call_output", "call_id": "c0", "output": "x"}]), param="input"),
    "responses-unknown-item": Case(RESPONSES, response(input=[{"type": "computer_call", "id": "x"}]), param="input"),
    "responses-zero-max-output-tokens": Case(RESPONSES, response(max_output_tokens=0), param="max_output_tokens"),
    "responses-temperature-3": Case(RESPONSES, response(temperature=3), param="temperature"),
    "responses-previous-id-4kb": Case(RESPONSES, response(previous_response_id="r" * 4096),
                                      param="previous_response_id"),
    "responses-malformed-json": Case(RESPONSES, b'{"model": "hostile-target", "input": ['),
    # token counting
    "tokenize-text-plain": Case(TOKENIZE, json.dumps({"model": TARGET, "prompt": "hi"}).encode(), 415, headers=TEXT),
    "tokenize-2049-messages": Case(TOKENIZE, {"model": TARGET, "messages": [{"role": "user", "content": "hi"}] * 2049},
                                   param="messages"),
    "tokenize-deep-body": Case(TOKENIZE, {"model": TARGET, "prompt": "hi", "x": nested(100)}),
}


@pytest.fixture(scope="module")
def target(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = {"rules": [{"match": SLOW, "reply": SLOW_REPLY, "token_delay_s": 0.1}], "default": "fine"}
    with scripted_worker(system, tmp_path_factory.mktemp("hostile"), TARGET, script):
        # The target's vocabulary size must be known to the gateways before the vocabulary cases run.
        eventually(lambda: any(m["id"] == TARGET for m in httpx.get(f"{system.base_url}/v1/models").json()["data"]),
                   30)
        yield TARGET


@pytest.fixture(scope="module")
def keyed_url(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys: Path = tmp_path_factory.mktemp("hostile-keys") / "keys.txt"
    keys.write_text(f"{KEY} mallory\n")
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_API_KEYS": str(keys)})
    try:
        gateway.wait_ready()
        url = f"http://127.0.0.1:{port}"
        eventually(lambda: httpx.get(f"{url}/ready").status_code == 200, 30)
        yield url
    finally:
        gateway.stop()


def published(system: System) -> int:
    """How many requests the REQUESTS stream has ever stored (its last sequence)."""

    async def last_seq() -> int:
        nc = await connection.connect(system.nats_url, name="test")
        try:
            return (await nc.jetstream().stream_info(topology.REQUESTS_STREAM)).state.last_seq
        finally:
            await nc.close()

    return asyncio.run(last_seq())


def send(url: str, case: Case, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as http:
        body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        return http.post(case.path, content=body, headers={**case.headers, **headers})


def assert_envelope(case: Case, response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    for leak in LEAKS:
        assert leak not in response.text, (leak, response.text)
    body = response.json()
    if case.path == MESSAGES:
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if status != 401 and case.param is not None:
        assert body["error"]["param"] == case.param, body


def test_the_suite_is_big_enough() -> None:
    assert len(CASES) >= 40
    assert {c.path for c in CASES.values()} == {CHAT, COMPLETIONS, MESSAGES, RESPONSES, TOKENIZE}


@pytest.mark.parametrize("keyed", [False, True], ids=["no-keys", "with-key"])
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_refused_before_the_bus(system: System, target: str, keyed_url: str, keyed: bool,
                                                 name: str) -> None:
    case = CASES[name]
    url, headers = (keyed_url, {"Authorization": f"Bearer {KEY}"}) if keyed else (system.base_url, {})
    before = published(system)
    assert_envelope(case, send(url, case, headers), case.status)
    assert published(system) == before, "an invalid request reached the bus"


@pytest.mark.parametrize("name", ["chat-deep-body", "completions-text-plain", "messages-60k-stop-sequences"])
def test_hostile_input_without_a_key_is_401_first(system: System, target: str, keyed_url: str, name: str) -> None:
    case = CASES[name]
    before = published(system)
    assert_envelope(case, send(keyed_url, case, {}), 401)
    assert published(system) == before


def test_a_valid_request_still_reaches_the_target(system: System, target: str, keyed_url: str) -> None:
    """The control: the same gateways do publish (and the worker answers) a valid request."""
    before = published(system)
    response = send(keyed_url, Case(CHAT, chat(stop=["a"] * 16, stop_token_ids=[VOCAB - 1] * 64)),
                    {"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "fine"
    assert published(system) == before + 1


# The bounds added with the template's text count, the logprobs of a whole answer, logit_bias and
# the chat template's extra variables, the count of arrays and objects.
NEWER_BOUNDS = ["chat-tool-call-name-past-context", "chat-tool-call-id-past-context", "chat-message-name-past-context",
                "messages-tool-use-name-past-context", "responses-function-call-name-past-context",
                "chat-whole-logprobs-past-bound", "chat-logit-bias-1025-tokens", "chat-logit-bias-id-past-int64",
                "chat-logit-bias-past-vocab", "chat-template-kwargs-own-variable", "chat-template-kwargs-5kb",
                "chat-reasoning-effort-33-chars", "messages-thinking-type-33-chars",
                "chat-tool-parameters-300k-objects", "messages-input-schema-300k-arrays",
                "responses-function-call-arguments-300k-arrays"]


def test_newer_bounds_refuse_by_name_while_a_stream_beside_them_runs_to_its_end(system: System, target: str) -> None:
    async def scenario() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=system.base_url, timeout=60) as http:
            async def stream() -> str:
                text = []
                body = chat(messages=[{"role": "user", "content": SLOW}], max_tokens=64, stream=True)
                async with http.stream("POST", CHAT, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
                return "".join(text)

            streaming = asyncio.create_task(stream())
            answers = [await http.post(CASES[name].path, content=json.dumps(CASES[name].body).encode(),
                                       headers=CASES[name].headers) for name in NEWER_BOUNDS]
            return await streaming, answers

    before = published(system)
    text, answers = asyncio.run(scenario())
    for name, answer in zip(NEWER_BOUNDS, answers, strict=True):
        assert_envelope(CASES[name], answer, 400)
    assert text == SLOW_REPLY
    assert published(system) == before + 1  # the stream alone reached the bus
