"""A batch's lines (/v1/batches): an input line decoded into the request the live route would
build, with the live route's own code and bounds, or its error line; a finished line as its
`batch.line` event (event id: batch id and line number, so one published twice is recorded
once); a recorded line as a line of the output or error file, in OpenAI's shape. The runner
(`apps.gateway.batch_runner`) runs what these make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.events import BatchLine
from apps.gateway.api import openai_schema as oa
from apps.gateway.api import responses as live_responses
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.chat import ChatFormatter
from apps.gateway.api.chat import to_bus_request as chat_request
from apps.gateway.api.completions import CompletionFormatter
from apps.gateway.api.completions import to_bus_request as completion_request
from apps.gateway.api.responses_output import ResponsesFormatter
from apps.gateway.api.validate import decode_body
from apps.gateway.batch_store import StoredBatch
from apps.gateway.file_store import MAX_CUSTOM_ID_CHARS
from apps.gateway.rendering import Formatter
from apps.gateway.response_store import new_response_id
from engine.frontend.protocol import ServiceClass


class InputLine(msgspec.Struct, frozen=True):
    custom_id: Annotated[str, msgspec.Meta(max_length=MAX_CUSTOM_ID_CHARS)]
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


# A line's body as (request, formatter, output parameter, constraint parameter), decoded by the
# live route's own code: one entry per endpoint a batch may name (`batch_store.ENDPOINTS`).
Decoded = tuple[wire.GenerateRequest, Formatter, str, str | None]


def _chat(body: bytes, request_id: str, principal: str | None) -> Decoded:
    chat = decode_body(body, oa.ChatCompletionRequest)
    request = chat_request(chat, request_id, principal)
    return request, ChatFormatter(request, False), chat.completion_limit_param(), chat.constraint_param()


def _completion(body: bytes, request_id: str, principal: str | None) -> Decoded:
    plain = decode_body(body, oa.CompletionRequest)
    request = completion_request(plain, request_id, principal)
    return request, CompletionFormatter(request, False), "max_tokens", plain.constraint_param()


class _Stored(msgspec.Struct):
    """Whether a Responses line asked for `store` itself (the live route's default is true)."""
    store: bool | None = None


def _response(body: bytes, request_id: str, principal: str | None) -> Decoded:
    """A Responses line: stateless only. A batch keeps no response (`store: true` is refused; left
    out, it is false) and continues none (`previous_response_id` is refused); `background` and
    the rest are refused by the live route's own checks."""
    req = decode_body(body, rs.ResponsesRequest)
    if msgspec.json.decode(body, type=_Stored).store:
        raise ServingError(400, ErrorCode.INVALID_REQUEST, "'store' must be false in a batch: a batch "
                           "line's response is kept in the output file, not stored.", param="store")
    if req.previous_response_id is not None:
        raise ServingError(400, ErrorCode.INVALID_REQUEST, "'previous_response_id' is not supported in a "
                           "batch: each line is answered on its own.", param="previous_response_id")
    req = msgspec.structs.replace(req, store=False, stream=False)
    items = live_responses.parse_items(req.input, "input")
    template = live_responses.response_template(req, new_response_id())
    request, offered = live_responses.to_bus_request(req, request_id, principal, [], items)
    formatter = ResponsesFormatter(template, live_responses.wants_logprobs(req), namespaces=offered.namespaces)
    return request, formatter, "max_output_tokens", "text.format"


DECODERS: dict[str, Callable[[bytes, str, str | None], Decoded]] = {
    "/v1/chat/completions": _chat, "/v1/completions": _completion, "/v1/responses": _response,
}


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
        decoded = DECODERS[item.url](bytes(item.body), request_id, principal)
    except ServingError as exc:
        return failed(f"Line {line}: {exc.message}", item.custom_id)
    request, formatter, output_param, constraint = decoded
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
    """One line of an output or error file, in OpenAI's shape. The ledger's JSON (a body is up
    to an answer's whole logprobs: megabytes) goes in as it is, never decoded and made again."""
    response = None
    if row["status_code"] is not None:
        response = {"status_code": row["status_code"], "request_id": row["request_id"], "body": _raw(row["body"])}
    return msgspec.json.encode({
        "id": f"batch_req_{row['batch_id'].removeprefix('batch_')}_{row['line']}",
        "custom_id": row["custom_id"], "response": response, "error": _raw(row["error"]),
    }) + b"\n"


def _raw(value: Any) -> Any:
    """A jsonb column as asyncpg gives it (its JSON text) to embed as it is; else the value."""
    return msgspec.Raw(value.encode()) if isinstance(value, str) else value
