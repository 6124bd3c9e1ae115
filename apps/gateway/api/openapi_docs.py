"""OpenAPI documentation for the generation and token routes.

Those routes decode their raw body with msgspec themselves (so a bad field gets a 400 that names it),
which hides the body types from Litestar's schema generator. This module documents them from the
same msgspec Structs the handlers decode and encode, so the schema cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPI, OpenAPIMediaType, OpenAPIResponse, Operation, Reference, RequestBody

from apps.gateway.api import anthropic_schema as an
from apps.gateway.api import openai_schema as oa
from apps.gateway.api import responses_schema as rs
from apps.gateway.api import token_schema as ts

_REF = "#/components/schemas/{name}"


@dataclass(frozen=True, slots=True)
class RouteDoc:
    request: type[msgspec.Struct]
    response: type[msgspec.Struct]
    chunk: type[msgspec.Struct] | None
    error: type[msgspec.Struct]
    statuses: tuple[int, ...]
    # Another body the route accepts instead of `request` (documented as `oneOf` the two).
    alternative: type[msgspec.Struct] | None = None
    answer: str = "The generation (an SSE stream when `stream` is true)."


_OPENAI_STATUSES = (400, 401, 404, 413, 415, 429, 500, 503)
_COUNTED = "The prompt tokens a generation of the same request would get (its usage counts the same)."
ROUTES: dict[str, RouteDoc] = {
    "chat": RouteDoc(oa.ChatCompletionRequest, oa.ChatCompletion, oa.ChatCompletionChunk, oa.ErrorEnvelope,
                     _OPENAI_STATUSES),
    "completions": RouteDoc(oa.CompletionRequest, oa.TextCompletion, oa.TextCompletion, oa.ErrorEnvelope,
                            _OPENAI_STATUSES),
    "messages": RouteDoc(an.MessagesRequest, an.MessageOut, None, an.ErrorEnvelope, _OPENAI_STATUSES),
    "responses": RouteDoc(rs.ResponsesRequest, rs.ResponseObject, None, oa.ErrorEnvelope, _OPENAI_STATUSES,
                          answer="The response (an SSE stream of its semantic events when `stream` is true)."),
    "tokenize": RouteDoc(ts.TokenizeChatRequest, ts.TokenizeResponse, None, oa.ErrorEnvelope, _OPENAI_STATUSES,
                         alternative=ts.TokenizeCompletionRequest, answer=_COUNTED),
    "detokenize": RouteDoc(ts.DetokenizeRequest, ts.DetokenizeResponse, None, oa.ErrorEnvelope, _OPENAI_STATUSES,
                           answer="The text of the token ids (special tokens kept)."),
    "count_tokens": RouteDoc(ts.CountTokensRequest, ts.CountTokensResponse, None, an.ErrorEnvelope,
                             _OPENAI_STATUSES, answer=_COUNTED),
}

_TYPES = sorted({t for doc in ROUTES.values()
                 for t in (doc.request, doc.response, doc.chunk, doc.error, doc.alternative) if t},
                key=lambda t: t.__name__)
_REFS, _COMPONENTS = msgspec.json.schema_components(_TYPES, ref_template=_REF)
_REF_OF = dict(zip(_TYPES, _REFS, strict=True))

_STATUS_TEXT = {
    400: "Invalid request: malformed JSON, JSON nested deeper than 64 levels, or a parameter outside its bound "
         "(`param` names it). The bounds are in the request schema; see also docs/api.md.",
    401: "Missing or unknown API key (only when keys are configured).",
    404: "Unknown model.",
    413: "Request body too large.",
    415: "The body is not sent as JSON (`Content-Type: application/json` is required).",
    429: "Admission refused: queue full or per-principal cap; see Retry-After.",
    500: "Internal error.",
    503: "No live worker for the model, or it timed out; see Retry-After.",
}


def add_components(openapi: OpenAPI) -> None:
    """Put the body types' schemas beside Litestar's own; call once the app's schema is built.

    Litestar fills `components.schemas` from its registry when it builds the document (it would drop
    any passed in through `OpenAPIConfig`), and serves that built object thereafter. Plain dicts are
    serialised as they are, so msgspec's JSON schema goes in unchanged.
    """
    schemas: dict[str, Any] = openapi.components.schemas
    schemas.update(_COMPONENTS)


def _media(struct: type[msgspec.Struct]) -> OpenAPIMediaType:
    schema: Any = _REF_OF[struct]
    return OpenAPIMediaType(schema=schema)


def operation_for(route: str) -> type[Operation]:
    """An `Operation` class for a route's `operation_class=`, documenting its real body types."""
    doc = ROUTES[route]
    success = {"application/json": _media(doc.response)}
    if doc.chunk is not None:
        success["text/event-stream"] = _media(doc.chunk)

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            body = _media(doc.request)
            if doc.alternative is not None:
                # A raw oneOf of the components' $refs: litestar renders the dict as it is.
                body = OpenAPIMediaType(schema={"oneOf": [_REF_OF[doc.request], _REF_OF[doc.alternative]]})  # type: ignore[arg-type]
            self.request_body = RequestBody(content={"application/json": body}, required=True)
            responses: dict[str, OpenAPIResponse | Reference] = {
                "200": OpenAPIResponse(description=doc.answer, content=success)}
            for status in doc.statuses:
                responses[str(status)] = OpenAPIResponse(description=_STATUS_TEXT[status],
                                                  content={"application/json": _media(doc.error)})
            self.responses = responses

    return DocumentedOperation
