"""How one API shows a generation to its client: the `Formatter` each API implements, and the
two shapes the pipeline renders through it, a whole JSON response or a stream of SSE chunks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
from litestar.response import Response

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError

log = logging.getLogger("helexa.gateway")

_encode = msgspec.json.encode


class Formatter(Protocol):
    """How one API shows a generation to its client, whole or as a stream of SSE chunks."""

    def whole(self, deltas: list[wire.Delta], final: wire.Final) -> Any: ...

    def error_body(self, error: ServingError) -> dict[str, Any]: ...

    def stream_start(self, accepted: wire.Accepted) -> list[bytes]: ...

    def stream_delta(self, delta: wire.Delta) -> list[bytes]: ...

    def stream_final(self, final: wire.Final) -> list[bytes]: ...

    def stream_error(self, error: ServingError) -> bytes: ...

    def stream_end(self) -> list[bytes]: ...


async def whole_response(frames: AsyncIterator[wire.Delta | wire.Final], formatter: Formatter,
                         headers: dict[str, str]) -> Response:
    """The answer as one JSON response, or the API's error body with its status."""
    deltas: list[wire.Delta] = []
    try:
        async for frame in frames:
            if isinstance(frame, wire.Delta):
                deltas.append(frame)
                continue
            return Response(_encode(formatter.whole(deltas, frame)), media_type="application/json",
                            headers=headers)
    except ServingError as exc:
        retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
        return Response(formatter.error_body(exc), status_code=exc.status, headers={**headers, **retry})
    raise AssertionError("frames() ended without a final frame")


async def sse_chunks(accepted: wire.Accepted, frames: AsyncIterator[wire.Delta | wire.Final], formatter: Formatter,
                     close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The answer as SSE chunks; an error after the first frame is an error event. `close` runs
    before the stream's end chunks, however the frames ended.

    What one frame renders to goes out as one body part (one socket write), however many events
    it holds: each part costs a write on the gateway and a read on the client."""
    try:
        if start := b"".join(formatter.stream_start(accepted)):
            yield start
        async for frame in frames:
            part = b"".join(formatter.stream_delta(frame) if isinstance(frame, wire.Delta)
                            else formatter.stream_final(frame))
            if part:
                yield part
    except ServingError as exc:
        yield formatter.stream_error(exc)
    except Exception:  # a bug: the client still gets an error event and the stream's end, not a cut
        log.exception("a stream failed after its first chunk")
        yield formatter.stream_error(ServingError(500, ErrorCode.INTERNAL_ERROR, "Internal server error."))
    finally:
        await close()
    if end := b"".join(formatter.stream_end()):
        yield end
