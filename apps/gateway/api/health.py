"""GET /health (this process and its bus connection), /ready (and a live worker), /metrics."""

from __future__ import annotations

from litestar import get
from litestar.datastructures import State
from litestar.response import Response

_PROMETHEUS = "text/plain; version=0.0.4"


@get("/health")
async def health(state: State) -> Response:
    """200 while this process can reach the bus; 503 while its connection is down or replaced."""
    ok = await state.bus.is_healthy()
    return Response({"status": "ok" if ok else "bus unreachable", "nats": ok}, status_code=200 if ok else 503)


@get("/ready")
async def ready(state: State) -> Response:
    connected = state.bus.is_connected
    models = await state.registry.models() if connected else []
    ok = connected and bool(models)
    body = {"status": "ready" if ok else "not ready", "nats": connected, "models": models}
    return Response(body, status_code=200 if ok else 503)


@get("/metrics", media_type=_PROMETHEUS, include_in_schema=False)
async def metrics(state: State) -> Response:
    # Engine-side gauges are what the node registry holds at scrape time.
    nodes = await state.registry.live_nodes()
    return Response(state.metrics.render(nodes, state.admissions.by_model), media_type=_PROMETHEUS)
