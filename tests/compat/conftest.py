"""Client-compatibility tests: request bodies shaped the way real clients send them (written from
their public documentation), answered by a scripted worker so tool calls and reasoning happen on
cue, and every answer checked field by field against the official SDKs' types in strict mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.system import System, scripted_worker

MODEL = "compat-model"
# First match wins: a follow-up turn still holds the text of the turns before it.
SCRIPT = {
    "rules": [
        # Structured output: instructor's forced tool call goes on from its opening; JSON schema modes.
        {"match": '{"name": "Person", "arguments": ', "reply": '{"name": "Ada", "age": 36}}\n</tool_call>'},
        {"match": "Extract the person", "reply": '{"name": "Ada", "age": 36}'},
        # Codex with a namespace tool: the file came back; then the turn that reads it.
        {"match": "NOTES-7f3a", "reply": "The notes say: ship it."},
        {"match": "Read the notes",
         "reply": '<tool_call>\n{"name": "files.read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'},
        # Codex: the command's output came back; then the first turn, which runs a command.
        {"match": "total 0", "reply": "<think>\nThe listing is empty.\n</think>\n\nThe directory is empty."},
        {"match": "List the files",
         "reply": "<think>\nI should run ls.\n</think>\n\n<tool_call>\n"
                  '{"name": "exec_command", "arguments": {"cmd": ["ls", "-la"], "workdir": "/repo"}}\n</tool_call>'},
        # Claude Code: the file came back; then the turn that reads it.
        {"match": "# helexa", "reply": "The README describes helexa, an LLM serving system."},
        {"match": "Read README.md",
         "reply": "<think>\nI will read the file first.\n</think>\n\nReading it now.<tool_call>\n"
                  '{"name": "Read", "arguments": {"file_path": "/repo/README.md"}}\n</tool_call>'},
        # Chat clients: the tool result came back; then the question that calls the tool.
        {"match": "18 degrees", "reply": "It is 18 degrees in Paris."},
        {"match": "weather in Paris",
         "reply": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                  "</tool_call>"},
        {"match": "think it over", "reply": "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."},
        {"match": "fail now", "reply": "", "fault": "error"},
    ],
    "default": "Hello from helexa.",
}


@pytest.fixture(scope="session")
def compat_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("compat"), MODEL, SCRIPT):
        yield MODEL


def sse(system: System, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
        ) -> list[tuple[str | None, Any]]:
    """POST a streaming request and return its server-sent events as (event name, data): data is
    the decoded JSON, or the raw text for a non-JSON payload such as `[DONE]`."""
    events: list[tuple[str | None, Any]] = []
    with httpx.stream("POST", f"{system.base_url}{path}", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                raw = line.removeprefix("data: ")
                events.append((name, raw if raw == "[DONE]" else json.loads(raw)))
                name = None
    return events


def post(system: System, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{system.base_url}{path}", json=body, headers=headers, timeout=120)
