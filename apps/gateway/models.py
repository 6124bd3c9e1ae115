"""GET /v1/models: every model some live worker serves, with the limits they advertise."""

from __future__ import annotations

from typing import Any

from litestar import get
from litestar.datastructures import State

from apps.bus import wire


def _model_entry(model: str, statuses: list[wire.ModelStatus], created: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "helexa"}
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


@get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    by_model: dict[str, list[wire.ModelStatus]] = {}
    first_seen: dict[str, int] = {}
    for node in await state.registry.live_nodes():
        for status in node.models:
            by_model.setdefault(status.model, []).append(status)
            first_seen[status.model] = min(first_seen.get(status.model, 1 << 62), int(node.updated_at))
    data = [_model_entry(m, by_model[m], first_seen[m]) for m in sorted(by_model)]
    return {"object": "list", "data": data}
