"""Chat-completions clients — OpenCode, Continue, LangChain, LiteLLM — with tools and streaming,
every chunk checked against the `openai` SDK's types in strict mode.

Each body follows what the client documents it sends: OpenCode (the AI SDK's openai-compatible
provider) sends content as text parts, JSON-schema tools with `additionalProperties: false`,
`stream_options.include_usage` and the model's own output limit (from /v1/models) as
`max_tokens`; Continue streams plain messages with `max_tokens`, `temperature` and `stop`;
LangChain's ChatOpenAI sends `n: 1`, `stream_options.include_usage` (its `stream_usage`) and
`parallel_tool_calls`; LiteLLM forwards `tool_choice`, `user` and `stream_options`.

What every client relies on: a streamed tool call opens with `index`, `id`, `type: "function"` and
the function name, then sends `arguments` as string fragments; `finish_reason` is `tool_calls`;
reasoning comes as `reasoning_content` and `reasoning` alike; a usage-only chunk (with empty
`choices`) comes last, and only when `stream_options.include_usage` asks for it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.compat.conftest import post, sse
from tests.system import System

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                   "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius",
                                                                                                 "fahrenheit"]}}}}}
QUESTION = "What is the weather in Paris?"


def output_limit(system: System, model: str) -> int:
    models = httpx.get(f"{system.base_url}/v1/models", timeout=30).json()["data"]
    return next(m["max_output_tokens"] for m in models if m["id"] == model)


def bodies(system: System, model: str) -> dict[str, dict[str, Any]]:
    return {
        "opencode": {"model": model, "stream": True, "stream_options": {"include_usage": True},
                     "max_tokens": output_limit(system, model), "temperature": 0, "tool_choice": "auto",
                     "tools": [WEATHER],
                     "messages": [{"role": "system", "content": "You are opencode, an interactive CLI agent."},
                                  {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]},
        "continue": {"model": model, "stream": True, "max_tokens": output_limit(system, model), "temperature": 0.5,
                     "stop": ["<|endoftext|>"], "tools": [WEATHER],
                     "messages": [{"role": "system", "content": "You are a helpful coding assistant."},
                                  {"role": "user", "content": QUESTION}]},
        "langchain": {"model": model, "stream": True, "stream_options": {"include_usage": True}, "n": 1,
                      "temperature": 0.0, "parallel_tool_calls": False, "tools": [WEATHER],
                      "messages": [{"role": "user", "content": QUESTION}]},
        "litellm": {"model": model, "stream": True, "stream_options": {"include_usage": True},
                    "tool_choice": "auto", "user": "litellm-user-1", "tools": [WEATHER],
                    "messages": [{"role": "user", "content": QUESTION}]},
    }


CLIENTS = ["opencode", "continue", "langchain", "litellm"]


def chunks_of(events: list[tuple[str | None, Any]]) -> list[ChatCompletionChunk]:
    assert events[-1] == (None, "[DONE]")
    return [ChatCompletionChunk.model_validate(data, strict=True) for _, data in events[:-1]]


def accumulate(chunks: list[ChatCompletionChunk]) -> dict[str, Any]:
    """What a streaming client makes of the chunks, checking each tool-call rule on the way."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            reasoning = (delta.model_extra or {}).get("reasoning_content") or ""
            assert ((delta.model_extra or {}).get("reasoning") or "") == reasoning
            out["reasoning"] += reasoning
            for call in delta.tool_calls or []:
                if call.index not in out["calls"]:
                    assert call.id and call.type == "function" and call.function.name, "the opening chunk"
                    out["calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.type is None and call.function.name is None
                assert isinstance(call.function.arguments, str)
                out["calls"][call.index]["arguments"] += call.function.arguments
            out["finish"] = choice.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("name", CLIENTS)
def test_a_streamed_tool_call_as_the_client_reads_it(system: System, compat_model: str, name: str) -> None:
    body = bodies(system, compat_model)[name]
    chunks = chunks_of(sse(system, "/v1/chat/completions", body))
    got = accumulate(chunks)
    assert got["finish"] == "tool_calls" and got["content"] == ""
    (call,) = got["calls"].values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    usage_chunks = [c for c in chunks if c.usage is not None]
    if body.get("stream_options", {}).get("include_usage"):
        assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    else:
        assert usage_chunks == [] and all(c.choices for c in chunks)
    assert len({c.id for c in chunks}) == 1 and all(c.model == compat_model for c in chunks)

    # The next turn: the assistant's call (arguments as a string) and the tool's result.
    follow_up = {**body, "messages": [
        *body["messages"],
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"},
    ]}
    answer = accumulate(chunks_of(sse(system, "/v1/chat/completions", follow_up)))
    assert answer["content"] == "It is 18 degrees in Paris." and answer["finish"] == "stop"


@pytest.mark.parametrize("name", CLIENTS)
def test_the_same_request_whole(system: System, compat_model: str, name: str) -> None:
    body = {k: v for k, v in bodies(system, compat_model)[name].items() if k not in ("stream", "stream_options")}
    answer = post(system, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    completion = ChatCompletion.model_validate(answer.json(), strict=True)
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_reasoning_under_both_names(system: System, compat_model: str) -> None:
    body = {"model": compat_model, "messages": [{"role": "user", "content": "Please think it over."}]}
    got = accumulate(chunks_of(sse(system, "/v1/chat/completions", {**body, "stream": True})))
    assert got["reasoning"] == "\nTwo plus two is four.\n" and got["content"] == "The answer is 4."
    message = ChatCompletion.model_validate(post(system, "/v1/chat/completions", body).json(),
                                            strict=True).choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == got["reasoning"]


def test_logprobs_in_openais_shape(system: System) -> None:
    body = {"model": system.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    completion = ChatCompletion.model_validate(post(system, "/v1/chat/completions", body).json(), strict=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs.refusal is None and len(logprobs.content) == 5
    for entry in logprobs.content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert all(top.bytes == list(top.token.encode()) for top in entry.top_logprobs)
    chunks = chunks_of(sse(system, "/v1/chat/completions", {**body, "stream": True}))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]
