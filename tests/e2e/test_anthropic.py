"""The Anthropic Messages API end to end: the anthropic SDK → gateway /v1/messages → NATS → worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from apps.bus import connection, topology, wire
from apps.embedded import free_port
from apps.gateway.api import anthropic_schema as an
from apps.gateway.api.anthropic import to_bus_request
from apps.gateway.api.validate import decode_body
from tests.e2e.conftest import System, scripted_worker
from tests.e2e.test_chat import finished_run
from tests.support import AppProcess

SYSTEM = "You are a geography teacher. Answer in one short sentence."
QUESTION = "What is the capital of France?"
MAX_TOKENS = 32
SCRIPTED = "scripted-anthropic"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current temperature in a city, in degrees Celsius.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Rules match the rendered prompt and the first match wins; the second turn still holds the
# question, so the rule for the tool result comes first.
SCRIPT = {
    "rules": [
        # Forced tool calls and prefills end the prompt; the reply goes on from there.
        {"match": '<tool_call>\n{"name": "get_weather", "arguments": ', "reply": '{"city": "Paris"}}\n</tool_call>'},
        {"match": "Use a tool now.<|im_end|>\n<|im_start|>assistant\n<tool_call>\n",
         "reply": '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"match": "The capital is<|im_end|>", "reply": "CLOSED"},
        {"match": "Name the capital", "reply": " Paris."},
        {"match": "18", "reply": "It is 18 degrees in Paris."},
        {"match": "weather in Paris",
         "reply": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"match": "think it over", "reply": "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."},
    ],
    "default": "ok",
}
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
              "message_delta", "message_stop"}


def client(system: System) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=120)


def ask(system: System, **kwargs: object) -> dict:
    # This SDK no longer types the sampling parameters; older ones and raw clients still send them.
    return dict(model=system.model, max_tokens=MAX_TOKENS, system=SYSTEM, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}]) | kwargs


def raw_body(system: System, **fields: object) -> dict:
    """The same request as JSON clients send it; a field set to None is left out."""
    body = {"model": system.model, "max_tokens": MAX_TOKENS, "system": SYSTEM, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]} | fields
    return {k: v for k, v in body.items() if v is not None}


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.fixture(scope="module")
def scripted(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second worker that replies from SCRIPT, so tool calls and thoughts happen when we say;
    SmolLM2's template has no <think>, so the reasoning parser is switched on by hand."""
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SCRIPTED, SCRIPT):
        yield SCRIPTED


@pytest.fixture(scope="module")
def greedy(system: System) -> anthropic.types.Message:
    """The question answered at temperature 0, which later tests compare against."""
    return client(system).messages.create(**ask(system))


def test_create_with_system_prompt_matches_chat_completions(system: System, greedy: anthropic.types.Message) -> None:
    assert greedy.type == "message" and greedy.role == "assistant"
    assert greedy.id.startswith("msg_")
    assert greedy.model == system.model
    assert [block.type for block in greedy.content] == ["text"]
    assert "Paris" in text_of(greedy)
    assert greedy.stop_reason in ("end_turn", "max_tokens")
    assert greedy.stop_sequence is None
    assert greedy.usage.input_tokens > 0 and greedy.usage.output_tokens > 0

    chat = OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reference = chat.chat.completions.create(
        model=system.model, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert text_of(greedy) == reference.choices[0].message.content
    assert greedy.usage.input_tokens == reference.usage.prompt_tokens
    assert greedy.usage.output_tokens == reference.usage.completion_tokens
    expected = {"stop": "end_turn", "length": "max_tokens"}[reference.choices[0].finish_reason]
    assert greedy.stop_reason == expected


def test_top_k_1_is_greedy(system: System, greedy: anthropic.types.Message) -> None:
    sampled = client(system).messages.create(**ask(system, extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9}))
    assert text_of(sampled) == text_of(greedy)


def test_the_request_id_is_where_the_sdk_reads_it(system: System, greedy: anthropic.types.Message) -> None:
    # Anthropic's SDK reads `request-id` (OpenAI's `x-request-id`), on answers and on refusals.
    assert greedy._request_id == greedy.id
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(system).messages.create(**ask(system, max_tokens=10**6))
    assert refused.value.request_id is not None and refused.value.request_id.startswith("msg_")


