"""Objects of a JetStream Object Store written from, and read into, a stream of chunks.

nats-py's `ObjectStore.put` reads its content from bytes or a blocking file, and `get` gathers the
whole object in memory: neither suits a 200 MB upload read off a socket or a download written to
one. These two speak the same format (chunks on `$O.<bucket>.C.<nuid>`, then one meta message
with the size, chunk count and SHA-256 digest, rolled up on `$O.<bucket>.M.<name>`), so objects
written here are read by nats-py and the `nats` CLI, and the other way round.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterable
from datetime import UTC, datetime
from hashlib import sha256

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext, api
from nats.js.errors import DigestMismatchError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from apps.bus.publish import client_of

CHUNK_BYTES = OBJ_DEFAULT_CHUNK_SIZE


def chunk_bytes(nc: NatsClient) -> int:
    """An object's chunk size on `nc`'s server: nats-py's 128 KiB, or less where the server takes
    less in one message (a chunk is a message of its own, body only)."""
    return min(CHUNK_BYTES, nc.max_payload)


def put_options(nc: NatsClient, name: str) -> api.ObjectMeta:
    """`ObjectStore.put`'s meta for object `name` in chunks that `nc`'s server takes."""
    return api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=chunk_bytes(nc)))
# How long a reader waits for an object's next chunk.
CHUNK_WAIT_S = 30.0


async def put_stream(js: JetStreamContext, bucket: str, name: str, content: AsyncIterable[bytes]) -> api.ObjectInfo:
    """Store `content` as object `name` (a new name: nothing it replaces is cleaned up), in chunks
    of `chunk_bytes`; if `content` raises, the chunks sent so far are purged and the error goes on."""
    size_of_chunk = chunk_bytes(client_of(js))
    nuid = secrets.token_hex(16)  # the chunks' subject token, new for every put
    chunks_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    digest, size, count, pending = sha256(), 0, 0, bytearray()
    try:
        async for piece in content:
            pending += piece
            while len(pending) >= size_of_chunk:
                chunk = bytes(pending[:size_of_chunk])
                del pending[:size_of_chunk]
                digest.update(chunk)
                await js.publish(chunks_subject, chunk)
                size, count = size + len(chunk), count + 1
        if pending:
            digest.update(pending)
            await js.publish(chunks_subject, bytes(pending))
            size, count = size + len(pending), count + 1
        info = api.ObjectInfo(
            name=name, bucket=bucket, nuid=nuid, size=size, chunks=count,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(digest.digest()).decode()),
            options=api.ObjectMetaOptions(max_chunk_size=size_of_chunk))
        meta_subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())
        await js.publish(meta_subject, json.dumps(info.as_dict()).encode(),
                         headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT})
    except BaseException:
        await js.purge_stream(OBJ_STREAM_TEMPLATE.format(bucket=bucket), subject=chunks_subject)
        raise
    return info


async def read_stream(js: JetStreamContext, info: api.ObjectInfo,
                      chunk_wait_s: float = CHUNK_WAIT_S) -> AsyncGenerator[bytes, None]:
    """The chunks of the object `info` describes, in order, checked against its digest at the end
    (DigestMismatchError if they do not match it). A chunk that does not come within `chunk_wait_s`
    (the object deleted under the reader, the server gone) ends it with nats' TimeoutError."""
    if not info.size:
        return
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=info.bucket, obj=info.nuid)
    sub = await js.subscribe(subject, ordered_consumer=True)
    digest = sha256()
    try:
        while True:
            msg = await sub.next_msg(timeout=chunk_wait_s)
            digest.update(msg.data)
            yield msg.data
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    expected = base64.urlsafe_b64decode((info.digest or "").replace(OBJ_DIGEST_TYPE, ""))
    if digest.digest() != expected:
        raise DigestMismatchError
