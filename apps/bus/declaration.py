"""Declaring the bus (as its administrator) and waiting for it to be declared (as an app).

`ensure_topology` declares every stream, bucket and shared consumer that `apps.bus.topology` names,
idempotently, converging limits an operator changed back on the fleet's own (`helexa up`, `helexa bus
setup`). The apps' NATS roles may not create or change streams (`apps.bus.roles`), so each app waits
with `require_topology` until an administrator has declared them.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE, ObjectStore

from apps.bus import topology

log = logging.getLogger("helexa.bus")


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with other settings (e.g. limits changed by an operator): converge on ours.
        await js.update_stream(config)


async def ensure_topology(js: JetStreamContext, limits: topology.BusLimits) -> None:
    """Declare (or converge) both streams, the node registry and the large-request bucket.
    `limits` is the fleet's own (`apps.settings.bus_limits`): declaring with other limits would
    reset the fleet's streams."""
    await _ensure_stream(js, topology.requests_stream_config(limits))
    await _ensure_stream(js, topology.events_stream_config(limits))
    await topology.node_registry(js, limits)
    await large_request_store(js, limits)
    await _object_store(js, topology.LARGE_EVENTS_BUCKET, topology.large_events_config(limits))
    await _object_store(js, topology.FILES_BUCKET, topology.files_config(limits))
    await _ensure_stream(js, topology.batches_stream_config(limits))
    await js.add_consumer(topology.BATCHES_STREAM, config=topology.batch_runners_config(limits))


def topology_streams() -> tuple[str, ...]:
    """The streams `ensure_topology` declares, the node registry's and the buckets' included."""
    return (topology.REQUESTS_STREAM, topology.EVENTS_STREAM, f"KV_{topology.NODES_BUCKET}",
            OBJ_STREAM_TEMPLATE.format(bucket=topology.LARGE_REQUESTS_BUCKET),
            OBJ_STREAM_TEMPLATE.format(bucket=topology.LARGE_EVENTS_BUCKET),
            OBJ_STREAM_TEMPLATE.format(bucket=topology.FILES_BUCKET), topology.BATCHES_STREAM)


class Stopped(Exception):
    """`connect` gave up because the app was asked to stop before NATS answered."""


class TopologyMissing(nats.errors.Error):
    """The bus lacks streams that only an administrator declares (`helexa bus setup`, `helexa up`);
    a `nats.errors.Error`, so code that treats any bus error as "unavailable" catches it."""


async def require_topology(js: JetStreamContext, *, wait: bool = True, stop: asyncio.Event | None = None,
                           every_s: float = 1.0) -> None:
    """Return once every stream of the topology exists. The apps do not declare them (their NATS
    roles may not create or change streams): an administrator does, with the fleet's limits. While
    some are missing this waits, saying so in one log line (`wait`; else TopologyMissing at once);
    `stop` set meanwhile raises Stopped."""
    said = False
    while True:
        missing = []
        for stream in topology_streams():
            try:
                await js.stream_info(stream)
            except NotFoundError:
                missing.append(stream)
        if not missing:
            return
        what = (f"the bus has no {', '.join(missing)}: declare the topology with the administrator's "
                "credentials (`helexa bus setup`; `helexa up` does it)")
        if not wait:
            raise TopologyMissing(what)
        if not said:
            log.warning("waiting for the bus topology", extra={"missing": missing, "error": what})
            said = True
        if stop is None:
            await asyncio.sleep(every_s)
        else:
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                continue
            raise Stopped("stopped while waiting for the bus topology")


async def large_request_store(js: JetStreamContext, limits: topology.BusLimits) -> ObjectStore:
    """The large-request bucket, declared (or its limits converged on ours)."""
    return await _object_store(js, topology.LARGE_REQUESTS_BUCKET, topology.large_requests_config(limits))


async def _object_store(js: JetStreamContext, bucket: str, config: ObjectStoreConfig) -> ObjectStore:
    try:
        return await js.create_object_store(bucket, config=config)
    except BadRequestError:
        # It exists with other limits: converge the stream under it, as `_ensure_stream` does.
        info = await js.stream_info(OBJ_STREAM_TEMPLATE.format(bucket=bucket))
        stream = info.config
        stream.max_age, stream.max_bytes, stream.num_replicas = config.ttl, config.max_bytes, config.replicas
        await js.update_stream(stream)
        return await js.object_store(bucket)
