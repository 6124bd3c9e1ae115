"""Requests of any size on the bus: a request too large for one message goes through the
JetStream Object Store, and the message on `helexa.req.<model>` carries a `wire.RequestRef`.

A NATS server refuses a message whose headers plus body exceed its `max_payload` (1 MiB by
default; the embedded server takes 8 MiB) and closes, for good, the connection that sent it;
nats-py checks only the body, so a body just under the limit whose headers push it over used to
cost the publisher its connection. `publish_request` measures the whole message (headers and
body, `apps.bus.publish.message_size`) against the limit of the server it is connected to,
publishes the request as it is when it fits, and otherwise stores the encoded request as an object
of the `helexa_requests` bucket and publishes the small reference, under the same `Nats-Msg-Id`.

The worker that takes a reference `fetch`es the request (only an object named for the reference's
request, `<request id>` or `<request id>.<attempt>`, and only if it holds that request: a reference
cannot point a worker at another request's body), and `delete`s the object once it has
settled the message for good (acked or terminated; not when it hands the message back or loses it
to another attempt: the next delivery needs it). The bucket's TTL, REQUESTS' max_age, removes any
object nobody deleted (its gateway died after storing it), with the message it belonged to.
"""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import ObjectNotFoundError

from apps.bus import topology, wire
from apps.bus.object_streams import put_options
from apps.bus.publish import StreamFull, fits, is_stream_full, message_size, publish

__all__ = ["RequestGone", "RequestRefused", "delete", "fetch", "fits", "message_size", "publish_request"]

log = logging.getLogger("helexa.bus")

# The largest request object a worker reads: a gateway's requests are bodies of at most
# HELEXA_MAX_REQUEST_BYTES (8 MiB) encoded again; the bucket itself would allow 1 GiB.
MAX_REQUEST_OBJECT_BYTES = 64 << 20


class RequestGone(Exception):
    """The referenced request is no longer in the Object Store (deleted, or past its TTL)."""


class RequestRefused(Exception):
    """A reference to an object not named for its request, whose object holds another request, or
    is larger than any request a worker reads (`MAX_REQUEST_OBJECT_BYTES`)."""


def names_its_own_object(ref: wire.RequestRef) -> bool:
    """Whether `ref.object` is a name `publish_request` gives its request's object: the request id,
    or the request id and a migrated attempt's number."""
    attempt = ref.object.removeprefix(f"{ref.request_id}.")
    return ref.object == ref.request_id or (attempt != ref.object and attempt.isdigit())


async def publish_request(js: JetStreamContext, nc: NatsClient, request: wire.GenerateRequest,
                          msg_id: str | None = None) -> PubAck:
    """Publish `request` on its model's subject for its service class, through the Object Store when it is too large for
    one message. `msg_id` (default: the request id) is its dedupe id and, for a large one, its
    object's name: a retried publish replaces the object and is stored once. Raises what
    `apps.bus.publish.publish` raises (StreamFull among them, also when the bucket is full),
    having removed the object then."""
    msg_id = msg_id or request.request_id
    subject = topology.request_subject(request.model, request.service_class)
    body = wire.encode(request)
    if fits(nc, body, {"Nats-Msg-Id": msg_id}):
        return await publish(js, subject, body, msg_id)
    store = await js.object_store(topology.LARGE_REQUESTS_BUCKET)
    try:
        await store.put(msg_id, body, put_options(nc, msg_id))
    except nats.js.errors.APIError as exc:
        if is_stream_full(exc):  # the bucket is at its max_bytes: as full as REQUESTS would be
            raise StreamFull(topology.LARGE_REQUESTS_BUCKET, exc.description or "") from exc
        raise
    ref = wire.RequestRef(request_id=request.request_id, model=request.model, object=msg_id, size=len(body))
    try:
        return await publish(js, subject, wire.encode(ref), msg_id)
    except BaseException:
        await delete(js, ref)
        raise


async def fetch(js: JetStreamContext, ref: wire.RequestRef) -> wire.GenerateRequest:
    """The request a reference names; RequestGone if its object is no longer there, RequestRefused
    if the reference names another request's object or the object holds another request."""
    if not names_its_own_object(ref):
        raise RequestRefused(f"request {ref.request_id!r}: object {ref.object!r} is not named for it")
    store = await js.object_store(topology.LARGE_REQUESTS_BUCKET)
    try:
        info = await store.get_info(ref.object)
        if (info.size or 0) > MAX_REQUEST_OBJECT_BYTES:
            raise RequestRefused(f"request {ref.request_id!r}: object {ref.object!r} is {info.size} bytes; "
                                 f"at most {MAX_REQUEST_OBJECT_BYTES} are read")
        result = await store.get(ref.object)
    except ObjectNotFoundError:
        raise RequestGone(f"request {ref.request_id!r}: object {ref.object!r} is not in the store") from None
    if result.data is None:
        raise RequestGone(f"request {ref.request_id!r}: object {ref.object!r} has no data")
    request = wire.request_decoder.decode(result.data)
    if (request.request_id, request.model) != (ref.request_id, ref.model):
        raise RequestRefused(f"request {ref.request_id!r}: object {ref.object!r} holds another request")
    return request


async def delete(js: JetStreamContext, ref: wire.RequestRef) -> None:
    """Remove a reference's object; one already gone is fine, and a bus that cannot be reached
    leaves it to the bucket's TTL (logged)."""
    try:
        store = await js.object_store(topology.LARGE_REQUESTS_BUCKET)
        await store.delete(ref.object)
    except ObjectNotFoundError:
        pass
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("large request object not deleted; its TTL will remove it",
                    extra={"request_id": ref.request_id, "object": ref.object, "error": repr(exc)})
