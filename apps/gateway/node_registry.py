"""The live workers as this gateway sees them: one watch on the `helexa_nodes` bucket, read by
everyone who asks which nodes are live, who serves a model, or whether a model was ever served.

Reading the registry has no side effects (metrics read it when they are scraped). Whether a model
was ever served costs a JetStream lookup, so a name found unknown is remembered for a few seconds
(and concurrent lookups of one name share one): a flood of made-up names does not reach JetStream.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from apps.bus import topology, wire
from apps.bus.codes import ModelState, NodeState, Unavailable, unavailable
from apps.bus.reconnects import reconnects_of
from apps.bus.topology import BusLimits
from apps.gateway.bus_client import GatewayBus
from apps.gateway.task_stop import cancel_until_done
from apps.waiting import abandon, done_unless

log = logging.getLogger("helexa.gateway")

# How long a name found unknown stays unknown without asking again, and how many are remembered.
UNKNOWN_MODEL_TTL_S = 5.0
MAX_UNKNOWN_MODELS = 10_000
# How long a request waits for the registry's first reading (at a gateway's start).
READY_WAIT_S = 10.0
# A node entry not refreshed for this many TTLs is forgotten (its worker is gone; clocks may differ a little).
FORGET_AFTER_TTLS = 4
# How long the server keeps a watch's consumer nobody listens to any more (a gateway that died).
WATCH_INACTIVE_S = 300.0


def serving(nodes: list[wire.NodeStatus], model: str, state: ModelState | None = None) -> list[wire.NodeStatus]:
    """The nodes among `nodes` that have `model` (in `state`, if given)."""
    return [n for n in nodes if any(m.model == model and (state is None or m.state == state) for m in n.models)]


def batch_running(nodes: list[wire.NodeStatus], model: str) -> bool:
    """Whether any of `nodes` reported batch-class sequences of `model` running."""
    return any(m.batch_running for n in nodes for m in n.models if m.model == model)


class NodeRegistry:
    def __init__(self, bus: GatewayBus, limits: BusLimits) -> None:
        self._bus = bus
        self._limits = limits
        self._nodes: dict[str, wire.NodeStatus] = {}
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        # Model → when it may be looked up again; insertion order is age order.
        self._unknown: dict[str, float] = {}
        self._lookups: dict[str, asyncio.Task[bool]] = {}

    def start(self) -> None:
        self._watch = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._watch is not None:
            await cancel_until_done(self._watch)

    async def live_nodes(self) -> list[wire.NodeStatus]:
        """Nodes whose last refresh is younger than the bucket's TTL (expiry leaves no marker); a
        503 naming the bus when the registry has not been read within READY_WAIT_S of asking (its
        watch failing since the gateway started), rather than a wait without end."""
        try:
            await asyncio.wait_for(self._ready.wait(), READY_WAIT_S)
        except TimeoutError:
            raise unavailable(Unavailable.BUS_UNAVAILABLE, {"detail": "the node registry has not been read"}) from None
        return self._live()

    def _live(self) -> list[wire.NodeStatus]:
        now = time.time()
        horizon = now - self._limits.node_ttl_s
        # A worker that died (or lost the bus) leaves its entry to expire, and expiry sends no
        # marker: entries long past the TTL are forgotten here, or every node id ever seen would
        # stay (a crash-looping worker makes a new one each start). A later write brings it back.
        gone = now - FORGET_AFTER_TTLS * self._limits.node_ttl_s
        for key in [key for key, n in self._nodes.items() if n.updated_at < gone]:
            del self._nodes[key]
        return [n for n in self._nodes.values() if n.updated_at >= horizon and n.status != NodeState.STOPPING]

    def remembered(self) -> list[str]:
        """The node ids this gateway keeps an entry of, live or not."""
        return list(self._nodes)

    def batch_running(self, model: str) -> bool:
        """Whether a live node last reported batch-class sequences of `model` running."""
        return batch_running(self._live(), model)

    async def models(self) -> list[str]:
        """Every model some live node serves, sorted."""
        return sorted({m.model for n in await self.live_nodes() for m in n.models})

    async def serving(self, model: str, state: ModelState | None = None) -> list[wire.NodeStatus]:
        """Live nodes that have `model` (in `state`, if given)."""
        return serving(await self.live_nodes(), model, state)

    async def wait_for_model(self, model: str, timeout_s: float) -> list[wire.NodeStatus]:
        """Live nodes serving `model` ready, waiting for the registry to show one (TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self._changed
            nodes = await self.serving(model, ModelState.READY)
            if nodes:
                return nodes
            await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0.001))

    async def model_is_known(self, model: str) -> bool:
        """A model some worker has served on this bus (its durable consumer exists), live or not."""
        now = time.monotonic()
        if self._unknown.get(model, 0.0) > now:
            return False
        lookup = self._lookups.get(model)
        if lookup is None:
            lookup = asyncio.create_task(topology.model_is_known(self._bus.js, model))
            self._lookups[model] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop(model, None))
        # Shielded: one caller giving up must not fail the others sharing the lookup.
        known = await asyncio.shield(lookup)
        self._unknown.pop(model, None)
        if not known:
            while len(self._unknown) >= MAX_UNKNOWN_MODELS:
                del self._unknown[next(iter(self._unknown))]
            self._unknown[model] = time.monotonic() + UNKNOWN_MODEL_TTL_S
        return known

    async def _watch_forever(self) -> None:
        """Keep `_nodes` current from one long-lived watch on the registry bucket, instead of
        listing keys per request (slow, and racy while workers rewrite their entries).

        Live workers rewrite their entries every few seconds, so a watch silent for half the TTL
        has most likely lost its consumer (e.g. the NATS server holding it died): start a new one
        before every entry looks expired. A reconnect starts a new one at once.
        """
        while True:
            try:
                await self._watch_once(self._limits.node_ttl_s / 2)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("node registry watch failed; restarting it", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)

    async def _watch_once(self, silence_s: float) -> None:
        """One watch: a push consumer of the bucket's last entry per node, then of every write.

        Not nats-py's KV watch: that is an ordered consumer whose flow-control task wakes the
        gateway four times a second for as long as it runs. Entries are read in order with no
        acks, flow control or heartbeats (a lost consumer is told by its silence, or a reconnect);
        the initial values are over when a message says nothing is pending after it.
        """
        nc, js = self._bus.nc, self._bus.js
        await topology.node_registry(js, self._limits)  # declared if it is not yet
        sub = await js.subscribe(f"$KV.{topology.NODES_BUCKET}.>", manual_ack=True, config=ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE, max_deliver=1,
            flow_control=False, mem_storage=True, num_replicas=1, inactive_threshold=WATCH_INACTIVE_S))
        reconnected = asyncio.Event()
        reconnects_of(nc).add(reconnected.set)
        key_at = len(f"$KV.{topology.NODES_BUCKET}.")
        try:
            info = await sub.consumer_info()
            if not info.num_pending and not (info.delivered.consumer_seq if info.delivered else 0):
                self._ready.set()  # an empty bucket (else the last initial entry says it is the last)
            while not reconnected.is_set():
                try:
                    msg = await _next_unless(sub, reconnected, silence_s)
                except TimeoutError:  # nats-py's TimeoutError is one too
                    return
                if msg is None:
                    return
                key = msg.subject[key_at:]
                operation = msg.headers.get(KV_OP) if msg.headers else None
                if operation in (KV_DEL, KV_PURGE) or not msg.data:
                    self._nodes.pop(key, None)
                else:
                    try:
                        self._nodes[key] = wire.node_decoder.decode(msg.data)
                    except msgspec.DecodeError:
                        log.warning("undecodable node entry ignored", extra={"node": key})
                if not self._ready.is_set() and not msg.metadata.num_pending:
                    self._ready.set()  # the initial values are in
                self._changed.set()
                self._changed = asyncio.Event()
        finally:
            reconnects_of(nc).discard(reconnected.set)
            try:
                await sub.unsubscribe()
            except (nats.errors.Error, TimeoutError):
                pass


async def _next_unless(sub: JetStreamContext.PushSubscription, stop: asyncio.Event,
                       timeout_s: float) -> Msg | None:
    """`sub`'s next message; None once `stop` is set first; TimeoutError after `timeout_s`."""
    taking = asyncio.ensure_future(sub.next_msg(timeout=timeout_s))
    if not await done_unless(taking, stop):
        abandon(taking)
        return None
    return taking.result()
