"""A worker's alive probes for the attempts it runs for one gateway connection share a message
(apps/worker/liveness.py `HomeProbes`, answered by apps/gateway/reply_router.py), over a real NATS
server: one probe per home per interval names every running attempt, and each hears its own
verdict: still listening, taken (migrated past it), gone (a token the gateway no longer holds), or
gone after the grace once the whole gateway connection is."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus import bundles, connection, wire
from apps.bus.codes import FinishReason
from apps.gateway.reply_router import ReplyRouter
from apps.gateway.reply_stream import ReplyStream
from apps.worker import liveness
from apps.worker.liveness import RequesterProbe, Verdict
from apps.worker.replies import Replier
from tests.support import eventually_async
from tests.worker.in_process import gateway_and_worker

MAX_PAYLOAD = 4096


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "PROBE_S", 0.05)


@pytest.fixture
async def bus(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A gateway connection with its reply router started, and a worker connection."""
    async with gateway_and_worker(tmp_path, "probe") as connections:
        yield connections


async def test_one_probe_per_home_names_every_attempt_and_each_hears_its_own_verdict(
        bus: tuple[NatsClient, NatsClient, ReplyRouter]) -> None:
    gateway, worker, router = bus
    streams = [ReplyStream() for _ in range(8)]
    subjects = [router.new_reply_subject() for _ in streams]
    for stream, subject in zip(streams, subjects, strict=True):
        router.follow(stream, subject)
    probes: list[int] = []

    async def spy(msg: Msg) -> None:
        probes.append(len(bundles.decode_probe(msg.data)))

    await gateway.subscribe(bundles.home_alive_subject(router.home), cb=spy)
    await connection.reached_server(gateway)
    streams[0].migrate(2)  # the request moved on past attempt 1
    watches = [asyncio.create_task(RequesterProbe(worker, subject, attempt=1, grace_s=30).watch())
               for subject in subjects]
    # A token this gateway never handed out (or whose request ended): nobody listens for it.
    stranger = asyncio.create_task(RequesterProbe(worker, router.new_reply_subject(), 1, 30).watch())
    assert await asyncio.wait_for(watches[0], 10) is Verdict.TAKEN
    assert await asyncio.wait_for(stranger, 10) is Verdict.GONE
    await eventually_async(lambda: len(probes) >= 4, 10)
    # Every probe named all the attempts still running: 9 at first, then the 7 left.
    assert probes[0] == 9 and all(n in (9, 7) for n in probes), probes
    assert not any(watch.done() for watch in watches[1:])
    router.forget(streams[1])  # its client left: the stream closed
    assert await asyncio.wait_for(watches[1], 10) is Verdict.GONE
    assert not any(watch.done() for watch in watches[2:])
    for watch in watches[2:]:
        watch.cancel()
    await asyncio.gather(*watches[2:], return_exceptions=True)


async def test_attempts_of_a_gateway_connection_that_is_gone_end_after_the_grace(
        bus: tuple[NatsClient, NatsClient, ReplyRouter]) -> None:
    gateway, worker, router = bus
    stream, subject = ReplyStream(), router.new_reply_subject()
    router.follow(stream, subject)
    patient = asyncio.create_task(RequesterProbe(worker, subject, attempt=1, grace_s=3600).watch())
    brief = asyncio.create_task(RequesterProbe(worker, subject, attempt=1, grace_s=0.2).watch())
    await gateway.close()  # no responders on its home from now on
    assert await asyncio.wait_for(brief, 10) is Verdict.GONE
    assert not patient.done()  # within its grace: the gateway may be reconnecting
    patient.cancel()
    await asyncio.gather(patient, return_exceptions=True)


async def test_hostile_probes_get_no_answer_or_one_that_fits_and_a_stream_beside_them_finishes(
        tmp_path: Path) -> None:
    """A probe that is not a list of pairs is dropped unanswered; the largest probe the server takes,
    of tokens nobody holds, is answered in full within max_payload; the gateway keeps its connection
    and a stream on it runs to its final frame meanwhile."""
    async with gateway_and_worker(tmp_path, "probe", max_payload=MAX_PAYLOAD) as (gateway, worker, router):
        stream, subject = ReplyStream(), router.new_reply_subject()
        router.follow(stream, subject)
        replier = Replier(worker, subject, attempt=1, node="w")

        async def answer() -> int:
            for token in range(50):
                await replier.delta(f"t{token} ", 1, token_ids=[token])
                await asyncio.sleep(0)
            await replier.final(FinishReason.LENGTH, wire.Usage(prompt_tokens=1, completion_tokens=50))
            frames = [await stream.next(10) for _ in range(51)]
            assert isinstance(frames[-1], wire.Final)
            return sum(f.num_tokens for f in frames if isinstance(f, wire.Delta))

        streaming = asyncio.create_task(answer())
        home = bundles.home_alive_subject(router.home)
        with pytest.raises(TimeoutError):
            await worker.request(home, b'{"not": "pairs"}', timeout=1)
        pairs = (MAX_PAYLOAD - 2) // len('["",0],')
        largest = bundles.encode_probe([("", 0)] * pairs)
        assert len(largest) <= MAX_PAYLOAD
        reply = await worker.request(home, largest, timeout=10)
        assert bundles.decode_verdicts(reply.data) == [bundles.GONE] * pairs
        assert await asyncio.wait_for(streaming, 30) == 50
        assert gateway.is_connected and worker.is_connected
