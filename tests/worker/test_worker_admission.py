"""Worker admission by class: batch-class requests are pulled only into the free slots beyond the
interactive reserve, so an interactive request finds a slot at once on a worker full of batch lines;
interactive requests count only interactive work, so beyond the reserve they take the seats batch
lines hold (the engine's scheduler preempts those).

The worker runs in this process (its real `WorkerProcess`, `ModelLoop` and intake) on a real NATS
server with the scripted engine; requests are published straight onto their class's subject, as
the gateway does (`topology.request_subject(model, service_class)`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import topology
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.settings import WorkerSettings
from apps.worker import intake
from apps.worker.intake import interactive_reserve
from apps.worker.model_loop import ModelLoop
from apps.worker.node_status import model_status
from engine.frontend.protocol import ServiceClass
from engine.frontend.tokenizer import Tokenizer
from tests.support import eventually_async
from tests.worker.in_process import MODEL, CoreLikeEngine, listen, publish, worker

BATCH = ServiceClass.BATCH
INTERACTIVE = ServiceClass.INTERACTIVE


@pytest.mark.parametrize(("setting", "max_num_seqs", "reserve"), [
    (-1, 16, 4), (-1, 4, 1), (-1, 2, 1), (-1, 1, 0), (3, 16, 3), (0, 16, 0), (20, 16, 15),
], ids=["quarter", "quarter-small", "at-least-one", "one-seat-keeps-none", "set", "none", "never-all"])
def test_the_reserve_is_a_share_of_the_slots_never_all_of_them(setting: int, max_num_seqs: int, reserve: int) -> None:
    assert interactive_reserve(setting, max_num_seqs) == reserve


def test_the_reserve_setting_is_checked() -> None:
    assert WorkerSettings(nats_url="nats://unused").interactive_reserve == -1
    with pytest.raises(ValueError, match="HELEXA_INTERACTIVE_RESERVE"):
        WorkerSettings(nats_url="nats://unused", interactive_reserve=-2)


async def batch_queue(nc: NatsClient) -> tuple[int, int]:
    """(pulled and not yet settled, still queued) on the model's batch consumer."""
    info = await nc.jetstream().consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL, BATCH))
    return info.num_ack_pending, info.num_pending


@contextlib.asynccontextmanager
async def holding_batch_lines(own_nats: NatsServer, tok: Tokenizer, tmp_path: Path,
                              lines: int) -> AsyncIterator[tuple[ModelLoop, CoreLikeEngine, NatsClient]]:
    """A worker of four seats, one kept for interactive work, and `lines` batch lines published
    that hold their seats once pulled; yields its model loop, its engine and a connection."""
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits(), max_num_seqs=4,
                      interactive_reserve=1) as (process, engine):
        nc = await nats.connect(own_nats.url)
        try:
            for i in range(lines):
                await publish(nc, f"line-{i}", "HOLD this batch line", f"_INBOX.line.{i}", service_class=BATCH)
            yield process.models[MODEL], engine, nc
        finally:
            await nc.close()


