"""GET /v1/models: every model some live worker serves, with the limits they advertise and, under
`helexa`, what each node runs it in (`dtype`, and `dtype_reason`: why, e.g. "bf16 unsupported
here (oneDNN: no avx512bw/avx512vl/avx512dq or avx_ne_convert)"); GET /v1/models/{id}: one of them.

One shape answers both SDKs: OpenAI's fields (`object`, `created`, `owned_by`) beside Anthropic's
(`type`, `display_name`, `created_at` as RFC 3339; the list's `has_more`, `first_id`, `last_id`),
each SDK reading its own and ignoring the rest. A model id may hold a `/` (an org/name id)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from litestar import get
from litestar.datastructures import State

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError


def _helexa_entry(statuses: list[tuple[str, wire.ModelStatus]]) -> dict[str, Any]:
    """Per node, the dtype and why and the ranks; at the top the same three where every node agrees
    (a fleet of like machines, or one node). Unknown values are absent."""
    nodes = [{"node": node, **{k: v for k, v in (("dtype", s.dtype), ("dtype_reason", s.dtype_reason),
                                                 ("tensor_parallel", s.tensor_parallel)) if v}}
             for node, s in statuses]
    entry: dict[str, Any] = {"nodes": nodes}
    for key in ("dtype", "dtype_reason", "tensor_parallel"):
        values = {n.get(key) for n in nodes}
        if len(values) == 1 and None not in values:
            entry[key] = values.pop()
    return entry


def _model_entry(model: str, statuses: list[wire.ModelStatus], created: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "helexa",
                             "type": "model", "display_name": model,
                             "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")}
    # Across nodes the advertised limit is what every node can serve; unknown stays absent, never 0.
    def smallest(values: list[int | None]) -> int | None:
        known = [v for v in values if v]
        return min(known) if known else None

    context = smallest([s.max_model_len for s in statuses])
    input_ = smallest([s.max_input_tokens for s in statuses])
    output = smallest([s.max_output_tokens for s in statuses])
    limit = {k: v for k, v in (("context", context), ("input", input_), ("output", output)) if v}
    if limit:
        entry["limit"] = limit
    for key, value in (("max_model_len", context), ("max_input_tokens", input_), ("max_output_tokens", output)):
        if value:
            entry[key] = value
    return entry


async def _served(state: State) -> list[dict[str, Any]]:
    by_model: dict[str, list[tuple[str, wire.ModelStatus]]] = {}
    first_seen: dict[str, int] = {}
    for node in await state.registry.live_nodes():
        for status in node.models:
            by_model.setdefault(status.model, []).append((node.node, status))
            first_seen[status.model] = min(first_seen.get(status.model, 1 << 62), int(node.updated_at))
    data = []
    for m in sorted(by_model):
        entry = _model_entry(m, [status for _, status in by_model[m]], first_seen[m])
        entry["helexa"] = _helexa_entry(by_model[m])
        data.append(entry)
    return data


@get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    data = await _served(state)
    return {"object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@get("/v1/models/{model_id:path}")
async def retrieve_model(state: State, model_id: str) -> dict[str, Any]:
    model = model_id.lstrip("/")
    for entry in await _served(state):
        if entry["id"] == model:
            return entry
    raise ServingError(404, ErrorCode.MODEL_NOT_FOUND, f"The model '{wire.bounded_text(model, 200)}' is not "
                       "served here (GET /v1/models lists the models served).", param="model")
