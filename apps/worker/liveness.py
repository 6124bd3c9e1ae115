"""The worker's side of liveness: how a held request, its requester and JetStream keep track of
each other, and how a cancellation reaches a generation.

The protocol (the gateway's side answers it; any NATS client may):

- **Heartbeats.** While a worker holds a request it sends a `Heartbeat` frame on the request's
  reply subject and an in-progress ack to JetStream every `HELEXA_HEARTBEAT_S` (`keep_alive`).
  The requester's idle timeout and the consumer's ack wait both watch this: a worker that stops
  touching its request is taken for dead, and JetStream delivers the request to another worker.
- **Alive probe.** A requester that sets `liveness_probe` answers every request on
  `<reply subject>.alive` while it listens. During a run the worker asks every `PROBE_S`
  (`watch_requester`): *no responders* means the requester is gone (its gateway died) and the
  generation is aborted, so its KV is freed; a timeout or a reconnect is only slowness.
- **Attempt taken.** Before running a redelivered attempt (delivery number > 1) the worker asks the
  same subject with its attempt number (`still_wanted`). The requester answers `ATTEMPT_TAKEN` once
  another attempt has sent the client text: then this attempt must not run (its text would be
  repeated) and the message is terminated. No responders there too means nobody waits for it.
  A redelivery that reaches the worker still running the first attempt (its in-progress acks came
  late) is not an attempt at all: the model loop leaves the message to the running one, whose acks
  still count (JetStream names a message by its stream sequence), and touches it.
- **Cancel.** The requester publishes `helexa.cancel.<request id>` when its client leaves or a
  deadline passes. Every worker listens (`Cancellations`): the one holding the request aborts it
  (idempotently); the others remember the id, boundedly, so a later pull of it is dropped unserved.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus import topology
from apps.worker.replies import Replier

log = logging.getLogger("helexa.worker")

# How often a running request checks that its requester still listens.
PROBE_S = 1.0
# How long a redelivered attempt waits for the requester to say whether it may run.
ATTEMPT_CHECK_S = 2.0
# Cancellations of requests not pulled yet that a worker keeps; a flood cannot grow it forever.
REMEMBERED_CANCELS = 10_000


async def keep_alive(replier: Replier, interval_s: float, touch: Callable[[], Awaitable[None]]) -> None:
    """Heartbeats for the requester and in-progress acks (`touch`) for JetStream while a run goes."""
    while True:
        await asyncio.sleep(interval_s)
        await replier.heartbeat()
        await touch()


async def watch_requester(nc: NatsClient, reply_subject: str, interval_s: float,
                          gone: Callable[[], Awaitable[None]]) -> None:
    """Probe the requester; when nobody answers any more (its gateway died), call `gone`."""
    subject = topology.alive_subject(reply_subject)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await nc.request(subject, b"", timeout=max(interval_s, 1.0))
        except nats.errors.NoRespondersError:
            log.info("requester gone; aborting", extra={"reply_subject": reply_subject})
            await gone()
            return
        except (TimeoutError, nats.errors.Error):
            continue  # slow or reconnecting is not gone


async def still_wanted(nc: NatsClient, reply_subject: str, attempt: int) -> bool:
    """Ask the requester whether this redelivered attempt may run (another may have sent text)."""
    try:
        answer = await nc.request(topology.alive_subject(reply_subject), str(attempt).encode(),
                                  timeout=ATTEMPT_CHECK_S)
    except nats.errors.NoRespondersError:
        return False  # the requester is gone
    except (TimeoutError, nats.errors.Error):
        return True  # slow is not gone
    return answer.data != topology.ATTEMPT_TAKEN


class Cancellations:
    """The node's cancellation listener: a held request is aborted at once through `abort_held`
    (which says whether some model held it); any other id is remembered, so a request cancelled
    before it was pulled is dropped when it is (`request_id in cancellations`)."""

    def __init__(self, abort_held: Callable[[str], Awaitable[bool]], remember: int = REMEMBERED_CANCELS) -> None:
        self._abort_held = abort_held
        self._remember = remember
        self._unpulled: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def subscribe(self, nc: NatsClient) -> Subscription:
        return await nc.subscribe(topology.cancel_wildcard(), cb=self._on_cancel)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._unpulled

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = topology.request_id_from_cancel(msg.subject)
        if await self._abort_held(request_id):
            log.info("cancelling", extra={"request_id": request_id})
            return
        self._unpulled[request_id] = None
        while len(self._unpulled) > self._remember:
            self._unpulled.popitem(last=False)
