"""Subjects, streams, consumers and the node registry: the shape of the bus in one place.

`apps.bus.declaration` declares everything idempotently, as an administrator (`helexa up`, `helexa bus
setup`): the apps' NATS roles may not create or change streams (`apps.bus.roles`, which derives
their permissions from the names here), so each app waits for it (`declaration.require_topology`), then asks
this module for the subject or consumer it needs instead of spelling names itself.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from apps.bus.pull import BatchPuller
from engine.frontend.protocol import ServiceClass

log = logging.getLogger("helexa.bus")

REQUESTS_STREAM = "REQUESTS"
EVENTS_STREAM = "EVENTS"
NODES_BUCKET = "helexa_nodes"
# JetStream Object Store bucket of requests too large for one message (`apps.bus.large_requests`).
LARGE_REQUESTS_BUCKET = "helexa_requests"
# Object Store bucket of events too large for one message, referenced from EVENTS (`events.EventRef`).
LARGE_EVENTS_BUCKET = "helexa_events"
# Object Store bucket of uploaded files (`/v1/files`), one object per file id, kept until deleted.
FILES_BUCKET = "helexa_files"
RECORDER_CONSUMER = "recorder"
# The work queue of batches (`/v1/batches`): one claim message per batch, taken by a gateway's
# batch runner through the one durable consumer, acked only once the batch is finished.
BATCHES_STREAM = "BATCHES"
BATCH_RUNNERS_CONSUMER = "batch-runners"
BATCH_SUBJECT = "helexa.batch.run"
# A batch lives at most its 24 h completion window; the stream keeps a claim a day past that.
BATCH_CLAIM_MAX_AGE_S = 48 * 3600.0
# The shortest ack wait a batch claim may have (`BusLimits.batch_ack_wait_s`): a runner that cannot
# read the consumer's own keeps its claim alive at a quarter of this.
MIN_BATCH_ACK_WAIT_S = 4.0

_REQUEST_PREFIX = "helexa.req"
# The last token of a model's batch-class request subject (a model's own token is one token, so
# `helexa.req.<model>.batch` never overlaps another model's interactive `helexa.req.<model>`).
_BATCH_TOKEN = "batch"
_EVENT_PREFIX = "helexa.events"
_CANCEL_PREFIX = "helexa.cancel"
_NODE_PREFIX = "helexa.node"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


# Longest subject token this module builds. nats-server refuses a control line over 4096 bytes by
# closing the connection, and nats-py takes that -ERR as final: a subject must never get near it.
MAX_TOKEN_BYTES = 1024


class TokenTooLong(ValueError):
    """A name whose subject token would exceed MAX_TOKEN_BYTES (refused, never sent)."""


def model_token(model: str) -> str:
    """A model id as one subject token: dots, slashes and spaces become `~hex`, reversibly.
    Raises TokenTooLong beyond MAX_TOKEN_BYTES (escaping can triple a name's length)."""
    token = _UNSAFE.sub(lambda m: "~" + m.group().encode().hex(), model)
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenTooLong(f"a subject token of {len(token)} bytes (at most {MAX_TOKEN_BYTES})")
    return token


def request_subject(model: str, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> str:
    """Where a request for `model` is queued: interactive ones on the model's subject, batch-class
    ones (the batch runner's lines) on one of their own beside it, which the model's workers pull
    only into the slots interactive work leaves free (`apps.worker.intake`)."""
    if service_class == ServiceClass.BATCH:
        return f"{_REQUEST_PREFIX}.{model_token(model)}.{_BATCH_TOKEN}"
    return f"{_REQUEST_PREFIX}.{model_token(model)}"


def event_subject(kind: str, model: str) -> str:
    return f"{_EVENT_PREFIX}.{kind}.{model_token(model)}"


def cancel_subject(request_id: str) -> str:
    return f"{_CANCEL_PREFIX}.{model_token(request_id)}"


def alive_subject(reply_subject: str) -> str:
    """Where the requester answers "still listening"; no responders there means it is gone.
    Asked with an attempt number, it answers ATTEMPT_TAKEN when another attempt already sent text."""
    return f"{reply_subject}.alive"


ATTEMPT_TAKEN = b"taken"
# Longest reply subject a worker answers on. nats-server closes, for good, a connection that sends
# a protocol line over its max_control_line (4096 bytes by default): a request naming a longer
# reply subject would take the worker's connection down with it.
MAX_REPLY_SUBJECT_BYTES = 1024
_REPLY_SUBJECT = re.compile(r"[^\s*>.]+(\.[^\s*>.]+)*")


def valid_reply_subject(subject: str) -> bool:
    """A subject a worker may publish frames on: dot-separated tokens, no wildcards or whitespace."""
    return len(subject.encode()) <= MAX_REPLY_SUBJECT_BYTES and _REPLY_SUBJECT.fullmatch(subject) is not None


def worker_consumer(model: str, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> str:
    """The durable pull consumer every worker of `model` shares, one per service class (the
    prefixes differ, so no model's name can make one the other's)."""
    prefix = "batch-worker" if service_class == ServiceClass.BATCH else "worker"
    return f"{prefix}-{model_token(model)}"


@dataclass(slots=True, frozen=True)
class BusLimits:
    """Retention limits; explicit so a stuck consumer cannot grow a stream without bound."""

    request_max_age_s: float = 600.0
    request_max_msgs: int = 100_000
    request_max_bytes: int = 1 << 30
    request_dedupe_window_s: float = 120.0
    event_max_age_s: float = 7 * 24 * 3600.0
    event_max_bytes: int = 4 << 30
    node_ttl_s: float = 15.0
    replicas: int = 1
    # A held request is touched (in-progress ack) by its worker every heartbeat; silence this long
    # means the worker died and JetStream hands the request to another one.
    request_ack_wait_s: float = 10.0
    # Deliveries of one request at most, so a request that kills its workers cannot kill them all.
    max_deliver: int = 3
    # Every uploaded file's content together (`helexa_files`); per principal, the gateway's quota.
    files_max_bytes: int = 8 << 30
    # A claimed batch is touched (in-progress ack) by its gateway's runner; silence this long means
    # the gateway died and another gateway's runner takes the batch.
    batch_ack_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.request_dedupe_window_s > self.request_max_age_s:
            raise ValueError("the dedupe window cannot outlast the request max_age")
        if self.node_ttl_s <= 0:
            raise ValueError("node_ttl_s must be positive")
        if self.request_ack_wait_s <= 0 or self.max_deliver < 1:
            raise ValueError("request_ack_wait_s must be positive and max_deliver at least 1")
        if self.batch_ack_wait_s < MIN_BATCH_ACK_WAIT_S:
            raise ValueError(f"batch_ack_wait_s must be at least {MIN_BATCH_ACK_WAIT_S:g} s")
        if self.replicas not in (1, 3, 5):
            raise ValueError("replicas must be 1, 3 or 5")
        if (min(self.request_max_msgs, self.request_max_bytes, self.event_max_bytes, self.files_max_bytes) < 1
                or self.event_max_age_s <= 0):
            raise ValueError("stream limits must be positive")


def requests_stream_config(limits: BusLimits) -> StreamConfig:
    return StreamConfig(
        name=REQUESTS_STREAM,
        description="Pending generate requests, one subject per model (work queue)",
        subjects=[f"{_REQUEST_PREFIX}.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        # Full means new requests are refused (the gateway answers 503 queue_full); the default
        # discard-old would silently drop other users' oldest queued requests instead.
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        max_age=limits.request_max_age_s,
        max_msgs=limits.request_max_msgs,
        max_bytes=limits.request_max_bytes,
        duplicate_window=limits.request_dedupe_window_s,
        num_replicas=limits.replicas,
    )


def events_stream_config(limits: BusLimits) -> StreamConfig:
    return StreamConfig(
        name=EVENTS_STREAM,
        description="Run lifecycle, admission, node and bench events: the ledger's source of truth",
        subjects=[every_event()],
        retention=RetentionPolicy.LIMITS,
        # Full means new events are refused (gateways answer new requests 503 events_full, and the
        # events refused are held by their publishers), never that old ones, recorded or not, go:
        # the recorder trims what it has recorded when the stream nears its limit.
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        max_age=limits.event_max_age_s,
        max_bytes=limits.event_max_bytes,
        duplicate_window=min(120.0, limits.event_max_age_s),
        num_replicas=limits.replicas,
    )


def batches_stream_config(limits: BusLimits) -> StreamConfig:
    return StreamConfig(
        name=BATCHES_STREAM,
        description="Batches waiting for or held by a gateway's batch runner (work queue, one claim per batch)",
        subjects=[BATCH_SUBJECT],
        retention=RetentionPolicy.WORK_QUEUE,
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        max_age=BATCH_CLAIM_MAX_AGE_S,
        max_msgs=1_000_000,
        duplicate_window=120.0,
        num_replicas=limits.replicas,
    )


def batch_runners_config(limits: BusLimits) -> ConsumerConfig:
    """The durable consumer every gateway's batch runner pulls claims from; a runner sends
    in-progress acks while its batch runs (at a quarter of the ack wait it reads back from this
    consumer: `batch_ack_wait_s`), so the ack wait only bounds a dead gateway's batch."""
    return ConsumerConfig(
        name=BATCH_RUNNERS_CONSUMER,
        durable_name=BATCH_RUNNERS_CONSUMER,
        filter_subject=BATCH_SUBJECT,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=limits.batch_ack_wait_s,
        max_ack_pending=10_000,
    )


def worker_consumer_config(model: str, ack_wait_s: float = 10.0, max_deliver: int = 3,
                           service_class: ServiceClass = ServiceClass.INTERACTIVE) -> ConsumerConfig:
    name = worker_consumer(model, service_class)
    return ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=request_subject(model, service_class),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        # Workers send in-progress acks while generating, so ack_wait only bounds a dead worker.
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
    )


def recorder_consumer_config(ack_wait_s: float = 60.0) -> ConsumerConfig:
    """The durable consumer all recorders share; `ack_wait_s` bounds how long a dead recorder's batch waits."""
    return ConsumerConfig(
        name=RECORDER_CONSUMER,
        durable_name=RECORDER_CONSUMER,
        filter_subject=every_event(),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_ack_pending=10_000,
    )


def replay_consumer_config(name: str, start_seq: int | None = None) -> ConsumerConfig:
    """A private, unacknowledged read of EVENTS from its first message (or from `start_seq`), for
    `helexa recorder --rebuild`."""
    return ConsumerConfig(
        name=name,
        filter_subject=every_event(),
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        # The server removes it by itself if the recorder dies mid-replay.
        inactive_threshold=60.0,
        mem_storage=True,
    )


def large_requests_config(limits: BusLimits) -> ObjectStoreConfig:
    """Objects live as long as a queued request may (REQUESTS' max_age), so one nobody deletes
    (its gateway died between storing it and publishing the reference) goes with its message."""
    return ObjectStoreConfig(
        description="Requests too large for one bus message, referenced from REQUESTS",
        ttl=limits.request_max_age_s,
        max_bytes=limits.request_max_bytes,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )


def large_events_config(limits: BusLimits) -> ObjectStoreConfig:
    """Objects live as long as the events referring to them (EVENTS' max_age), so a replay finds them."""
    return ObjectStoreConfig(
        description="Events too large for one bus message, referenced from EVENTS",
        ttl=limits.event_max_age_s,
        max_bytes=limits.event_max_bytes,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )


def files_config(limits: BusLimits) -> ObjectStoreConfig:
    """Uploaded files live until their owner deletes them (no TTL), within `files_max_bytes` in all."""
    return ObjectStoreConfig(
        description="Files uploaded through /v1/files, one object per file id",
        ttl=None,
        max_bytes=limits.files_max_bytes,
        storage=StorageType.FILE,
        replicas=limits.replicas,
    )


@dataclass(slots=True, frozen=True)
class EventsRoom:
    """How full EVENTS is: bytes and messages held against its limits (<= 0: no limit)."""

    bytes: int
    messages: int
    max_bytes: int
    max_msgs: int

    def share(self) -> float:
        """The larger of the two fills, 0 to 1 (and past 1 only if an operator lowered a limit)."""
        shares = [used / limit for used, limit in ((self.bytes, self.max_bytes), (self.messages, self.max_msgs))
                  if limit > 0]
        return max(shares, default=0.0)


async def events_room(js: JetStreamContext) -> EventsRoom:
    return room_of(await js.stream_info(EVENTS_STREAM))


def room_of(info: StreamInfo) -> EventsRoom:
    """How full a reading of EVENTS's stream info says it is."""
    return EventsRoom(bytes=info.state.bytes, messages=info.state.messages,
                      max_bytes=info.config.max_bytes or -1, max_msgs=info.config.max_msgs or -1)


async def node_registry(js: JetStreamContext, limits: BusLimits) -> KeyValue:
    try:
        return await js.key_value(NODES_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(bucket=NODES_BUCKET, ttl=limits.node_ttl_s, history=1, replicas=limits.replicas)
        )


async def worker_puller(nc: NatsClient, model: str, limits: BusLimits,
                        service_class: ServiceClass = ServiceClass.INTERACTIVE) -> BatchPuller:
    """Batches from `model`'s shared worker consumer of `service_class`, declared (or converged) first."""
    config = worker_consumer_config(model, limits.request_ack_wait_s, limits.max_deliver, service_class)
    await nc.jetstream().add_consumer(REQUESTS_STREAM, config=config)
    return await BatchPuller(nc, REQUESTS_STREAM, worker_consumer(model, service_class)).start()


def max_deliveries_advisories() -> str:
    """Where JetStream says a request reached max_deliver: no worker will get it again."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{REQUESTS_STREAM}.*"


WORKER_SERVICE = "helexa-worker"


def node_endpoint(node: str, endpoint: str) -> str:
    """A worker's own micro-service endpoint subject (`generate`, `control`): one node, addressed."""
    return f"{_NODE_PREFIX}.{model_token(node)}.{endpoint}"


async def batch_puller(nc: NatsClient) -> BatchPuller:
    return await BatchPuller(nc, BATCHES_STREAM, BATCH_RUNNERS_CONSUMER).start()


async def batch_ack_wait_s(nc: NatsClient, timeout_s: float = 5.0) -> float:
    """The batch runners' consumer's ack wait as the server has it (whoever declared it, with
    whichever `batch_ack_wait_s`): a runner keeps its claim alive well inside it."""
    info = await nc.jetstream().consumer_info(BATCHES_STREAM, BATCH_RUNNERS_CONSUMER, timeout=timeout_s)
    assert info.config.ack_wait is not None
    return float(info.config.ack_wait)


async def recorder_puller(nc: NatsClient, ack_wait_s: float = 60.0) -> BatchPuller:
    """Batches from the recorders' shared durable consumer, declared (or converged) first."""
    await nc.jetstream().add_consumer(EVENTS_STREAM, config=recorder_consumer_config(ack_wait_s))
    return await BatchPuller(nc, EVENTS_STREAM, RECORDER_CONSUMER).start()


async def replay_puller(nc: NatsClient, start_seq: int | None = None) -> BatchPuller:
    """Batches from a new private consumer reading EVENTS from its start (or from `start_seq`);
    delete it when done."""
    name = f"{RECORDER_CONSUMER}-replay-{uuid.uuid4().hex[:12]}"
    await nc.jetstream().add_consumer(EVENTS_STREAM, config=replay_consumer_config(name, start_seq))
    return await BatchPuller(nc, EVENTS_STREAM, name).start()


async def model_is_known(js: JetStreamContext, model: str) -> bool:
    """A model some worker has served on this bus (its durable consumer exists), live or not."""
    try:
        await js.consumer_info(REQUESTS_STREAM, worker_consumer(model))
    except NotFoundError:
        return False
    return True


def cancel_wildcard() -> str:
    """Workers listen here for every cancellation and abort the ones they hold."""
    return f"{_CANCEL_PREFIX}.*"


def batch_request_wildcard() -> str:
    """Every model's batch-class request subject: what a worker's batch consumer may filter on."""
    return f"{_REQUEST_PREFIX}.*.{_BATCH_TOKEN}"


def request_wildcard(wildcard: str = ">") -> str:
    """Every model's request subject (`*`: as one token, which a model's always is): what only
    gateways publish, and nobody reads but through a consumer."""
    return f"{_REQUEST_PREFIX}.{wildcard}"


def event_wildcard(kind: str) -> str:
    """Every model's subject of one event kind, e.g. `helexa.events.run.finished.*`."""
    return f"{_EVENT_PREFIX}.{kind}.*"


def every_event() -> str:
    """Every event subject, of every kind and model: what the EVENTS stream holds."""
    return f"{_EVENT_PREFIX}.>"


def node_endpoint_wildcard(endpoint: str = "*") -> str:
    """Every node's `endpoint` (`generate`, `control`, `tokenize`), or all of them."""
    return f"{_NODE_PREFIX}.*.{endpoint}"


def kind_of_subject(subject: str) -> str | None:
    """`helexa.events.<kind>.<model>` → kind (kinds may hold dots, model tokens never do)."""
    parts = subject.split(".")
    if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != _EVENT_PREFIX:
        return None
    return ".".join(parts[2:-1])


# Subjects whose events carry another kind's body: what one role reports on another's behalf goes
# on a subject of its own, so subject permissions tell the two publishers apart.
# A gateway's `run.finished` for a run whose worker was lost (the worker cannot report it):
WORKER_LOST = "worker_lost"
# A worker's `admission` event for a request it dropped because nobody waited for it any more:
DROPPED = "dropped"


_INBOX_ROOT = "_INBOX"


def inbox_root(role: str) -> str:
    """Where every connection of `role` gets its replies; `inbox_prefix` adds the user."""
    return f"{_INBOX_ROOT}.{role}"


def inbox_prefix(role: str, user: str | None) -> str:
    """The inbox prefix of a `role` app connected as NATS `user` (`_INBOX.<role>.<user>`). A role's
    user may subscribe under its own prefix only: no other role reads its replies, and gateways
    with users of their own do not read each other's."""
    return f"{inbox_root(role)}.{model_token(user) if user else '-'}"


def every_subject() -> str:
    """All of helexa's own subjects (requests, events, cancels, node endpoints): `helexa bus sub`'s default."""
    return "helexa.>"


def request_id_from_cancel(subject: str) -> str:
    token = subject.rsplit(".", 1)[-1]
    return re.sub(r"~([0-9a-f]{2})", lambda m: bytes.fromhex(m.group(1)).decode(), token)
