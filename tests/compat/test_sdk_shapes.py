"""Request bodies shaped like those today's client libraries send (written for this project from
their public request builders: same structure and fields, our own text), each answered with 200
and parsed with the SDK's own types in strict mode: the OpenAI Agents SDK, LangChain, LiteLLM,
pydantic-ai, instructor and the Vercel AI SDK, over chat completions, Responses and messages.

The versions these shapes follow are listed in docs/clients.md.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.compat.conftest import post, sse
from tests.system import System

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                              "parameters": PARAMS, "strict": True}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
                  "parameters": PARAMS, "strict": True}
WEATHER = "What is the weather in Paris?"
EXTRACT = "Extract the person: Ada, 36 years old."
USAGE = {"include_usage": True}

# (client, route, body, what the answer must hold: "call" a get_weather call, "person" Ada as JSON, "text")
SHAPES: list[tuple[str, str, dict[str, Any], str]] = [
    ("agents-responses", "/v1/responses", {
        "instructions": "You are a helpful agent.", "input": [{"content": WEATHER, "role": "user"}],
        "include": [], "tools": [RESPONSES_TOOL], "stream": True}, "call"),
    ("agents-chat", "/v1/chat/completions", {
        "messages": [{"content": "You are a helpful agent.", "role": "system"}, {"role": "user", "content": WEATHER}],
        "tools": [CHAT_TOOL], "stream": False}, "call"),
    ("langchain-responses", "/v1/responses", {
        "input": [{"content": "Hello there.", "role": "user", "type": "message"}], "stream": False}, "text"),
    ("langchain-structured", "/v1/chat/completions", {
        "messages": [{"content": EXTRACT, "role": "user"}], "stream": False,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "Person", "description": "A person.", "schema": PERSON, "strict": True}}}, "person"),
    ("litellm-responses", "/v1/responses", {"input": "Hello there.", "stream": True}, "text"),
    ("litellm-anthropic", "/v1/messages", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}],
        "max_tokens": 1024, "stream": True}, "text"),
    ("pydantic-ai-chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": WEATHER}], "n": 1, "tools": [CHAT_TOOL], "tool_choice": "auto",
        "stream": True, "stream_options": USAGE}, "call"),
    ("pydantic-ai-responses", "/v1/responses", {
        "input": [{"role": "user", "content": WEATHER}], "instructions": "Be concise.", "tools": [RESPONSES_TOOL],
        "tool_choice": "auto", "stream": False}, "call"),
    ("instructor-json-schema", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": EXTRACT}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON,
                                                                   "strict": True}}}, "person"),
    ("instructor-tools", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": EXTRACT}],
        "tools": [{"type": "function", "function": {"name": "Person", "description": "A person.",
                                                    "parameters": PERSON}}],
        "tool_choice": {"type": "function", "function": {"name": "Person"}}}, "person"),
    ("vercel-stream-text", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}],
        "temperature": 0, "stream": True, "stream_options": USAGE}, "text"),
    ("vercel-generate-object", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": EXTRACT}],
        "response_format": {"type": "json_schema", "json_schema": {
            "schema": {**PERSON, "$schema": "http://json-schema.org/draft-07/schema#"}, "strict": False,
            "name": "response"}}}, "person"),
    ("vercel-responses", "/v1/responses", {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": WEATHER}]}],
        "tools": [{**RESPONSES_TOOL, "strict": False}], "tool_choice": "auto", "stream": True}, "call"),
]
CHUNKS = {"/v1/chat/completions": TypeAdapter(ChatCompletionChunk), "/v1/responses": TypeAdapter(ResponseStreamEvent),
          "/v1/messages": TypeAdapter(RawMessageStreamEvent)}
WHOLE = {"/v1/chat/completions": ChatCompletion, "/v1/responses": Response, "/v1/messages": Message}


def answered(route: str, final: Any) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The text of an answer and its tool calls (name, arguments), whatever the route."""
    if route == "/v1/chat/completions":
        message = final["choices"][0]["message"]
        return message.get("content") or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                              for c in message.get("tool_calls") or []]
    if route == "/v1/responses":
        text = "".join(p["text"] for i in final["output"] if i["type"] == "message" for p in i["content"])
        return text, [(i["name"], json.loads(i["arguments"])) for i in final["output"] if i["type"] == "function_call"]
    return "".join(b["text"] for b in final["content"] if b["type"] == "text"), [
        (b["name"], b["input"]) for b in final["content"] if b["type"] == "tool_use"]


def streamed(route: str, events: list[tuple[str | None, Any]]) -> Any:
    """Every event parsed with the SDK's types; the final answer as a whole one would be."""
    # `[DONE]` ends a chat stream; Anthropic's `ping` is outside the SDK's event union (it skips it).
    data = [d for _, d in events if d != "[DONE]" and not (isinstance(d, dict) and d.get("type") == "ping")]
    for item in data:
        CHUNKS[route].validate_python(item, strict=True)
    if route == "/v1/responses":
        return data[-1]["response"]
    if route == "/v1/messages":
        blocks = [e["content_block"] for e in data if e["type"] == "content_block_start"]
        for e in data:
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
                blocks[e["index"]]["text"] += e["delta"]["text"]
        return {"content": blocks}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"])
    calls = [t for c in data if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert data[-1]["usage"] is not None, "stream_options.include_usage asks for a usage chunk"
    tool_calls: dict[int, dict[str, Any]] = {}
    for call in calls:  # a call opens with its name; its arguments follow as fragments
        function = tool_calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})["function"]
        function["name"] += call["function"].get("name") or ""
        function["arguments"] += call["function"].get("arguments") or ""
    return {"choices": [{"message": {"content": text, "tool_calls": list(tool_calls.values())}}]}


@pytest.mark.parametrize("client, route, body, expect", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_client_shaped_request_is_served(system: System, compat_model: str, client: str, route: str,
                                           body: dict[str, Any], expect: str) -> None:
    request = {"model": compat_model, **body}
    headers = {"anthropic-version": "2023-06-01"} if route == "/v1/messages" else None
    if body.get("stream"):
        final = streamed(route, sse(system, route, request, headers))
    else:
        answer = post(system, route, request, headers)
        assert answer.status_code == 200, answer.text
        final = answer.json()
        WHOLE[route].model_validate(final, strict=True)
    text, calls = answered(route, final)
    if expect == "call":
        assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    elif expect == "person":
        assert {"name": "Ada", "age": 36} in [json.loads(text) if text else None, *[args for _, args in calls]]
    else:
        assert text == "Hello from helexa."
