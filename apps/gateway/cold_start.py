"""Which nodes will serve a request's model: the serving check, and a cold start for a catalogued
model no worker has loaded (one load per model, shared by every request waiting for it)."""

from __future__ import annotations

import asyncio
import time

from apps.bus import wire
from apps.bus.codes import ErrorCode, ModelState, ServingError, Unavailable, unavailable
from apps.fleet import control_client
from apps.fleet.catalogue import CatalogueEntry
from apps.fleet.control_client import ControlFailed
from apps.gateway.bus_client import GatewayBus
from apps.gateway.bus_failures import BUS_ERRORS, answered_as_unavailable, bus_unavailable
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry, serving

# Model names a 404 for an unknown model suggests at most.
_HINTED_MODELS = 8


class ColdStarts:
    def __init__(self, bus: GatewayBus, registry: NodeRegistry, metrics: GatewayMetrics,
                 catalogue: dict[str, CatalogueEntry] | None = None, wait_s: float = 120.0) -> None:
        self._bus = bus
        self._registry = registry
        self._metrics = metrics
        self.catalogue = catalogue or {}
        self.wait_s = wait_s
        self._loads: dict[str, asyncio.Task[dict]] = {}

    async def nodes_for(self, model: str) -> list[wire.NodeStatus]:
        """The live nodes serving `model`. A model poisoned everywhere is a 503 at once; a catalogued
        model no worker has loaded is loaded now (cold start); 404 if no worker ever served it, 503
        if none does now."""
        live = await self._registry.live_nodes()
        nodes = serving(live, model, ModelState.READY)
        if nodes:
            return nodes
        if serving(live, model):
            self._metrics.rejections.labels(model, "poisoned").inc()
            raise unavailable(Unavailable.MODEL_POISONED, {"model": model, "detail": "poisoned"}, model=model)
        if model in self.catalogue:
            return await self._cold_start(model)
        with answered_as_unavailable(f"looking up the model {model!r}"):
            known = await self._registry.model_is_known(model)
        if known:
            self._metrics.rejections.labels(model, "no_worker").inc()
            raise unavailable(Unavailable.NO_WORKER, {"model": model, "detail": "no live node"}, model=model)
        raise ServingError(
            404,
            ErrorCode.MODEL_NOT_FOUND,
            f"The model '{model}' does not exist.{self._served_hint(live)}",
            param="model",
            context={"model": model},
        )

    def _served_hint(self, live: list[wire.NodeStatus]) -> str:
        """The models a client could have meant: what is served or catalogued (at most a few)."""
        names = sorted({m.model for n in live for m in n.models} | set(self.catalogue))
        if not names:
            return ""
        shown = ", ".join(f"'{name}'" for name in names[:_HINTED_MODELS])
        more = f" and {len(names) - _HINTED_MODELS} more" if len(names) > _HINTED_MODELS else ""
        return f" Served here: {shown}{more} (GET /v1/models lists them)."

    def load_once(self, model: str) -> asyncio.Task[dict]:
        """One load of `model` through the control endpoint, shared by every request waiting on it."""
        task = self._loads.get(model)
        if task is None:
            task = asyncio.create_task(control_client.load_model(
                self._bus.nc, model, timeout_s=max(self.wait_s, 600.0), catalogue=self.catalogue))
            self._loads[model] = task
            task.add_done_callback(lambda _: self._loads.pop(model, None))
        return task

    async def _cold_start(self, model: str) -> list[wire.NodeStatus]:
        """Have a capable worker load a catalogued model and wait for it, up to the cold-start bound."""
        deadline = time.monotonic() + self.wait_s
        try:
            # Shielded: a client giving up must not abort a load other requests share.
            await asyncio.wait_for(asyncio.shield(self.load_once(model)), self.wait_s)
            return await self._registry.wait_for_model(model, max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            self._metrics.rejections.labels(model, "loading").inc()
            raise unavailable(Unavailable.MODEL_LOADING, {"model": model, "detail": "cold start outlasted its wait"},
                              model=model) from None
        except ControlFailed as exc:
            self._metrics.rejections.labels(model, "no_worker").inc()
            raise unavailable(Unavailable.LOAD_FAILED, {"model": model, "detail": "cold start failed"},
                              model=model, error=exc) from None
        except BUS_ERRORS as exc:
            raise bus_unavailable(exc, f"cold start of {model!r}") from None
