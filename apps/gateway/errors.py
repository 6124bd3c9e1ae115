"""Client-facing errors: the OpenAI envelope, generic messages, one structured warning per failure."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from apps.bus.codes import ErrorCode, ServingError

log = logging.getLogger("helexa.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, code: ErrorCode | None = None, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def log_failure(
    handler: str,
    status: int,
    error: str,
    *,
    model: str | None = None,
    node: str | None = None,
    request_id: str | None = None,
) -> None:
    """The one warning every failure path emits, always with the same fields."""
    log.warning(
        "request failed",
        extra={
            "handler": handler,
            "model": model,
            "node": node,
            "request_id": request_id,
            "status": status,
            "error": error,
        },
    )


def _handler_name(request: Request) -> str:
    return f"{request.method} {request.url.path}"


def request_id_headers(request_id: str) -> dict[str, str]:
    """A request's id, as each SDK reads it: `x-request-id` (OpenAI) and `request-id` (Anthropic)."""
    return {"X-Request-Id": request_id, "Request-Id": request_id}


def serving_error_handler(request: Request, exc: ServingError) -> Response:
    ctx = exc.context
    log_failure(
        _handler_name(request),
        exc.status,
        ctx.get("detail", exc.message),
        model=ctx.get("model"),
        node=ctx.get("node"),
        request_id=ctx.get("request_id"),
    )
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    if ctx.get("request_id"):
        # Refused after it had an id (admission, a worker's refusal): the client can name it to the ledger.
        headers.update(request_id_headers(ctx["request_id"]))
    return Response(error_body(exc.status, exc.message, exc.code, exc.param), status_code=exc.status, headers=headers)


# What Litestar raises when the client goes away while its body is read (a 500, though no bug).
_BODY_CUT_SHORT = "client disconnected prematurely"


def http_error_handler(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 500 and exc.detail == _BODY_CUT_SHORT:
        # Nobody reads this answer: logged and counted as the client's leaving, not a server error.
        log_failure(_handler_name(request), 499, "the client left while its body was read")
        return Response(error_body(499, "Client closed the request.", code=ErrorCode.CLIENT_CLOSED),
                        status_code=499)
    # A path that is no route has its own handler (`front_door.not_found`).
    message = {404: "Not found.", 405: "Method not allowed."}.get(
        status, exc.detail if status < 500 else "Internal server error."
    )
    code = None
    if status == 413:
        # Never servable as sent, so no retry hint: name the limit the body broke.
        limit = request.app.request_max_body_size
        own = request.route_handler.resolve_request_max_body_size() if request.scope.get("route_handler") else None
        if own is not None and own != limit:  # a route with a bound of its own (POST /v1/batches)
            message = f"The request body is larger than this endpoint's limit of {own} bytes."
        else:
            message = (f"The request body is larger than this gateway's limit of {limit} bytes "
                       "(HELEXA_MAX_REQUEST_BYTES).")
        code = ErrorCode.REQUEST_TOO_LARGE
    log_failure(_handler_name(request), status, str(exc.detail))
    return Response(error_body(status, message, code=code), status_code=status, headers=exc.headers)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc, extra={"handler": _handler_name(request)})
    log_failure(_handler_name(request), 500, type(exc).__name__)
    return Response(error_body(500, "Internal server error.", code=ErrorCode.INTERNAL_ERROR), status_code=500)