def test_the_models_list_and_retrieve_as_the_anthropic_sdk_reads_them(system: System) -> None:
    listed = client(system).models.list()
    entry = next(m for m in listed.data if m.id == system.model)
    assert entry.type == "model" and entry.display_name == system.model
    assert entry.created_at.tzinfo is not None and entry.created_at.year >= 2026
    assert client(system).models.retrieve(system.model) == entry
    with pytest.raises(anthropic.NotFoundError):
        client(system).models.retrieve("not-served")


def test_max_tokens_is_the_stop_reason(system: System) -> None:
    message = client(system).messages.create(**ask(system, max_tokens=3))
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3


def test_stream_events_and_final_message(system: System, greedy: anthropic.types.Message) -> None:
    with client(system).messages.stream(**ask(system)) as stream:
        events = [e for e in stream if e.type in RAW_EVENTS]
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.id == final.id and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == greedy.usage.input_tokens
    assert events[1].index == 0 and events[1].content_block.type == "text" and events[1].content_block.text == ""
    deltas = events[2:-3]
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in deltas)
    assert len(deltas) > 1, "the answer should arrive in several deltas"
    assert "".join(e.delta.text for e in deltas) == text_of(final) == text_of(greedy)
    assert events[-2].delta.stop_reason == final.stop_reason == greedy.stop_reason
    assert final.usage.input_tokens == greedy.usage.input_tokens
    assert final.usage.output_tokens == events[-2].usage.output_tokens == greedy.usage.output_tokens


def test_stop_sequences_cut_the_text(system: System, greedy: anthropic.types.Message) -> None:
    full = text_of(greedy)
    assert "Paris" in full
    message = client(system).messages.create(**ask(system, stop_sequences=["Paris"]))
    cut = text_of(message)
    assert full.startswith(cut) and "Paris" not in cut
    assert len(cut) < len(full)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"

    with client(system).messages.stream(**ask(system, stop_sequences=["Paris"])) as stream:
        assert "".join(stream.text_stream) == cut
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"


def raw_post(system: System, body: bytes | dict) -> httpx.Response:
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        if isinstance(body, bytes):
            return http.post("/v1/messages", content=body, headers={"Content-Type": "application/json"})
        return http.post("/v1/messages", json=body)


def assert_envelope(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert body["error"]["message"]
    for leak in ("Traceback", 'File "', "nats", "msgspec", "asyncpg", "Exception", "$."):
        assert leak not in response.text
    return body["error"]["message"]


def test_unknown_model_is_404_in_the_anthropic_envelope(system: System) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(system).messages.create(**ask(system, model="no-such-model"))
    assert caught.value.status_code == 404
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"

    response = raw_post(system, raw_body(system, model="no-such-model", stream=True))
    assert "no-such-model" in assert_envelope(response, 404, "not_found_error")


def test_known_model_without_worker_is_503_with_retry_after(system: System) -> None:
    async def remember_model() -> None:
        nc = await connection.connect(system.nats_url, name="test")
        js = nc.jetstream()
        await js.add_consumer(topology.REQUESTS_STREAM, config=topology.worker_consumer_config("offline-messages"))
        await nc.close()

    asyncio.run(remember_model())
    response = raw_post(system, raw_body(system, model="offline-messages", stream=True))
    assert_envelope(response, 503, "overloaded_error")
    assert int(response.headers["Retry-After"]) >= 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ],
    ids=["missing-max-tokens", "zero-max-tokens", "string-temperature", "temperature-above-1", "no-messages",
         "system-role-message", "empty-stop-sequence", "tool-choice-without-tools", "tool-choice-unknown-tool"],
)
def test_invalid_request_is_400_naming_the_field(system: System, body: dict, field: str) -> None:
    response = raw_post(system, raw_body(system, **body))
    assert field in assert_envelope(response, 400, "invalid_request_error")


def test_malformed_json_is_400(system: System) -> None:
    assert_envelope(raw_post(system, b'{"model": "x", "messages": ['), 400, "invalid_request_error")


