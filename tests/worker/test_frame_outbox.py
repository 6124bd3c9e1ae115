"""Frames of several streams for one gateway share messages (apps/worker/frame_outbox.py), read
back through the gateway's one subscription (apps/gateway/reply_router.py), over a real NATS server
with a small max_payload: a flush too big for one message is split, never refused; every frame
reaches its own stream in order; frames for a token nobody follows are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.bus import bundles, connection, wire
from apps.bus.codes import FinishReason
from apps.embedded.nats_server import NatsServer
from apps.gateway.reply_stream import ReplyStream
from apps.worker import frame_outbox
from apps.worker.frame_outbox import outbox_of
from apps.worker.replies import Replier
from tests.worker.in_process import gateway_and_worker

MAX_PAYLOAD = 4096
USAGE = wire.Usage(prompt_tokens=1, completion_tokens=1)


async def test_a_flush_for_many_streams_is_split_to_fit_and_every_frame_reaches_its_stream(tmp_path: Path) -> None:
    async with gateway_and_worker(tmp_path, "outbox", max_payload=MAX_PAYLOAD) as (gateway, worker, router):
        streams = [ReplyStream() for _ in range(8)]
        subjects = [router.new_reply_subject() for _ in streams]
        for stream, subject in zip(streams, subjects, strict=True):
            router.follow(stream, subject)
        # A stranger's token under the same home: its frames go nowhere.
        stranger = Replier(worker, router.new_reply_subject(), attempt=1, node="w")
        repliers = [Replier(worker, subject, attempt=1, node="w") for subject in subjects]
        outbox = outbox_of(worker)
        # About 1 KiB per frame, 8 streams: no single message could carry them all.
        text = "x" * 1000
        for replier in repliers:
            replier._send(wire.Delta(seq=0, attempt=1, text=text, num_tokens=1))
        stranger._send(wire.Delta(seq=0, attempt=1, text="FORGED", num_tokens=1))
        for replier in repliers:
            replier._send(wire.Delta(seq=1, attempt=1, text="end", num_tokens=1,
                                     finish_reason=FinishReason.STOP))
        await outbox.send_now()
        for replier in repliers:
            await replier.final(FinishReason.STOP, USAGE)
        for stream in streams:
            frames = [await stream.next(10) for _ in range(3)]
            assert [type(f) for f in frames] == [wire.Delta, wire.Delta, wire.Final]
            assert [f.text for f in frames if isinstance(f, wire.Delta)] == [text, "end"]
        # 17 frames in the first flush, in several bundles none larger than the server takes.
        assert 1 < outbox.messages < outbox.frames


def test_only_a_gateway_home_reply_subject_is_bundled() -> None:
    assert bundles.split_reply_subject("_INBOX.gateway.g.abc.r.tok") == ("_INBOX.gateway.g.abc", "tok")
    assert bundles.split_reply_subject("_INBOX.frame-window") is None
    assert bundles.split_reply_subject("_INBOX.gateway.g.abc.tok") is None
    assert bundles.split_reply_subject("_INBOX.gateway.g.abc.r.bundle") is None
    pairs = [("a", wire.encode(wire.Heartbeat(seq=0, attempt=1))), ("b", b'{"x":1}')]
    assert bundles.decode(bundles.encode(pairs)) == pairs


async def test_a_delta_waits_for_the_connection_only_once_the_outbox_falls_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frame_outbox, "MAX_UNSENT_FRAMES", 3)
    with NatsServer(tmp_path / "nats") as server:
        worker = await connection.connect(server.url, "outbox-worker", max_reconnect_attempts=0)
        try:
            replier = Replier(worker, "_INBOX.backlog", attempt=1, node="w")
            outbox = outbox_of(worker)
            await replier.delta("a", 1, token_ids=[1])
            await replier.delta("b", 1, token_ids=[2])
            # Put and on their way, but the run did not wait for the connection to take them.
            assert outbox.frames == 0 and not outbox.backlogged
            await replier.delta("c", 1, token_ids=[3])
            # The third reached the bound: the delta returned only once all three were handed on.
            assert outbox.frames == 3 and not outbox.backlogged
        finally:
            await worker.close()
