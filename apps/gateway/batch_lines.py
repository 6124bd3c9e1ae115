"""A batch's lines (/v1/batches): an input line decoded into the request the live route would
build, with the live route's own code and bounds, or its error line; a finished line as its
`batch.line` event (event id: batch id and line number, so one published twice is recorded
once); a recorded line as a line of the output or error file, in OpenAI's shape. The runner
(`apps.gateway.batch_runner`) runs what these make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.bus.events import BatchLine
from apps.gateway.api import openai_schema as oa
from apps.gateway.api.chat import ChatFormatter
from apps.gateway.api.chat import to_bus_request as chat_request
from apps.gateway.api.completions import CompletionFormatter
from apps.gateway.api.completions import to_bus_request as completion_request
from apps.gateway.api.validate import decode_body
from apps.gateway.batch_store import StoredBatch
from apps.gateway.rendering import Formatter
from engine.frontend.protocol import ServiceClass


class InputLine(msgspec.Struct, frozen=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


@dataclass(slots=True, frozen=True)
class Prepared:
    line: int
    custom_id: str
    request: wire.GenerateRequest
    formatter: Formatter
    output_param: str
    constraint_param: str | None


def line_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


def prepare(batch: StoredBatch, line: int, raw: bytes, delivery: int,
            max_body_bytes: int) -> Prepared | BatchLine:
    """One input line as the request it asks for, validated as the live route validates it, or
    its error line."""
    batch_id = batch.batch_id

    def failed(message: str, custom_id: str | None = None) -> BatchLine:
        return line_event(batch_id, line, custom_id, error=line_error("invalid_request", message))

    try:
        item = msgspec.json.decode(raw, type=InputLine)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return failed(f"Line {line} is not a batch request line: {wire.bounded_text(str(exc), 200)}.")
    if item.method != "POST" or item.url != batch.row["endpoint"]:
        return failed(f"Line {line} must be a POST to {batch.row['endpoint']}, the batch's endpoint.", item.custom_id)
    if len(item.body) > max_body_bytes:
        return failed(f"Line {line}'s body is over {max_body_bytes} bytes (max_request_bytes, as on the live route).",
                      item.custom_id)
    request_id = f"{batch_id}-{line}-{delivery}"
    principal = batch.principal
    try:
        if item.url == "/v1/chat/completions":
            chat = decode_body(bytes(item.body), oa.ChatCompletionRequest)
            request = chat_request(chat, request_id, principal)
            formatter: Formatter = ChatFormatter(request, False)
            output_param, constraint = chat.completion_limit_param(), chat.constraint_param()
        else:
            plain = decode_body(bytes(item.body), oa.CompletionRequest)
            request = completion_request(plain, request_id, principal)
            formatter = CompletionFormatter(request, False)
            output_param, constraint = "max_tokens", plain.constraint_param()
    except ServingError as exc:
        return failed(f"Line {line}: {exc.message}", item.custom_id)
    request = msgspec.structs.replace(request, stream=False, service_class=ServiceClass.BATCH)
    return Prepared(line, item.custom_id, request, formatter, output_param, constraint)


def line_event(batch_id: str, line: int, custom_id: str | None, status_code: int | None = None,
               request_id: str | None = None, body: dict[str, Any] | None = None,
               error: dict[str, Any] | None = None) -> BatchLine:
    return BatchLine(event_id=f"{batch_id}.{line}", model="-", node="gateway", batch_id=batch_id, line=line,
                          custom_id=custom_id, status_code=status_code, request_id=request_id, body=body,
                          error=error)


def expired_lines(batch_id: str, items: list[Prepared | BatchLine], started: set[int]) -> list[BatchLine]:
    """At expiry, the error lines of the lines that never started: `batch_expired`, as OpenAI
    writes them (an invalid line keeps its own error)."""
    out: list[BatchLine] = []
    for item in items:
        if item.line in started:
            continue
        if isinstance(item, BatchLine):
            out.append(item)
            continue
        out.append(line_event(batch_id, item.line, item.custom_id, error=line_error(
            "batch_expired", "This line was not run before the batch expired.")))
    return out


def split_lines(content: bytes) -> list[bytes]:
    """The file's lines (as the upload checked them: every one a JSON object, none blank)."""
    lines = content.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    return [line.rstrip(b"\r") for line in lines]


def output_line(row: Any) -> bytes:
    """One line of an output or error file, in OpenAI's shape."""
    response = None
    if row["status_code"] is not None:
        body = row["body"]
        response = {"status_code": row["status_code"], "request_id": row["request_id"],
                    "body": msgspec.json.decode(body) if isinstance(body, str) else body}
    error = row["error"]
    return msgspec.json.encode({
        "id": f"batch_req_{row['batch_id'].removeprefix('batch_')}_{row['line']}",
        "custom_id": row["custom_id"], "response": response,
        "error": msgspec.json.decode(error) if isinstance(error, str) else error,
    }) + b"\n"
