"""The gateway's side of the bus: publish a request, follow its reply frames, read live nodes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from apps.bus import topology, wire
from apps.bus.codes import ModelState, NodeState
from apps.bus.publish import publish, publish_event
from apps.bus.topology import BusLimits
from apps.fleet import control_client
from apps.fleet.catalogue import CatalogueEntry
from apps.gateway.admission import Admission, AdmissionLimits
from apps.gateway.metrics import GatewayMetrics

log = logging.getLogger("helexa.gateway")


class ReplyTimeout(Exception):
    """No frame arrived within the allowed silence."""


class ReplyStream:
    """Frames of one request's reply subject, in order, duplicates and stale attempts dropped.

    Once the client has been sent text, `lock()` pins the attempt that sent it: a later attempt
    (JetStream redelivered the request) would start the text again, so its frames are dropped.
    """

    def __init__(self, subscription: Subscription) -> None:
        self._sub = subscription
        # The requester's answer to liveness probes, and what to do on close; set by its owner.
        self.alive: Subscription | None = None
        self.on_close: Callable[[], None] | None = None
        self._next_seq = 0
        self._attempt = 0
        self._locked = False
        self.node: str | None = None

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def locked_attempt(self) -> int | None:
        return self._attempt if self._locked else None

    def lock(self) -> None:
        self._locked = True

    async def next(self, timeout_s: float) -> wire.ReplyFrame:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplyTimeout
            try:
                msg = await self._sub.next_msg(timeout=remaining)
            except TimeoutError:  # nats-py raises its own or asyncio's; both are TimeoutError
                raise ReplyTimeout from None
            try:
                frame = wire.frame_decoder.decode(msg.data)
            except msgspec.DecodeError:
                log.warning("undecodable reply frame dropped", extra={"subject": msg.subject})
                continue
            if frame.attempt != self._attempt:
                # A redelivered request restarts the sequence; only a fresh attempt may do so.
                if frame.attempt < self._attempt or self._locked:
                    continue
                self._attempt, self._next_seq = frame.attempt, 0
            if frame.seq < self._next_seq:
                continue
            self._next_seq = frame.seq + 1
            if isinstance(frame, wire.Accepted):
                self.node = frame.node
            return frame

    async def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        for sub in (self._sub, self.alive):
            if sub is None:
                continue
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass


class GatewayBus:
    def __init__(self, nc: NatsClient, kv: KeyValue, limits: BusLimits,
                 admission: AdmissionLimits | None = None,
                 per_model: dict[str, AdmissionLimits] | None = None,
                 catalogue: dict[str, CatalogueEntry] | None = None, cold_start_wait_s: float = 120.0) -> None:
        self.metrics = GatewayMetrics()
        self.catalogue = catalogue or {}
        self.cold_start_wait_s = cold_start_wait_s
        self._loads: dict[str, asyncio.Task[dict]] = {}
        self._nodes_changed = asyncio.Event()
        # Stream sequence of each request this gateway waits on -> its reply subject, so a
        # max-deliveries advisory (which names only the sequence) reaches the right client.
        self._waiting: dict[int, str] = {}
        self.admission_limits = admission or AdmissionLimits()
        self.per_model_admission = per_model or {}
        self._admissions: dict[str, Admission] = {}
        self.metrics.admissions = self._admissions
        self._nodes: dict[str, wire.NodeStatus] = {}
        self._nodes_ready = asyncio.Event()
        self._node_watch: asyncio.Task[None] | None = None
        self.nc = nc
        self.js = nc.jetstream()
        self.kv = kv
        self.limits = limits
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, limits: BusLimits, admission: AdmissionLimits | None = None,
                      per_model: dict[str, AdmissionLimits] | None = None,
                      catalogue: dict[str, CatalogueEntry] | None = None,
                      cold_start_wait_s: float = 120.0) -> GatewayBus:
        nc = await topology.connect(url, name="helexa-gateway")
        js = nc.jetstream()
        await topology.ensure_topology(js, limits)
        kv = await topology.node_registry(js, limits)
        bus = cls(nc, kv, limits, admission, per_model, catalogue, cold_start_wait_s)
        bus._node_watch = asyncio.create_task(bus.watch_nodes())
        await nc.subscribe(topology.max_deliveries_advisories(), cb=bus._on_max_deliveries)
        return bus

    async def close(self) -> None:
        if self._node_watch is not None:
            self._node_watch.cancel()
        await self.nc.drain()

    async def submit(self, request: wire.GenerateRequest) -> ReplyStream:
        """Listen on the reply subject first, then publish, so no frame can be missed. While this
        process lives it answers the worker's liveness probes; when it dies, nobody does."""
        sub = await self.nc.subscribe(request.reply_subject)
        stream = ReplyStream(sub)

        async def still_listening(msg: Msg) -> None:
            # A worker about to serve a redelivered attempt asks with its attempt number: once
            # another attempt has sent the client text, this one must not run at all.
            try:
                asking = int(msg.data) if msg.data else None
            except ValueError:
                asking = None
            taken = asking is not None and stream.locked_attempt not in (None, asking)
            await msg.respond(topology.ATTEMPT_TAKEN if taken else b"")

        stream.alive = await self.nc.subscribe(topology.alive_subject(request.reply_subject), cb=still_listening)
        request = msgspec.structs.replace(request, liveness_probe=True)
        try:
            ack = await publish(self.js, topology.request_subject(request.model), wire.encode(request),
                                request.request_id)
        except BaseException:
            await stream.close()
            raise
        self._waiting[ack.seq] = request.reply_subject
        stream.on_close = lambda: self._waiting.pop(ack.seq, None)
        return stream

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """JetStream gave up on a request (every delivery's worker died holding it): tell its client
        now instead of letting it wait out a deadline, and drop the message from the stream."""
        try:
            advisory = json.loads(msg.data)
            seq = int(advisory["stream_seq"])
        except (ValueError, KeyError, TypeError):
            return
        reply_subject = self._waiting.pop(seq, None)
        if reply_subject is None:
            return  # another gateway's request
        deliveries = int(advisory.get("deliveries") or self.limits.max_deliver)
        frame = wire.ErrorFrame(
            seq=0, attempt=deliveries + 1, status=500, code="delivery_failed",
            message=f"The request was tried {deliveries} times and every worker serving it stopped; "
                    "it will not be tried again.",
        )
        await self.nc.publish(reply_subject, wire.encode(frame))
        try:
            await self.js.delete_msg(topology.REQUESTS_STREAM, seq)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not drop an undeliverable request", extra={"seq": seq, "error": str(exc)})

    def admission(self, model: str) -> Admission:
        """This gateway's admission control for `model`, with its own limits if configured."""
        if model not in self._admissions:
            self._admissions[model] = Admission(self.per_model_admission.get(model, self.admission_limits))
        return self._admissions[model]

    async def publish_event(self, event: wire.AnyEvent) -> None:
        await publish_event(self.js, event)

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    def cancel_soon(self, request_id: str) -> None:
        """Publish a cancellation even from code that is itself being cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.nc.publish(topology.cancel_subject(request_id), b"")
        except nats.errors.Error as exc:
            log.warning("cancel publish failed", extra={"request_id": request_id, "error": str(exc)})

    async def watch_nodes(self) -> None:
        """Keep `_nodes` current from one long-lived watch on the registry bucket, instead of
        listing keys per request (slow, and racy while workers rewrite their entries).

        Live workers rewrite their entries every few seconds, so a watch silent for half the TTL
        has most likely lost its consumer (e.g. the NATS server holding it died): start a new one
        before every entry looks expired.
        """
        while True:
            try:
                await self._watch_once(self.limits.node_ttl_s / 2)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("node registry watch failed; restarting it", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)

    async def _watch_once(self, silence_s: float) -> None:
        watcher = await self.kv.watchall()
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=silence_s)
                except TimeoutError:  # nats-py's TimeoutError is one too
                    return
                if entry is None:  # the end of the initial values
                    self._nodes_ready.set()
                    continue
                if not hasattr(entry, "operation"):  # the watcher was stopped under us
                    return
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    self._nodes.pop(entry.key, None)
                else:
                    try:
                        self._nodes[entry.key] = wire.node_decoder.decode(entry.value)
                    except msgspec.DecodeError:
                        log.warning("undecodable node entry ignored", extra={"node": entry.key})
                self._nodes_changed.set()
                self._nodes_changed = asyncio.Event()
        finally:
            try:
                await watcher.stop()
            except (nats.errors.Error, TimeoutError):
                pass

    async def live_nodes(self) -> list[wire.NodeStatus]:
        """Nodes whose last refresh is younger than the bucket's TTL (expiry leaves no marker)."""
        await self._nodes_ready.wait()
        horizon = time.time() - self.limits.node_ttl_s
        nodes = [n for n in self._nodes.values() if n.updated_at >= horizon and n.status != NodeState.STOPPING]
        self.metrics.set_nodes(nodes)
        return nodes

    async def wait_for_model(self, model: str, timeout_s: float) -> list[wire.NodeStatus]:
        """Live nodes serving `model` ready, waiting for the registry to show one (TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self._nodes_changed
            nodes = [n for n in await self.live_nodes()
                     if any(m.model == model and m.state == ModelState.READY for m in n.models)]
            if nodes:
                return nodes
            await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0.001))

    def load_once(self, model: str) -> asyncio.Task[dict]:
        """One load of `model` through the control endpoint, shared by every request waiting on it."""
        task = self._loads.get(model)
        if task is None:
            task = asyncio.create_task(control_client.load_model(
                self.nc, model, timeout_s=max(self.cold_start_wait_s, 600.0), catalogue=self.catalogue))
            self._loads[model] = task
            task.add_done_callback(lambda _: self._loads.pop(model, None))
        return task

    async def model_is_known(self, model: str) -> bool:
        return await topology.model_is_known(self.js, model)

    async def is_ready(self) -> bool:
        return self.nc.is_connected
