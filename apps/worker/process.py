"""The worker process: one node on the bus serving one or more models.

It owns the NATS connection and what hangs off it for the whole node: the node's `helexa_nodes`
entry (`node_status`), the cancellation listener (`liveness.Cancellations`), the NATS micro
service `helexa-worker` (`service_endpoints`) and the models' lifecycle (`model_lifecycle`: load,
unload, one `ModelLoop` per loaded model, which gets what it needs of all this handed down in a
`NodeBus` when it starts).

When the server closes the connection for good (a server `-ERR`; nats-py reconnects after anything
else), `run` stops the models and raises `BusConnectionLost`: `helexa worker` exits non-zero
(EXIT_BUS_LOST) so that `helexa up` or a supervisor restarts it, rather than rebuilding every
subscription, pull loop and running request on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import nats.errors
import nats.micro

from apps.bus import connection, declaration, roles, topology
from apps.bus.event_publish import held_events, keep_held_on_disk
from apps.bus.topology import BusLimits
from apps.fleet.catalogue import CatalogueEntry
from apps.logs import announce_ready
from apps.settings import WorkerSettings, data_dir
from apps.worker.intake import NodeBus
from apps.worker.liveness import Cancellations
from apps.worker.model_lifecycle import ModelLifecycle, Opener
from apps.worker.model_loop import ModelLoop
from apps.worker.node_status import NodeEntry
from apps.worker.service_endpoints import ServiceEndpoints

log = logging.getLogger("helexa.worker")

def _machine_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


class WorkerProcess:
    def __init__(self, settings: WorkerSettings, limits: BusLimits, opener: Opener | None = None,
                 catalogue: dict[str, CatalogueEntry] | None = None) -> None:
        self.settings = settings
        self.limits = limits
        self.node = settings.node_id
        self.lifecycle = ModelLifecycle(settings.memory_mb or _machine_memory_mb(), opener, catalogue or {})
        # The lifecycle's own, read by the service endpoints and by tests.
        self.models: dict[str, ModelLoop] = self.lifecycle.loops
        self.loading: set[str] = self.lifecycle.loading
        self.load = self.lifecycle.load
        self.unload = self.lifecycle.unload
        self.entry = NodeEntry(self.node, self.lifecycle, settings.status_interval_s)
        # Set once the node is on the bus and serving.
        self.ready = asyncio.Event()
        # The server closed our connection for good (not us, shutting down).
        self._closed = asyncio.Event()
        self._closing = False
        self.cancellations = Cancellations(self.lifecycle.abort_held)

    async def run(self, stop: asyncio.Event, first: ModelLoop | None = None) -> None:
        """Serve until `stop` is set; raises BusConnectionLost if the server closed the connection."""
        try:
            self.nc = await connection.connect(self.settings.nats_url, name=f"helexa-worker-{self.node}",
                                             role=roles.WORKER, closed_cb=self._on_closed, stop=stop)
        except declaration.Stopped:
            if first is not None:
                await first.engine.shutdown()
            return
        self.js = self.nc.jetstream()
        try:
            # Declared by an administrator (`helexa up`, `helexa bus setup`): a worker may not.
            await declaration.require_topology(self.js, stop=stop)
        except declaration.Stopped:
            if first is not None:
                await first.engine.shutdown()
            self._closing = True
            await self.nc.close()
            return
        spooled = asyncio.create_task(keep_held_on_disk(self.js, data_dir(), roles.WORKER))
        self.kv = await topology.node_registry(self.js, self.limits)
        self.entry.attach(self.kv, self.js)
        self.lifecycle.attach(NodeBus(nc=self.nc, js=self.js, node=self.node, limits=self.limits,
                                      cancelled=self.cancellations, status_changed=self.entry.changed),
                              self.entry.publish)
        await self.cancellations.subscribe(self.nc)
        service = await ServiceEndpoints(self.nc, self.js, self.node, self.models, self.loading,
                                         self.load, self.unload).register()
        if first is not None:
            await self.lifecycle.add(first)
        await self.entry.publish()
        status_task = asyncio.create_task(self.entry.refresh(self._connection_lost))
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
            spooled.cancel()
            await self._shut_down(service)
        if self._closed.is_set():
            raise BusConnectionLost(f"the NATS server closed the connection: {self.nc.last_error!r}")

    async def _on_closed(self) -> None:
        if not self._closing:
            log.error("NATS connection closed by the server; the worker exits",
                      extra={"node": self.node, "error": repr(self.nc.last_error)})
            self._closed.set()

    async def _connection_lost(self) -> bool:
        if self.nc.is_closed and not self._closing:
            await self._on_closed()  # in case nats-py closed it without calling back
            return True
        return False

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
            log.warning("events EVENTS did not take yet: the next worker here publishes those on disk",
                        extra={"held": held_events()})
        # drain() waits out pull subscriptions (30 s in nats-py); flush what we sent and close.
        await self.nc.flush()
        await self.nc.close()


class BusConnectionLost(Exception):
    """The NATS server closed this worker's connection for good (nats-py never reconnects after a
    server `-ERR`). The worker does not rebuild itself on a new connection: it exits with
    EXIT_BUS_LOST, and `helexa up` or any supervisor starts it again."""


# EX_TEMPFAIL: a temporary failure; starting again is the cure.
EXIT_BUS_LOST = 75
# EX_CONFIG: the engine refused the configuration on this machine (`engine.frontend.protocol.EngineRefused`,
# e.g. a dtype the CPU cannot run); starting again would fail the same way.
EXIT_REFUSED = 78
