"""GET /v1/models (live models from the node registry), /health and /ready."""

from __future__ import annotations

from typing import Any

from litestar import get
from litestar.datastructures import State
from litestar.response import Response

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
    for node in await state.bus.live_nodes():
        for status in node.models:
            by_model.setdefault(status.model, []).append(status)
            first_seen[status.model] = min(first_seen.get(status.model, 1 << 62), int(node.updated_at))
    data = [_model_entry(m, by_model[m], first_seen[m]) for m in sorted(by_model)]
    return {"object": "list", "data": data}


@get("/metrics", media_type="text/plain; version=0.0.4", include_in_schema=False)
async def metrics(state: State) -> Response:
    await state.bus.live_nodes()  # refresh the engine-side gauges from the node registry
    return Response(state.bus.metrics.render(), media_type="text/plain; version=0.0.4")


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready")
async def ready(state: State) -> Response:
    connected = await state.bus.is_ready()
    models = sorted({m.model for n in await state.bus.live_nodes() for m in n.models}) if connected else []
    ok = connected and bool(models)
    body = {"status": "ready" if ok else "not ready", "nats": connected, "models": models}
    return Response(body, status_code=200 if ok else 503)
