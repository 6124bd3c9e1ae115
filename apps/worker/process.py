"""The worker process: one node on the bus serving one or more models.

It owns the NATS connection and what hangs off it for the whole node: the node's `helexa_nodes`
entry (refreshed every few seconds, and at once when a model changes state), the cancellation
listener (`liveness.Cancellations`), the NATS micro service `helexa-worker` (its endpoints are
`service_endpoints`), the models' lifecycle (load, unload), and one `ModelLoop` per loaded model,
which gets what it needs of all this handed down in a `NodeBus` when it starts.

When the server closes the connection for good (a server `-ERR`; nats-py reconnects after anything
else), `run` stops the models and raises `BusConnectionLost`: `helexa worker` exits non-zero
(EXIT_BUS_LOST) so that `helexa up` or a supervisor restarts it, rather than rebuilding every
subscription, pull loop and running request on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.micro

from apps.bus import connection, roles, topology, wire
from apps.bus.codes import ErrorCode, ModelState, NodeState, ServingError, Unavailable, unavailable
from apps.bus.publish import held_events, publish_event
from apps.bus.topology import BusLimits
from apps.fleet.catalogue import CatalogueEntry
from apps.logs import announce_ready
from apps.settings import WorkerSettings
from apps.worker.intake import NodeBus
from apps.worker.liveness import Cancellations
from apps.worker.model_loop import ModelLoop
from apps.worker.restarts import CoreExit, SupervisedEngine
from apps.worker.service_endpoints import ServiceEndpoints, helexa_version
from engine.frontend.protocol import EngineRefused

log = logging.getLogger("helexa.worker")

# Loads a model for a control request: (source, served name, memory it needs) -> its loop.
Opener = Callable[[str, str, int], Awaitable[ModelLoop]]


def _machine_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


class WorkerProcess:
    def __init__(self, settings: WorkerSettings, limits: BusLimits, opener: Opener | None = None,
                 catalogue: dict[str, CatalogueEntry] | None = None) -> None:
        self.settings = settings
        self.limits = limits
        self.opener = opener
        self.catalogue = catalogue or {}
        self.node = settings.node_id
        self.memory_mb = settings.memory_mb or _machine_memory_mb()
        self.models: dict[str, ModelLoop] = {}
        # Where each model this worker has served came from, so an unloaded one can come back.
        self.sources: dict[str, tuple[str, int]] = {}
        self.loading: set[str] = set()
        self._lifecycle = asyncio.Lock()
        self._last_summary: tuple[str, tuple[tuple[str, str], ...]] | None = None
        self._status_changed = asyncio.Event()
        # Set once the node is on the bus and serving.
        self.ready = asyncio.Event()
        # The server closed our connection for good (not us, shutting down).
        self._closed = asyncio.Event()
        self._closing = False
        self.cancellations = Cancellations(self._abort_held)

    async def run(self, stop: asyncio.Event, first: ModelLoop | None = None) -> None:
        """Serve until `stop` is set; raises BusConnectionLost if the server closed the connection."""
        try:
            self.nc = await connection.connect(self.settings.nats_url, name=f"helexa-worker-{self.node}",
                                             role=roles.WORKER, closed_cb=self._on_closed, stop=stop)
        except topology.Stopped:
            if first is not None:
                await first.engine.shutdown()
            return
        self.js = self.nc.jetstream()
        try:
            # Declared by an administrator (`helexa up`, `helexa bus setup`): a worker may not.
            await topology.require_topology(self.js, stop=stop)
        except topology.Stopped:
            if first is not None:
                await first.engine.shutdown()
            self._closing = True
            await self.nc.close()
            return
        self.kv = await topology.node_registry(self.js, self.limits)
        await self.cancellations.subscribe(self.nc)
        service = await ServiceEndpoints(self.nc, self.js, self.node, self.models, self.loading,
                                         self.load, self.unload).register()
        if first is not None:
            await self._add(first)
        await self.publish_status()
        status_task = asyncio.create_task(self._status_loop())
        ready: dict[str, Any] = {"node": self.node, "models": sorted(self.models)}
        if first is not None:
            ready.update(model=first.model_id, max_model_len=first.context.derive().context)
            info = first.engine.info
            # What the engine runs in and why (the banner of `helexa up` shows them); scripted
            # engines have no dtype, and unknown fields stay absent.
            ready.update({k: v for k, v in (("dtype", info.dtype), ("dtype_reason", info.dtype_reason)) if v})
        announce_ready("worker", **ready)
        self.ready.set()
        stopping, lost = asyncio.create_task(stop.wait()), asyncio.create_task(self._closed.wait())
        try:
            await asyncio.wait({stopping, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            lost.cancel()
            status_task.cancel()
            await self._shut_down(service)
        if self._closed.is_set():
            raise BusConnectionLost(f"the NATS server closed the connection: {self.nc.last_error!r}")

    async def _on_closed(self) -> None:
        if not self._closing:
            log.error("NATS connection closed by the server; the worker exits",
                      extra={"node": self.node, "error": repr(self.nc.last_error)})
            self._closed.set()

    async def _shut_down(self, service: nats.micro.Service) -> None:
        self._closing = True
        if self._closed.is_set():
            # Nothing can reach a client or JetStream any more: stop the models at once (their
            # messages go to other workers after the ack wait) and let the node entry expire.
            await asyncio.gather(*(loop.stop(grace_s=0.0) for loop in self.models.values()))
            return
        await service.stop()
        await asyncio.gather(*(loop.stop() for loop in self.models.values()))
        with contextlib.suppress(nats.errors.Error):
            await self.kv.delete(self.node)
        if held_events():
            log.warning("events EVENTS did not take are lost at shutdown", extra={"held": held_events()})
        # drain() waits out pull subscriptions (30 s in nats-py); flush what we sent and close.
        await self.nc.flush()
        await self.nc.close()

    async def _add(self, loop: ModelLoop) -> None:
        await loop.start(NodeBus(nc=self.nc, js=self.js, node=self.node, limits=self.limits,
                                 cancelled=self.cancellations, status_changed=self._status_changed))
        self.models[loop.model_id] = loop
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
        await publish_event(self.js, wire.CoreRestarted(
            model=loop.model_id, node=self.node, restarted=report.restarted, exitcode=report.exitcode,
            held_requests=report.held_requests, restarts=report.restarts, max_restarts=report.max_restarts,
            restart_ms=report.restart_ms, detail=report.out_of_service,
        ))

    async def _abort_held(self, request_id: str) -> bool:
        for loop in self.models.values():
            if request_id in loop.requests:
                await loop.abort(loop.requests[request_id])
                return True
        return False

    # -- model lifecycle -----------------------------------------------------------------------

    async def load(self, model: str) -> None:
        """Load `model` (from the catalogue, or where it came from before); a poisoned one reloads."""
        async with self._lifecycle:
            current = self.models.get(model)
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
            await self.publish_status()
            try:
                loop = await self.opener(source[0], model, source[1])
                await self._add(loop)
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
            await self.publish_status()
            log.info("model loaded", extra={"model": model})

    async def unload(self, model: str) -> None:
        async with self._lifecycle:
            if model not in self.models:
                raise ServingError(404, ErrorCode.MODEL_NOT_FOUND, f"the model '{model}' is not loaded on this worker")
            await self._remove(model)
            await self.publish_status()
            log.info("model unloaded", extra={"model": model})

    async def _remove(self, model: str) -> None:
        loop = self.models.pop(model)
        await loop.stop()

    # -- the node registry ---------------------------------------------------------------------

    def free_memory_mb(self) -> int:
        return max(self.memory_mb - sum(s.memory_mb for s in self.models.values()), 0)

    def status(self, state: NodeState = NodeState.READY) -> wire.NodeStatus:
        return wire.NodeStatus(
            node=self.node, models=[s.status() for s in self.models.values()], version=helexa_version(), status=state,
            memory_mb=self.memory_mb, free_memory_mb=self.free_memory_mb(), loading=sorted(self.loading),
        )

    async def publish_status(self, state: NodeState = NodeState.READY) -> None:
        status = self.status(state)
        await self.kv.put(self.node, wire.encode(status))
        # The ledger hears of changes (models loaded or unloaded, poisoned), not of every refresh.
        degraded = any(m.state != ModelState.READY for m in status.models)
        summary = (NodeState.DEGRADED if degraded and state == NodeState.READY else state,
                   tuple((m.model, m.state) for m in status.models))
        if summary != self._last_summary:
            self._last_summary = summary
            await publish_event(self.js, wire.NodeStatusChanged(
                model=status.models[0].model if status.models else "-", node=self.node, status=summary[0],
                version=status.version, models=[m.model for m in status.models],
                slots=sum(m.slots for m in status.models), free_slots=sum(m.free_slots for m in status.models),
                kv_usage=max((m.kv_usage for m in status.models), default=None),
            ))

    async def _status_loop(self) -> None:
        while True:
            # Every interval, or at once when a model changed state (gateways must hear of a poisoned one now).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_changed.wait(), self.settings.status_interval_s)
            self._status_changed.clear()
            if self.nc.is_closed and not self._closing:
                await self._on_closed()  # in case nats-py closed it without calling back
                return
            try:
                await self.publish_status()
            except Exception as exc:  # a missed refresh must never end the loop: the node would vanish
                log.warning("status publish failed", extra={"error": repr(exc)})


class BusConnectionLost(Exception):
    """The NATS server closed this worker's connection for good (nats-py never reconnects after a
    server `-ERR`). The worker does not rebuild itself on a new connection: it exits with
    EXIT_BUS_LOST, and `helexa up` or any supervisor starts it again."""


# EX_TEMPFAIL: a temporary failure; starting again is the cure.
EXIT_BUS_LOST = 75
# EX_CONFIG: the engine refused the configuration on this machine (`engine.frontend.protocol.EngineRefused`,
# e.g. a dtype the CPU cannot run); starting again would fail the same way.
EXIT_REFUSED = 78
