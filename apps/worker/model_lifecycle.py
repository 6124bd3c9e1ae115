"""The models a worker serves (runs in the worker process): loading one (from the catalogue, or
from where it came before, when the node has the memory), unloading one, starting each one's
`ModelLoop` on the node's bus, and what happens when a model's engine core dies.

Loads and unloads run one at a time; every change is published in the node entry (`publish`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.bus.event_publish import publish_event
from apps.bus.events import CoreRestarted
from apps.fleet.catalogue import CatalogueEntry
from apps.worker.intake import NodeBus
from apps.worker.model_loop import ModelLoop
from apps.worker.restarts import CoreExit, SupervisedEngine
from engine.frontend.protocol import EngineRefused

log = logging.getLogger("helexa.worker")

# Loads a model for a control request: (source, served name, memory it needs) -> its loop.
Opener = Callable[[str, str, int], Awaitable[ModelLoop]]


class ModelLifecycle:
    """One node's models; `attach` it to the node's bus before adding or loading one."""

    def __init__(self, memory_mb: int, opener: Opener | None, catalogue: dict[str, CatalogueEntry]) -> None:
        self.memory_mb = memory_mb
        self.opener = opener
        self.catalogue = catalogue
        self.loops: dict[str, ModelLoop] = {}
        # Where each model this worker has served came from, so an unloaded one can come back.
        self.sources: dict[str, tuple[str, int]] = {}
        self.loading: set[str] = set()
        self._lock = asyncio.Lock()

    def attach(self, bus: NodeBus, publish: Callable[[], Awaitable[None]]) -> None:
        self.bus = bus
        self._publish = publish

    def free_memory_mb(self) -> int:
        return max(self.memory_mb - sum(s.memory_mb for s in self.loops.values()), 0)

    async def add(self, loop: ModelLoop) -> None:
        await loop.start(self.bus)
        self.loops[loop.model_id] = loop
        self.sources[loop.model_id] = (loop.source, loop.memory_mb)
        if isinstance(loop.engine, SupervisedEngine):
            loop.engine.on_exit = functools.partial(self._core_exited, loop)

    async def _core_exited(self, loop: ModelLoop, report: CoreExit) -> None:
        """A model's engine core died (`apps.worker.restarts`): the ledger hears of it; the model
        pulls again on its new core, or is out of service until reloaded."""
        if report.restarted:
            loop.wake()
        elif report.out_of_service is not None:
            loop.health.poison(report.out_of_service)  # a no-op where its runs saw the device fault first
        await publish_event(self.bus.js, CoreRestarted(
            model=loop.model_id, node=self.bus.node, restarted=report.restarted, exitcode=report.exitcode,
            held_requests=report.held_requests, restarts=report.restarts, max_restarts=report.max_restarts,
            restart_ms=report.restart_ms, detail=report.out_of_service,
        ))

    async def load(self, model: str) -> None:
        """Load `model` (from the catalogue, or where it came from before); a poisoned one reloads."""
        async with self._lock:
            current = self.loops.get(model)
            if current is not None and current.poisoned is None:
                return
            entry = self.catalogue.get(model)
            source = (entry.source, entry.min_memory_mb) if entry else self.sources.get(model)
            if source is None:
                raise ServingError(404, ErrorCode.MODEL_NOT_FOUND,
                                   f"the model '{model}' is neither in the catalogue nor served here before")
            if self.opener is None:
                raise unavailable(Unavailable.CANNOT_LOAD)
            if current is not None:
                await self._remove(model)
            if source[1] > self.free_memory_mb():
                raise unavailable(Unavailable.NO_MEMORY, model=model, needed_mb=source[1],
                                  free_mb=self.free_memory_mb())
            self.loading.add(model)
            await self._publish()
            try:
                await self.add(await self.opener(source[0], model, source[1]))
            except ServingError:
                raise
            except EngineRefused as exc:  # this worker's configuration cannot run here: one line, no traceback
                log.error("model load refused: %s", exc, extra={"model": model})
                raise ServingError(409, ErrorCode.MODEL_UNAVAILABLE, f"loading '{model}' refused: {exc}") from None
            except Exception as exc:
                log.exception("model load failed", extra={"model": model})
                raise ServingError(500, ErrorCode.INTERNAL_ERROR, f"loading '{model}' failed: {exc}") from exc
            finally:
                self.loading.discard(model)
            await self._publish()
            log.info("model loaded", extra={"model": model})

    async def unload(self, model: str) -> None:
        async with self._lock:
            if model not in self.loops:
                raise ServingError(404, ErrorCode.MODEL_NOT_FOUND, f"the model '{model}' is not loaded on this worker")
            await self._remove(model)
            await self._publish()
            log.info("model unloaded", extra={"model": model})

    async def _remove(self, model: str) -> None:
        loop = self.loops.pop(model)
        await loop.stop()

    async def abort_held(self, request_id: str) -> bool:
        """Abort `request_id` in the model that holds it (a cancel); False when none does."""
        for loop in self.loops.values():
            if request_id in loop.requests:
                await loop.abort(loop.requests[request_id])
                return True
        return False
