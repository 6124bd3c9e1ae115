"""The OpenAI Files API: POST and GET /v1/files, GET and DELETE /v1/files/{id}, GET
/v1/files/{id}/content. Storage, bounds and ownership are `file_store`'s; this module reads the
multipart upload as it arrives (the `multipart` package's push parser, one socket chunk at a time,
so a 200 MB file is never whole in memory) and shapes the answers as the `openai` SDK parses them.

The upload's form has two fields: `purpose` (`batch` or `user_data`), then `file` (the SDKs send
them in that order), so a batch file's lines are checked as they stream; a `file` before any
`purpose` is a 400 naming `purpose`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import multipart
from litestar import Request, delete, get, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.gateway.file_store import LISTED_PURPOSES, PURPOSES, FileStore, valid_id

# Bytes of the multipart framing and the `purpose` field beyond the file itself.
FORM_OVERHEAD_BYTES = 64 << 10
MAX_FILENAME_CHARS = 512
MAX_PURPOSE_BYTES = 64
MAX_PARTS = 8
MAX_LIST_LIMIT = 10_000


def _refuse(message: str, param: str | None) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def _check_purpose(purpose: str, allowed: tuple[str, ...] = PURPOSES) -> str:
    if purpose not in allowed:
        raise _refuse(f"'purpose' must be one of {', '.join(allowed)}; got '{wire.bounded_text(purpose, 64)}'.",
                      "purpose")
    return purpose


def _boundary(request: Request) -> str:
    kind, options = multipart.parse_options_header(request.headers.get("content-type", ""))
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise ServingError(415, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                           "Upload a file as multipart/form-data with the fields 'file' and 'purpose'.", param="file")
    return str(options["boundary"])


class Form:
    """The parser's events (a segment, its body's chunks, None at its end) off the request's body,
    which may be at most `max_bytes`."""

    def __init__(self, request: Request, max_bytes: int) -> None:
        self._request, self._max_bytes = request, max_bytes
        self.events = self._events()

    async def _events(self) -> AsyncIterator[Any]:
        received = 0
        try:
            with multipart.PushMultipartParser(_boundary(self._request), max_segment_count=MAX_PARTS,
                                               strict=True) as parser:
                async for chunk in self._request.stream():
                    received += len(chunk)
                    if received > self._max_bytes:
                        raise ServingError(413, ErrorCode.REQUEST_TOO_LARGE,
                                           f"This upload is over {self._max_bytes} bytes (max_file_bytes and "
                                           "the form around it).", param="file")
                    for event in parser.parse(chunk):
                        yield event
        except multipart.MultipartError as exc:
            raise _refuse(f"The multipart form is malformed: {wire.bounded_text(str(exc), 200)}.", "file") from None

    async def body(self) -> AsyncIterator[bytes]:
        """The current segment's body, chunk by chunk, to its end."""
        async for event in self.events:
            if event is None:
                return
            yield event

    async def small(self, param: str, limit: int) -> str:
        value = b""
        async for chunk in self.body():
            value += chunk
            if len(value) > limit:
                raise _refuse(f"'{param}' is over {limit} bytes.", param)
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise _refuse(f"'{param}' is not UTF-8.", param) from None


def _filename(segment: Any) -> str:
    name = segment.filename or "upload"
    if "\x00" in name or len(name) > MAX_FILENAME_CHARS:
        raise _refuse(f"The file's name must be at most {MAX_FILENAME_CHARS} characters, without NUL.", "file")
    return str(name)


@post("/v1/files", status_code=200, request_max_body_size=None)
async def create_file(request: Request, state: State) -> Response:
    """The form's `purpose` and `file` in either order: the Python SDK sends `purpose` first, and
    openai-node the file first (its object's key order)."""
    store: FileStore = state.files
    principal = request.state.principal
    form = Form(request, store.limits.max_file_bytes + FORM_OVERHEAD_BYTES)
    purpose: str | None = None
    stored = None

    async def purpose_after_the_file() -> str:
        async for event in form.events:
            if isinstance(event, multipart.MultipartSegment) and event.name == "purpose":
                return _check_purpose(await form.small("purpose", MAX_PURPOSE_BYTES))
        raise _refuse("'purpose' is required: batch or user_data.", "purpose")

    async for event in form.events:
        if not isinstance(event, multipart.MultipartSegment):
            continue
        if event.name == "purpose" and purpose is None:
            purpose = _check_purpose(await form.small("purpose", MAX_PURPOSE_BYTES))
        elif event.name == "file" and stored is None:
            stored = await store.create(principal, _filename(event), purpose or purpose_after_the_file, form.body())
            purpose = stored.purpose
        else:
            async for _ in form.body():
                pass
    if purpose is None:
        raise _refuse("'purpose' is required: batch or user_data.", "purpose")
    if stored is None:
        raise _refuse("'file' is required: the file's content as a multipart file field.", "file")
    return Response(stored.as_object(), media_type="application/json")


@get("/v1/files")
async def list_files(request: Request, state: State) -> Response:
    query = request.query_params
    try:
        limit = int(query.get("limit", MAX_LIST_LIMIT))
    except ValueError:
        raise _refuse("'limit' must be an integer.", "limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise _refuse(f"'limit' must be between 1 and {MAX_LIST_LIMIT}.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _refuse("'order' must be 'asc' or 'desc'.", "order")
    after = query.get("after")
    if after is not None and not valid_id(after):
        raise _refuse("'after' must be a file id.", "after")
    purpose = query.get("purpose")
    if purpose is not None:
        _check_purpose(purpose, LISTED_PURPOSES)
    page = await state.files.page(request.state.principal, limit, after, order == "desc", purpose)
    data = [stored.as_object() for stored in page.files]
    return Response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                     "last_id": data[-1]["id"] if data else None, "has_more": page.has_more},
                    media_type="application/json")


@get("/v1/files/{file_id:str}")
async def retrieve_file(request: Request, state: State, file_id: str) -> Response:
    stored = await state.files.get(file_id, request.state.principal)
    return Response(stored.as_object(), media_type="application/json")


@get("/v1/files/{file_id:str}/content")
async def file_content(request: Request, state: State, file_id: str) -> Stream:
    stored, content = await state.files.content(file_id, request.state.principal)
    return Stream(content, media_type="application/octet-stream",
                  headers={"Content-Length": str(stored.bytes)})


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(request: Request, state: State, file_id: str) -> Response:
    await state.files.delete(file_id, request.state.principal)
    return Response({"id": file_id, "object": "file", "deleted": True}, media_type="application/json")
