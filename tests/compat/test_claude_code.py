"""Claude Code: Anthropic Messages as Claude Code sends them, streamed, checked against the
`anthropic` SDK's types in strict mode.

The bodies follow the shape public captures and Anthropic's API reference show: `POST
/v1/messages?beta=true` with `anthropic-version` and `anthropic-beta` headers; `system` as text
blocks with `cache_control`; tools with `input_schema` (the last with `cache_control`);
`thinking: {type: "enabled", budget_tokens}`; `metadata.user_id`; `stream: true`; user turns of
text blocks (some with `cache_control`), assistant turns of thinking and tool_use blocks, tool_result
blocks of text. `max_tokens` is the client's setting (CLAUDE_CODE_MAX_OUTPUT_TOKENS): a value past
the model's context is refused with a 400, as Anthropic refuses it.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.compat.conftest import post, sse
from tests.system import System

EVENTS = TypeAdapter(RawMessageStreamEvent)
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
           "x-api-key": "unused", "user-agent": "claude-cli/2.1.0 (external, cli)"}
CACHE = {"type": "ephemeral"}
TOOLS = [
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": {"type": "object", "$schema": "http://json-schema.org/draft-07/schema#",
                      "additionalProperties": False, "required": ["file_path"],
                      "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"},
                                     "limit": {"type": "number"}}}},
    {"name": "Bash", "description": "Executes a bash command.", "cache_control": CACHE,
     "input_schema": {"type": "object", "additionalProperties": False, "required": ["command"],
                      "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}}},
]
SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.", "cache_control": CACHE},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
     "cache_control": CACHE},
]
FIRST_TURN = [{"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>As you answer, use the tools available.</system-reminder>"},
    {"type": "text", "text": "Read README.md and tell me what it is about.", "cache_control": CACHE},
]}]


def claude_request(model: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    # Claude Code asks for its output budget (CLAUDE_CODE_MAX_OUTPUT_TOKENS); here the scripted model's
    # advertised output limit (a quarter of its 8192-token context), since more is a 400.
    return {"model": model, "max_tokens": 2048, "messages": messages, "system": SYSTEM, "tools": TOOLS,
            "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "user_5f2c_account_8e1d_session_1a2b"}, "stream": True, "temperature": 1,
            **extra}


def checked(events: list[tuple[str | None, Any]]) -> list[Any]:
    parsed = []
    for name, data in events:
        assert name == data["type"]
        if name == "ping":
            continue
        parsed.append(EVENTS.validate_python(data, strict=True))
    return parsed


def assembled(events: list[Any]) -> Message:
    """The message a streaming client builds from the events (as the SDK's accumulator does)."""
    message = events[0].message.model_dump(mode="json")
    blocks: dict[int, dict[str, Any]] = {}
    for event in events[1:]:
        if event.type == "content_block_start":
            blocks[event.index] = event.content_block.model_dump(mode="json", exclude_none=True)
        elif event.type == "content_block_delta":
            block, delta = blocks[event.index], event.delta
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta.partial_json
        elif event.type == "message_delta":
            message.update(stop_reason=event.delta.stop_reason, stop_sequence=event.delta.stop_sequence)
            message["usage"]["output_tokens"] = event.usage.output_tokens
    for block in blocks.values():
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json"))
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return Message.model_validate(message, strict=True)


def test_a_claude_code_turn_that_calls_a_tool(system: System, compat_model: str) -> None:
    events = checked(sse(system, "/v1/messages?beta=true", claude_request(compat_model, FIRST_TURN), HEADERS))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    message = assembled(events)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.thinking == "\nI will read the file first.\n" and isinstance(thinking.signature, str)
    assert text.text == "Reading it now."
    assert (tool_use.name, tool_use.input) == ("Read", {"file_path": "/repo/README.md"})
    assert tool_use.id.startswith("call_") and message.stop_reason == "tool_use"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

    counted = post(system, "/v1/messages/count_tokens",
                   {k: v for k, v in claude_request(compat_model, FIRST_TURN).items()
                    if k not in ("max_tokens", "stream", "metadata", "temperature")}, HEADERS)
    assert counted.status_code == 200, counted.text
    assert MessageTokensCount.model_validate(counted.json(), strict=True).input_tokens == message.usage.input_tokens


def test_the_tool_result_turn(system: System, compat_model: str) -> None:
    first = assembled(checked(sse(system, "/v1/messages?beta=true", claude_request(compat_model, FIRST_TURN),
                                  HEADERS)))
    tool_use = first.content[-1]
    conversation = [*FIRST_TURN,
                    {"role": "assistant",
                     "content": [b.model_dump(mode="json", exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": tool_use.id, "is_error": False,
                         "content": [{"type": "text", "text": "# helexa\nAn LLM serving system."}]},
                        {"type": "text", "text": "<system-reminder>Keep it short.</system-reminder>",
                         "cache_control": CACHE}]}]
    message = assembled(checked(sse(system, "/v1/messages?beta=true", claude_request(compat_model, conversation),
                                    HEADERS)))
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "The README describes helexa, an LLM serving system."
    assert message.stop_reason == "end_turn"

    whole = post(system, "/v1/messages?beta=true", claude_request(compat_model, conversation, stream=False), HEADERS)
    assert whole.status_code == 200
    assert Message.model_validate(whole.json(), strict=True).content == message.content


def test_errors_are_anthropic_shaped(system: System, compat_model: str) -> None:
    for body, status in ((claude_request("no-such-model", FIRST_TURN), 404),
                         (claude_request(compat_model, FIRST_TURN, max_tokens=10**6), 400),
                         (claude_request(compat_model, FIRST_TURN, temperature=3), 400)):
        answer = post(system, "/v1/messages?beta=true", body, HEADERS)
        assert answer.status_code == status, answer.text
        ErrorResponse.model_validate(answer.json(), strict=True)

    # A failure after the stream started is an `error` event in the same envelope.
    events = sse(system, "/v1/messages?beta=true",
                 claude_request(compat_model, [{"role": "user", "content": "Please fail now."}]), HEADERS)
    name, data = events[-1]
    assert name == "error"
    assert ErrorResponse.model_validate(data, strict=True).error.type == "api_error"
    client = anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(model=compat_model, max_tokens=64,
                                    messages=[{"role": "user", "content": "Please fail now."}]) as stream:
            stream.get_final_message()
