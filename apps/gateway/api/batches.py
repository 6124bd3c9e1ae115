"""The OpenAI Batch API: POST and GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

What a batch is and where it stands is `batch_store`'s; running it is `batch_runner`'s. Here the
create request is checked at the edge: the input file must be one of the caller's purpose=batch
files, `endpoint` one the runner serves, `completion_window` "24h", `metadata` at most 16 string
pairs (keys up to 64 characters, values up to 512), each a 400 naming the parameter.
"""

from __future__ import annotations

import msgspec
from litestar import Request, get, post
from litestar.datastructures import State
from litestar.response import Response

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.gateway.api.validate import check_metadata, decode_body
from apps.gateway.batch_store import BATCH_IDS, COMPLETION_WINDOWS, ENDPOINTS, BatchStore

MAX_LIST_LIMIT = 100
MAX_CREATE_BYTES = 64 << 10


class CreateBatch(msgspec.Struct, frozen=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _refuse(message: str, param: str | None) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def _check(req: CreateBatch) -> None:
    if req.endpoint not in ENDPOINTS:
        raise _refuse(f"'endpoint' must be one of {', '.join(ENDPOINTS)}; got "
                      f"'{wire.bounded_text(req.endpoint, 64)}'.", "endpoint")
    if req.completion_window not in COMPLETION_WINDOWS:
        raise _refuse("'completion_window' must be '24h'.", "completion_window")
    check_metadata(req.metadata)


@post("/v1/batches", status_code=200, request_max_body_size=MAX_CREATE_BYTES)
async def create_batch(request: Request, state: State) -> Response:
    req = decode_body(await request.body(), CreateBatch)
    _check(req)
    principal = request.state.principal
    stored = await state.files.get(req.input_file_id, principal, param="input_file_id")
    if stored.purpose != "batch":
        raise _refuse("'input_file_id' must name a file uploaded with purpose 'batch'.", "input_file_id")
    batches: BatchStore = state.batches
    batch = await batches.create(principal, req.input_file_id, req.endpoint, req.completion_window, req.metadata,
                                 live_cap=state.settings.max_live_batches_per_principal)
    return Response(batch.as_object(), media_type="application/json")


@get("/v1/batches")
async def list_batches(request: Request, state: State) -> Response:
    query = request.query_params
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        raise _refuse("'limit' must be an integer.", "limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise _refuse(f"'limit' must be between 1 and {MAX_LIST_LIMIT}.", "limit")
    after = query.get("after")
    if after is not None and not BATCH_IDS.valid(after):
        raise _refuse("'after' must be a batch id.", "after")
    batches, has_more = await state.batches.page(request.state.principal, limit, after)
    data = [batch.as_object() for batch in batches]
    return Response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                     "last_id": data[-1]["id"] if data else None, "has_more": has_more},
                    media_type="application/json")


@get("/v1/batches/{batch_id:str}")
async def retrieve_batch(request: Request, state: State, batch_id: str) -> Response:
    batch = await state.batches.get(batch_id, request.state.principal)
    return Response(batch.as_object(), media_type="application/json")


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(request: Request, state: State, batch_id: str) -> Response:
    batch = await state.batches.cancel(batch_id, request.state.principal)
    return Response(batch.as_object(), media_type="application/json")