def test_image_block_is_400_not_supported(system: System) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    content = [image, {"type": "text", "text": "What is in this picture?"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(system).messages.create(**ask(system, messages=[{"role": "user", "content": content}]))
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "not supported" in caught.value.body["error"]["message"]


def test_unknown_fields_are_ignored(system: System) -> None:
    request = raw_body(system, max_tokens=3, metadata={"user_id": "u-1"}, service_tier="auto",
                       something_new={"x": 1})
    response = raw_post(system, request)
    assert response.status_code == 200, response.text
    assert response.json()["stop_reason"] == "max_tokens"


@dataclass
class KeyedGateway:
    base_url: str
    key: str
    principal: str


@pytest.fixture(scope="module")
def keyed_gateway(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedGateway]:
    """A second gateway on the same bus that wants API keys and gives up on a silent worker after 2 s."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("sk-anthropic-test alice\n", encoding="utf-8")
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_API_KEYS": str(keys), "HELEXA_STREAM_IDLE_TIMEOUT_S": "2",
                                       # The lost-worker test's one worker is frozen: nowhere to migrate to.
                                       "HELEXA_MAX_MIGRATIONS": "0"})
    try:
        gateway.wait_ready()
        yield KeyedGateway(f"http://127.0.0.1:{port}", "sk-anthropic-test", "alice")
    finally:
        gateway.stop()


@pytest.mark.parametrize("key", [None, "sk-wrong"], ids=["no-key", "wrong-key"])
def test_api_key_missing_or_wrong_is_401(keyed_gateway: KeyedGateway, system: System, key: str | None) -> None:
    headers = {"x-api-key": key} if key else {}
    with httpx.Client(base_url=keyed_gateway.base_url, timeout=60) as http:
        response = http.post("/v1/messages", json=raw_body(system), headers=headers)
    assert_envelope(response, 401, "authentication_error")
    assert "sk-" not in response.text

    wrong = anthropic.Anthropic(base_url=keyed_gateway.base_url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**ask(system))


def test_api_key_principal_is_recorded(keyed_gateway: KeyedGateway, system: System) -> None:
    keyed = anthropic.Anthropic(base_url=keyed_gateway.base_url, api_key=keyed_gateway.key, max_retries=0,
                                timeout=60)
    message = keyed.messages.create(**ask(system, max_tokens=3))
    row = asyncio.run(finished_run(system, message.id))
    assert row["principal"] == keyed_gateway.principal
    assert row["completion_tokens"] == message.usage.output_tokens == 3


def test_worker_lost_mid_stream_sends_an_error_event(keyed_gateway: KeyedGateway, system: System,
                                                     tmp_path: Path) -> None:
    """A worker frozen after its first tokens: the status is already 200, so the stream ends in an
    Anthropic `error` event once the gateway gives up on the silent worker. The scripted reply is
    long enough that it cannot finish before the freeze lands."""
    with scripted_worker(system, tmp_path, "frozen", {"rules": [], "default": "word " * 6000}) as worker:
        try:
            keyed = anthropic.Anthropic(base_url=keyed_gateway.base_url, api_key=keyed_gateway.key, max_retries=0,
                                        timeout=60)
            request = ask(system, model="frozen", max_tokens=2048,  # the scripted model's output limit
                          messages=[{"role": "user", "content": "Write a long story about a dragon."}])
            seen: list[str] = []
            with pytest.raises(anthropic.APIStatusError) as caught:
                for event in keyed.messages.create(**request, stream=True):
                    if event.type == "content_block_delta" and "content_block_delta" not in seen:
                        os.kill(worker.process.pid, signal.SIGSTOP)
                    seen.append(event.type)
            assert seen[:3] == ["message_start", "content_block_start", "content_block_delta"]
            assert "message_stop" not in seen
            error = caught.value.body
            assert error == {"type": "error",
                             "error": {"type": "overloaded_error", "message": error["error"]["message"]}}
            assert "stopped responding" in error["error"]["message"]
        finally:
            if worker.process.poll() is None:
                os.kill(worker.process.pid, signal.SIGCONT)


def weather_question(model: str) -> dict:
    return dict(model=model, max_tokens=64, tools=[WEATHER_TOOL],
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])


def answer_with_tool_result(request: dict, tool_use: anthropic.types.ToolUseBlock) -> dict:
    return request | {"messages": [
        *request["messages"],
        {"role": "assistant", "content": [tool_use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18"}]},
    ]}


def only_tool_use(message: anthropic.types.Message) -> anthropic.types.ToolUseBlock:
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1
    assert all(not block.text.strip() for block in message.content if block.type == "text")
    assert uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"} and uses[0].id
    return uses[0]


def test_tool_use_round_trip(system: System, scripted: str) -> None:
    request = weather_question(scripted)
    tool_use = only_tool_use(client(system).messages.create(**request))

    answer = client(system).messages.create(**answer_with_tool_result(request, tool_use))
    assert answer.stop_reason == "end_turn"
    assert [block.type for block in answer.content] == ["text"]
    assert text_of(answer) == "It is 18 degrees in Paris."


def test_tool_use_round_trip_streamed(system: System, scripted: str) -> None:
    request = weather_question(scripted)
    with client(system).messages.stream(**request) as stream:
        events = [e for e in stream if e.type in RAW_EVENTS]
        message = stream.get_final_message()
    tool_use = only_tool_use(message)
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.input == {}
    json_deltas = [e.delta.partial_json for e in events
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(json_deltas)) == {"city": "Paris"}
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]

    with client(system).messages.stream(**answer_with_tool_result(request, tool_use)) as stream:
        text = "".join(stream.text_stream)
        answer = stream.get_final_message()
    assert text == text_of(answer) == "It is 18 degrees in Paris."
    assert answer.stop_reason == "end_turn"


def test_reasoning_becomes_a_thinking_block(system: System, scripted: str) -> None:
    request = dict(model=scripted, max_tokens=64, messages=[{"role": "user", "content": "Please think it over."}])
    message = client(system).messages.create(**request)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "Two plus two is four."
    assert message.content[1].text.strip() == "The answer is 4."
    assert message.stop_reason == "end_turn"

    with client(system).messages.stream(**request) as stream:
        events = [e for e in stream if e.type in RAW_EVENTS]
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "thinking", "text"}) for b in message.content]
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == [(0, "thinking"), (1, "text")] and stops == [0, 1]
    kinds = {(e.index, e.delta.type) for e in events if e.type == "content_block_delta"}
    assert kinds == {(0, "thinking_delta"), (1, "text_delta")}


def test_conversation_translates_to_template_messages() -> None:
    """What the worker's chat template is given for a tool conversation (no bus needed)."""
    body = {
        "model": "m", "max_tokens": 8, "stop_sequences": ["\n\n"], "top_k": 5,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18"}]},
                {"type": "text", "text": "Thanks."},
            ]},
        ],
    }
    req = decode_body(json.dumps(body).encode(), an.MessagesRequest)
    bus = to_bus_request(req, "msg_1", principal="alice")
    assert bus.api == "messages" and bus.principal == "alice"
    assert (bus.sampling.max_tokens, bus.sampling.stop, bus.sampling.top_k) == (8, ["\n\n"], 5)
    assert bus.messages == [
        wire.ChatMessage(role="system", content="Be brief.\nUse tools."),
        wire.ChatMessage(role="user", content="Weather?"),
        wire.ChatMessage(role="assistant", content="Checking.", tool_calls=[
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]),
        wire.ChatMessage(role="tool", content="18", tool_call_id="toolu_1", name="get_weather"),
        wire.ChatMessage(role="user", content="Thanks."),
    ]
    assert bus.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER_TOOL["description"], "parameters": WEATHER_TOOL["input_schema"]}}]

    body["tool_choice"] = {"type": "none"}
    req = decode_body(json.dumps(body).encode(), an.MessagesRequest)
    assert to_bus_request(req, "msg_2").tools is None


def test_assistant_prefill_is_continued(system: System, scripted: str) -> None:
    message = client(system).messages.create(model=scripted, max_tokens=16, messages=[
        {"role": "user", "content": "Name the capital of France."},
        {"role": "assistant", "content": "The capital is"}])
    # The reply holds only what follows the prefill, as Anthropic's API does.
    assert text_of(message) == " Paris."
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "named"])
def test_tool_choice_forces_tool_use(system: System, scripted: str, choice: dict) -> None:
    request = dict(model=scripted, max_tokens=64, tools=[WEATHER_TOOL], tool_choice=choice,
                   messages=[{"role": "user", "content": "Use a tool now."}])
    only_tool_use(client(system).messages.create(**request))
    unforced = client(system).messages.create(**{**request, "tool_choice": {"type": "auto"}})
    assert text_of(unforced) == "ok" and unforced.stop_reason == "end_turn"
