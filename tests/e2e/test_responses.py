"""The Responses API end to end through the `openai` SDK: whole and streamed answers checked field by
field against the SDK's own types in strict mode, function tools and reasoning items (a scripted
worker), and stored conversations (`previous_response_id`) read back from PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.e2e.conftest import System, scripted_worker

SCRIPTED = "scripted-responses"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current temperature in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": False}
SCRIPT = {
    "rules": [
        # A forced call's opening ends the prompt; the reply goes on from there.
        {"match": '<tool_call>\n{"name": "get_weather", "arguments": ', "reply": '{"city": "Lyon"}}\n</tool_call>'},
        # First match wins: the follow-up turn still holds the question.
        {"match": "18 degrees", "reply": "It is 18 degrees in Paris."},
        {"match": "weather in Paris",
         "reply": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"match": "think it over", "reply": "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."},
        {"match": "fail now", "reply": "", "fault": "error"},
    ],
    "default": "ok",
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scripted(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SCRIPTED, SCRIPT):
        yield SCRIPTED


def create_raw(system: System, **body: Any) -> dict[str, Any]:
    """A whole response as JSON, validated against the SDK's `Response` in strict mode."""
    raw = client(system).responses.with_raw_response.create(**body)
    data = raw.http_response.json()
    Response.model_validate(data, strict=True)
    return data


def stream_events(system: System, **body: Any) -> list[Any]:
    """Every streamed event, each validated against the SDK's event union in strict mode."""
    events = []
    with httpx.stream("POST", f"{system.base_url}/v1/responses", json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == kind
                events.append(EVENTS.validate_python(data, strict=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_create_answers_like_chat_completions(system: System) -> None:
    data = create_raw(system, model=system.model, input=QUESTION, instructions="Answer in one short sentence.",
                      max_output_tokens=24, temperature=0)
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["status"] in ("completed", "incomplete") and data["model"] == system.model
    assert data["instructions"] == "Answer in one short sentence."
    (message,) = data["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == data["status"]
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    chat = client(system).chat.completions.create(
        model=system.model, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": QUESTION}])
    assert part["text"] == chat.choices[0].message.content
    usage = data["usage"]
    assert usage["input_tokens"] == chat.usage.prompt_tokens
    assert usage["output_tokens"] == chat.usage.completion_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if data["status"] == "incomplete":
        assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    sdk = client(system).responses.create(model=system.model, input=QUESTION,
                                          instructions="Answer in one short sentence.",
                                          max_output_tokens=24, temperature=0)
    assert sdk.output_text == part["text"]


def test_stream_sends_the_semantic_events_in_order(system: System) -> None:
    body = dict(model=system.model, input=QUESTION, max_output_tokens=5, temperature=0)
    events = stream_events(system, **body)
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 5 tokens cannot finish an answer
    assert set(types[4:-4]) == {"response.output_text.delta"}
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert events[-4].text == text == final.output_text
    assert final.usage.output_tokens == 5 and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == create_raw(system, **body)["output"][0]["content"][0]["text"]

    # The SDK's own stream helper accumulates the same response (it wants one that completed).
    whole = {**body, "max_output_tokens": 32}
    with client(system).responses.stream(**whole) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == create_raw(system, **whole)["output"][0]["content"][0]["text"]
    assert final.output_text.startswith(text)


def test_reasoning_comes_as_a_reasoning_item(system: System, scripted: str) -> None:
    data = create_raw(system, model=scripted, input="Please think it over.")
    reasoning, message = data["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nTwo plus two is four.\n"}]
    assert message["content"][0]["text"] == "The answer is 4."
    assert data["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    events = stream_events(system, model=scripted, input="Please think it over.")
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_item.added", 3)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "\nTwo plus two is four.\n"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_call_round_trip(system: System, scripted: str, stream: bool) -> None:
    body = dict(model=scripted, input="What is the weather in Paris?", tools=[WEATHER])
    if stream:
        events = stream_events(system, **body)
        args = [e for e in events if e.type.startswith("response.function_call_arguments")]
        assert [e.type for e in args] == ["response.function_call_arguments.delta",
                                          "response.function_call_arguments.done"]
        assert args[0].delta == args[1].arguments
        response = events[-1].response
        assert events[-1].type == "response.completed"
    else:
        response = Response.model_validate(create_raw(system, **body), strict=True)
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")

    # The tool's output goes back as an item, after the conversation so far (sent back whole here).
    follow_up = create_raw(system, model=scripted, tools=[WEATHER], store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
    ])
    assert follow_up["output"][0]["content"][0]["text"] == "It is 18 degrees in Paris."


def test_forced_tool_choice_calls_the_function(system: System, scripted: str) -> None:
    data = create_raw(system, model=scripted, input="Anything.", tools=[WEATHER],
                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    (call,) = data["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather",
                                                                          {"city": "Lyon"})
    assert data["tool_choice"] == {"type": "function", "name": "get_weather"}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_serch"}]}, "tools"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"previous_response_id": "resp_00000000000000000000000000000000"}, "previous_response_id"),
], ids=["unknown-tool-type", "forced-web-search", "uncompilable-json-schema", "image", "item-reference", "computer",
        "background", "truncation",
        "required-without-tools", "unknown-previous"])
def test_what_cannot_be_honoured_is_refused_by_name(system: System, body: dict, param: str) -> None:
    request = {"model": system.model, "input": "hi", **body}
    response = httpx.post(f"{system.base_url}/v1/responses", json=request, timeout=60)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_unknown_response_ids_are_404(system: System) -> None:
    sdk = client(system)
    for response_id in ("resp_00000000000000000000000000000000", "nope"):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.delete(response_id)


def test_an_unstored_response_cannot_be_retrieved(system: System) -> None:
    sdk = client(system)
    response = sdk.responses.create(model=system.model, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=system.model, input="And?", previous_response_id=response.id, max_output_tokens=2)


def test_logprobs_come_with_the_output_text(system: System) -> None:
    data = create_raw(system, model=system.model, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
                      include=["message.output_text.logprobs"])
    part = data["output"][0]["content"][0]
    assert len(part["logprobs"]) == data["usage"]["output_tokens"] == 6
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    for entry in part["logprobs"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy


def test_a_generation_that_fails_mid_stream_ends_with_response_failed(system: System, scripted: str) -> None:
    events = stream_events(system, model=scripted, input="Please fail now.")
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2].code == "generation_failed" and events[2].message
    failed = events[3].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    # Never stored: this gateway says so at once rather than waiting out HELEXA_RESPONSE_WAIT_S (30 s)
    # for the recorder (the client's 20 s timeout would end that wait first).
    quick = OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=20)
    with pytest.raises(openai.NotFoundError):
        quick.responses.retrieve(failed.id)
    with pytest.raises(openai.InternalServerError):
        client(system).responses.create(model=scripted, input="Please fail now.")
