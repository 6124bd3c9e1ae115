"""Codex CLI: the Responses API as Codex speaks it, streamed, with its function tools.

The bodies follow Codex's public request shape (openai/codex, `ResponsesApiRequest`): `instructions`
as the system prompt, `input` items (developer and user messages with `input_text` parts, and on
later turns the reasoning, function_call and function_call_output items of the turn before),
function tools with `strict: false`, `tool_choice: "auto"`, `parallel_tool_calls: false`,
`reasoning: {effort, summary}`, `store: false` (Codex sends the whole history every turn),
`stream: true`, `include: ["reasoning.encrypted_content"]` and a `prompt_cache_key`.

Codex 0.171 (captured in issue 39) also sends strict function tools, a `namespace` tool grouping
functions, a hosted `web_search` tool, `parallel_tool_calls: true` and `client_metadata`: the
namespace's functions are offered (named `files.read_file` in the prompt) and called back with
their `namespace`; `web_search` is left out, which the `X-Helexa-Warning` header says.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.compat.conftest import post, sse
from tests.system import System

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a shell and returns its output.",
     "strict": False, "parameters": {"type": "object", "additionalProperties": False, "required": ["cmd"],
                                     "properties": {"cmd": {"type": "array", "items": {"type": "string"}},
                                                    "workdir": {"type": "string"},
                                                    "timeout_ms": {"type": "number"}}}},
    {"type": "function", "name": "apply_patch", "description": "Edits files with a patch.", "strict": False,
     "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                    "additionalProperties": False}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
     "parameters": {"type": "object", "properties": {"explanation": {"type": "string"},
                                                     "plan": {"type": "array", "items": {"type": "object"}}},
                    "required": ["plan"], "additionalProperties": False}},
]
USER_TURN = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text",
                  "text": "<permissions instructions>Sandbox: workspace-write.</permissions instructions>"}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "<environment_context><cwd>/repo</cwd></environment_context>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files in this folder."}]},
]


def codex_request(model: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": model, "instructions": "You are Codex, a coding agent running in a terminal.", "input": items,
        "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0197a0c4-5d2e-7c3b-9a41-3f1c0e2d4b6a",
    }


def checked(events: list[tuple[str | None, Any]]) -> list[Any]:
    """Each event validated with the SDK's types (strict), named as its `type`, numbered in order."""
    parsed = []
    for name, data in events:
        assert name == data["type"], "Codex dispatches on the SSE event name"
        parsed.append(EVENTS.validate_python(data, strict=True))
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    return parsed


def test_a_codex_turn_that_runs_a_command(system: System, compat_model: str) -> None:
    events = checked(sse(system, "/v1/responses", codex_request(compat_model, USER_TURN)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "function_call"]
    call = done[-1]
    assert call.name == "exec_command" and call.status == "completed"
    assert json.loads(call.arguments) == {"cmd": ["ls", "-la"], "workdir": "/repo"}
    arguments = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments[0].arguments == call.arguments and arguments[0].item_id == call.id
    final = events[-1].response
    assert final.output == done and final.status == "completed"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens_details.reasoning_tokens > 0
    assert final.usage.input_tokens_details.cached_tokens >= 0
    assert final.tools[0].name == "exec_command" and final.parallel_tool_calls is False
    assert final.reasoning.effort == "medium" and final.store is False
    assert done[0].encrypted_content is None and done[0].content[0].text == "\nI should run ls.\n"


def test_the_next_codex_turn_sends_the_history_back(system: System, compat_model: str) -> None:
    first = checked(sse(system, "/v1/responses", codex_request(compat_model, USER_TURN)))[-1].response
    history = [item.model_dump(mode="json", exclude_none=True) for item in first.output]
    call = first.output[-1]
    follow_up = [*USER_TURN, *history,
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": json.dumps({"output": "total 0\n", "metadata": {"exit_code": 0}})}]
    events = checked(sse(system, "/v1/responses", codex_request(compat_model, follow_up)))
    final: Response = events[-1].response
    assert final.output_text == "The directory is empty."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    text_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text_deltas == final.output_text
    assert final.usage.input_tokens > first.usage.input_tokens


NAMESPACE = {"type": "namespace", "name": "files", "description": "Tools for reading the workspace's files.",
             "tools": [{"type": "function", "name": "read_file", "description": "Reads a file.", "strict": True,
                        "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                                       "properties": {"path": {"type": "string"}}}},
                       {"type": "function", "name": "list_dir", "description": "Lists a folder.", "strict": True,
                        "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                                       "properties": {"path": {"type": "string"}}}}]}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
NOTES_TURN = [USER_TURN[0], {"type": "message", "role": "user",
                             "content": [{"type": "input_text", "text": "Read the notes and sum them up."}]}]


def codex_171_request(model: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    strict = [{**tool, "strict": True} for tool in TOOLS]
    return {**codex_request(model, items), "tools": [*strict, NAMESPACE, WEB_SEARCH], "parallel_tool_calls": True,
            "client_metadata": {"session_id": "0197a0c4-5d2e-7c3b-9a41-3f1c0e2d4b6a", "turn_id": "t-1"},
            "service_tier": "auto", "text": {"verbosity": "low"}}


def stream_171(system: System, body: dict[str, Any]) -> tuple[httpx.Headers, list[Any]]:
    """The answer's headers and its events, checked."""
    with httpx.stream("POST", f"{system.base_url}/v1/responses", json=body, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    return answer.headers, checked(list(zip(names, data, strict=True)))


def test_codex_171_namespace_tools_are_called_with_their_namespace(system: System, compat_model: str) -> None:
    headers, events = stream_171(system, codex_171_request(compat_model, NOTES_TURN))
    assert "web_search" in headers["x-helexa-warning"]
    final: Response = events[-1].response
    (call,) = final.output
    assert (call.type, call.name, call.namespace) == ("function_call", "read_file", "files")
    assert json.loads(call.arguments) == {"path": "notes.txt"}
    assert [tool.type for tool in final.tools][-2:] == ["namespace", "web_search"]

    # The next turn: the whole history back, with the tool's output; it reaches the prompt.
    follow_up = [*NOTES_TURN, call.model_dump(mode="json", exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "NOTES-7f3a: ship it"}]
    _, events = stream_171(system, codex_171_request(compat_model, follow_up))
    assert events[-1].response.output_text == "The notes say: ship it."


def test_forcing_web_search_is_a_400_naming_it(system: System, compat_model: str) -> None:
    body = {**codex_171_request(compat_model, NOTES_TURN), "tool_choice": {"type": "web_search"}, "stream": False}
    answer = post(system, "/v1/responses", body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
    assert "web_search" in answer.json()["error"]["message"]
    sdk = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model=compat_model, input="hi", tools=[WEB_SEARCH],  # type: ignore[list-item]
                             tool_choice={"type": "web_search_preview"})