async def test_batch_lines_leave_the_reserve_to_an_interactive_request(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    # Four slots, one kept for interactive work: at most three batch lines run here.
    async with holding_batch_lines(own_nats, tok, tmp_path, 6) as (loop, engine, nc):
        await eventually_async(lambda: _batch_queue_is(nc, (3, 3)), timeout_s=30)
        assert loop.intake.pulled == {INTERACTIVE: 0, BATCH: 3}
        assert loop.free_slots(BATCH) == 1  # the reserve, free; no batch line takes it
        assert loop.free_slots(INTERACTIVE) == 4  # the seats batch lines hold are preempted for interactive work

        # An interactive request is pulled into the reserve and answered while the lines hold
        # their slots and the rest stay queued in JetStream.
        frames = await listen(nc, "_INBOX.live")
        await publish(nc, "live-1", "hello", "_INBOX.live")
        await asyncio.wait_for(frames.ended.wait(), 30)
        assert frames.text() == "fine"
        assert "live-1" in engine.submitted
        assert await batch_queue(nc) == (3, 3)

        # Its slot is the reserve again once it is done: still no batch line goes into it.
        await eventually_async(lambda: loop.free_slots(BATCH) == 1, timeout_s=30)
        frames = await listen(nc, "_INBOX.live2")
        await publish(nc, "live-2", "hello again", "_INBOX.live2")
        await asyncio.wait_for(frames.ended.wait(), 30)
        assert await batch_queue(nc) == (3, 3)
        assert loop.intake.pulled == {INTERACTIVE: 2, BATCH: 3}
        assert model_status(loop).pulled == {INTERACTIVE: 2, BATCH: 3}
        assert {rid for rid in engine.submitted if rid.startswith("line-")} == {"line-0", "line-1", "line-2"}


async def test_interactive_requests_beyond_the_reserve_take_the_seats_batch_lines_hold(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    """Three batch lines hold three of four seats; three interactive requests that hold too are all
    pulled and running at once (the engine's scheduler preempts batch sequences for them): none
    waits in the stream behind the batch work."""
    async with holding_batch_lines(own_nats, tok, tmp_path, 3) as (loop, engine, nc):
        await eventually_async(lambda: _batch_queue_is(nc, (3, 0)), timeout_s=30)
        for i in range(3):
            await publish(nc, f"live-{i}", "HOLD this interactive request", f"_INBOX.live.{i}")
        await eventually_async(lambda: {f"live-{i}" for i in range(3)} <= set(engine.submitted), timeout_s=30,
                               message=lambda: f"submitted: {engine.submitted}")
        assert loop.intake.pulled == {INTERACTIVE: 3, BATCH: 3}
        assert loop.free_slots(INTERACTIVE) == 1 and loop.free_slots(BATCH) == 0


async def test_a_batch_line_starts_when_a_batch_slot_frees(own_nats: NatsServer, tok: Tokenizer,
                                                           tmp_path: Path) -> None:
    """A queued batch line is pulled as soon as a slot beyond the reserve frees, without waiting on
    the interactive consumer first."""
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits(), max_num_seqs=2,
                      interactive_reserve=1) as (process, engine):
        loop = process.models[MODEL]
        nc = await nats.connect(own_nats.url)
        try:
            first = await listen(nc, "_INBOX.b.0")
            await publish(nc, "b-0", "SLOW line", "_INBOX.b.0", service_class=BATCH)
            second = await listen(nc, "_INBOX.b.1")
            await publish(nc, "b-1", "short line", "_INBOX.b.1", service_class=BATCH)
            await asyncio.wait_for(first.ended.wait(), 30)
            await asyncio.wait_for(second.ended.wait(), 30)
            assert (first.text(), second.text()) == ("one two three four five six", "fine")
            assert engine.submitted.index("b-0") < engine.submitted.index("b-1")
            assert loop.intake.pulled[BATCH] == 2
            await eventually_async(lambda: _batch_queue_is(nc, (0, 0)), timeout_s=30)
        finally:
            await nc.close()


async def test_a_full_worker_pulls_its_last_interactive_request_while_a_batch_wait_is_under_way(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle worker waits on both classes. Interactive requests filling every seat are all pulled
    at once: the seat a batch wait might fill is one the scheduler would preempt for them. (It
    was counted, so the last interactive request waited in the stream until the batch wait
    expired: about half a second per burst at 16 streams, which then ran its own engine steps.)"""
    monkeypatch.setitem(intake.IDLE_WAIT_S, ServiceClass.BATCH, 60.0)  # the batch wait outlasts the test
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits(), max_num_seqs=4,
                      interactive_reserve=1) as (_, engine):
        nc = await nats.connect(own_nats.url)
        try:
            await eventually_async(lambda: _batch_pulls_waiting(nc, 1), timeout_s=30)
            for i in range(4):
                await publish(nc, f"live-{i}", "HOLD this interactive request", f"_INBOX.live.{i}")
            await eventually_async(lambda: {f"live-{i}" for i in range(4)} <= set(engine.submitted), timeout_s=30,
                                   message=lambda: f"submitted: {engine.submitted}")
            assert await _batch_pulls_waiting(nc, 1)  # the batch wait never ended: it held nothing back
            # A batch line ends the wait, so the worker stops without waiting it out.
            await publish(nc, "line-0", "a batch line", "_INBOX.line.0", service_class=BATCH)
            await eventually_async(lambda: "line-0" in engine.submitted, timeout_s=30)
        finally:
            await nc.close()


async def _batch_pulls_waiting(nc: NatsClient, expected: int) -> bool:
    info = await nc.jetstream().consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL, BATCH))
    return info.num_waiting == expected


async def _batch_queue_is(nc: NatsClient, expected: tuple[int, int]) -> bool:
    return await batch_queue(nc) == expected

