"""The worker's delivery rules against a requester on a real NATS server (issue 14): an attempt
that lost stops and says so, a requester briefly unreachable is waited for, `run.finished` comes
before the ack, and a stopping worker hands back what it has not started answering.

The requester is a raw NATS client, as any may be: it publishes `GenerateRequest`s onto REQUESTS,
reads the reply frames and answers the alive probes itself (`Requester`), so each test decides what
the worker hears. Workers run in this process (their real `WorkerProcess` and `ModelLoop` with the
scripted engine) or, for SIGTERM, as real `helexa worker` processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus import connection, topology, wire
from apps.bus.codes import ErrorCode, RunStatus
from apps.bus.events import AnyEvent, RunFinished, decode_events, event_kind
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.settings import WorkerSettings
from apps.worker import intake, model_loop
from apps.worker.model_loop import ModelLoop
from apps.worker.process import WorkerProcess
from engine.frontend.protocol import FinishReason, SamplingParams
from engine.frontend.scripted import ScriptedEngine
from engine.frontend.tokenizer import Tokenizer
from tests.recorder.conftest import LogWatch
from tests.support import AppProcess, eventually_async
from tests.worker.in_process import client, running_worker

MODEL = "delivery-model"
LONG_REPLY = " ".join(f"word{i}" for i in range(60))
SCRIPT = {"default": "quick answer",
          "rules": [{"match": "LONG", "reply": LONG_REPLY, "token_delay_s": 0.05}]}


class Requester:
    """One request's requester: its reply frames, and its answers on the alive subject (`listening`
    off: nobody answers, as during a gateway's reconnect; `taken_below`: attempts under it lost)."""

    def __init__(self, nc: NatsClient, request_id: str) -> None:
        self.nc = nc
        self.request_id = request_id
        self.reply_subject = f"_INBOX.{request_id}"
        self.frames: list[wire.ReplyFrame] = []
        self.changed = asyncio.Event()
        self.taken_below = 0
        self._alive: Subscription | None = None

    async def start(self) -> Requester:
        await self.nc.subscribe(self.reply_subject, cb=self._on_frame)
        await self.listen()
        return self

    async def listen(self) -> None:
        self._alive = await self.nc.subscribe(topology.alive_subject(self.reply_subject), cb=self._on_probe)
        await connection.reached_server(self.nc)

    async def stop_listening(self) -> None:
        assert self._alive is not None
        await self._alive.unsubscribe()
        await connection.reached_server(self.nc)

    async def _on_probe(self, msg: Msg) -> None:
        asking = int(msg.data) if msg.data else None
        taken = asking is not None and asking < self.taken_below
        await msg.respond(topology.ATTEMPT_TAKEN if taken else b"")

    async def _on_frame(self, msg: Msg) -> None:
        self.frames.append(wire.frame_decoder.decode(msg.data))
        self.changed.set()

    async def publish(self, content: str, max_tokens: int = 200, attempt: int = 1) -> None:
        request = wire.GenerateRequest(request_id=self.request_id, model=MODEL, reply_subject=self.reply_subject,
                                       sampling=SamplingParams(max_tokens=max_tokens), liveness_probe=True,
                                       messages=[wire.ChatMessage(role="user", content=content)], attempt=attempt)
        await self.nc.jetstream().publish(topology.request_subject(MODEL), wire.encode(request),
                                          headers={"Nats-Msg-Id": f"{self.request_id}.{attempt}"})

    async def wait_for(self, predicate: object, timeout_s: float = 30.0) -> None:
        async def holds() -> None:
            while not predicate(self.frames):  # type: ignore[operator]
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(holds(), timeout_s)

    def of_attempt(self, attempt: int) -> list[wire.ReplyFrame]:
        return [f for f in self.frames if f.attempt == attempt]

    def text(self, attempt: int) -> str:
        return "".join(f.text for f in self.of_attempt(attempt) if isinstance(f, wire.Delta))


def deltas(at_least: int):  # type: ignore[no-untyped-def]
    return lambda frames: sum(isinstance(f, wire.Delta) for f in frames) >= at_least


def ended(frames: list[wire.ReplyFrame]) -> bool:
    return any(isinstance(f, (wire.Final, wire.ErrorFrame)) for f in frames)


class RunEvents:
    """The run.finished events of MODEL, as the worker publishes them."""

    def __init__(self) -> None:
        self.finished: list[RunFinished] = []
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        for event in decode_events(msg.data):  # a message may carry several
            assert isinstance(event, RunFinished)
            self.finished.append(event)
        self.changed.set()

    async def wait_for(self, count: int, timeout_s: float = 30.0) -> list[RunFinished]:
        async def enough() -> None:
            while len(self.finished) < count:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(enough(), timeout_s)
        return self.finished


async def run_events(nc: NatsClient) -> RunEvents:
    events = RunEvents()
    await nc.subscribe(topology.event_subject("run.finished", MODEL), cb=events.on_msg)
    return events


@asynccontextmanager
async def worker(nats_url: str, tok: Tokenizer, tmp_path: Path, limits: BusLimits, script_rules: dict | None = None,
                 **settings: object) -> AsyncIterator[WorkerProcess]:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(script_rules or SCRIPT), encoding="utf-8")
    config = WorkerSettings(nats_url=nats_url, node_id="delivery", heartbeat_s=0.5, status_interval_s=0.5,
                            **settings)  # type: ignore[arg-type]
    loop = ModelLoop(config, ScriptedEngine(script, tok, MODEL), tok, MODEL)
    async with running_worker(config, limits, loop) as process:
        yield process


async def test_an_attempt_told_it_lost_stops_sends_nothing_more_and_leaves_the_message(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    limits = BusLimits(request_ack_wait_s=30.0)
    async with worker(own_nats.url, tok, tmp_path, limits) as process, client(own_nats.url) as nc:
        events = await run_events(nc)
        requester = await Requester(nc, "lost-1").start()
        await requester.publish("LONG please")
        await requester.wait_for(deltas(3))
        # Another attempt serves the client now (a redelivery took over, or a migration).
        requester.taken_below = 2
        (finished,) = await events.wait_for(1)
        assert finished.served is False and finished.attempt == 1
        assert finished.status == RunStatus.CANCELLED and finished.error == ErrorCode.ATTEMPT_TAKEN
        assert finished.completion_tokens < len(tok.encode(LONG_REPLY, add_special_tokens=False))
        assert not ended(requester.frames), "a lost attempt must not close the client's stream"
        # The message is held by the attempt that serves now: no ack, no term from this worker.
        info = await nc.jetstream().consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL))
        assert info.num_ack_pending == 1

        # The run's task lets go of the request when it ends, which can be just after its
        # run.finished reached the stream (clean-clone CI run of a716dc3 saw it still held).
        async def forgotten() -> bool:
            return not process.models[MODEL].requests

        await eventually_async(forgotten, 10.0, message="the worker to forget the lost attempt")


async def test_a_newer_attempt_of_a_request_running_here_takes_over(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    """A requester that migrates a request publishes a new message numbered past the old one's
    attempts; reaching the worker still running the old one, it takes over: the old run stops
    unserved, its message is terminated, and the new attempt answers. One delivery is all it takes:
    the new message waits here for the old run to end, it is not nak'ed (each nak spends one)."""
    limits = BusLimits(request_ack_wait_s=30.0, max_deliver=1)
    async with worker(own_nats.url, tok, tmp_path, limits), client(own_nats.url) as nc:
        events = await run_events(nc)
        requester = await Requester(nc, "moved-1").start()
        await requester.publish("LONG please")
        await requester.wait_for(deltas(2))
        requester.taken_below = 4  # the old message's attempts (1..3) are abandoned
        await requester.publish("LONG please", attempt=4)
        await requester.wait_for(lambda fs: any(isinstance(f, wire.Final) for f in fs), timeout_s=60)
        final = requester.frames[-1]
        assert isinstance(final, wire.Final) and final.attempt >= 4
        assert requester.text(final.attempt) == LONG_REPLY
        assert not [f for f in requester.of_attempt(1) if isinstance(f, wire.Final)]
        old, new = sorted(await events.wait_for(2), key=lambda e: e.attempt)
        assert (old.attempt, old.served, old.error) == (1, False, ErrorCode.ATTEMPT_TAKEN)
        assert new.attempt == final.attempt and new.served is True and new.status == RunStatus.OK
        await eventually_async(lambda: _settled(nc), 20.0, message="both messages settled")


async def _settled(nc: NatsClient) -> bool:
    info = await nc.jetstream().consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL))
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_requester_unreachable_for_less_than_the_grace_is_waited_for(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="helexa")
    watch = LogWatch()
    logging.getLogger("helexa").addHandler(watch)
    try:
        async with worker(own_nats.url, tok, tmp_path, BusLimits(), requester_grace_s=30.0), \
                client(own_nats.url) as nc:
            events = await run_events(nc)
            requester = await Requester(nc, "brief-1").start()
            await requester.publish("LONG please")
            await requester.wait_for(deltas(2))
            await requester.stop_listening()  # a gateway reconnecting through a NATS outage
            await watch.wait_for("requester not listening; waiting for it")
            await requester.listen()
            await requester.wait_for(ended, timeout_s=60)
            final = requester.frames[-1]
            assert isinstance(final, wire.Final) and final.finish_reason == FinishReason.STOP
            assert requester.text(1) == LONG_REPLY
            (finished,) = await events.wait_for(1)
            assert finished.status == RunStatus.OK and finished.served is True
    finally:
        logging.getLogger("helexa").removeHandler(watch)


async def test_a_requester_gone_past_the_grace_ends_the_run(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    async with worker(own_nats.url, tok, tmp_path, BusLimits(), requester_grace_s=1.0) as process, \
            client(own_nats.url) as nc:
        events = await run_events(nc)
        requester = await Requester(nc, "gone-1").start()
        await requester.publish("LONG please")
        await requester.wait_for(deltas(2))
        await requester.stop_listening()
        (finished,) = await events.wait_for(1)
        assert finished.status == RunStatus.CANCELLED and finished.finish_reason == FinishReason.ABORT
        assert finished.completion_tokens < len(tok.encode(LONG_REPLY, add_special_tokens=False))
        await eventually_async(lambda: _no_requests(process), 20.0, message="the request released")


async def _no_requests(process: WorkerProcess) -> bool:
    return not process.models[MODEL].requests


async def test_run_finished_is_published_before_the_ack_so_a_failed_ack_loses_no_event(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    publish_event = model_loop.publish_event

    async def recorded_publish(js: object, event: AnyEvent, **kw: object) -> bool:
        order.append(event_kind(event))
        return await publish_event(js, event, **kw)  # type: ignore[arg-type]

    async def failing_ack(self: Msg) -> None:
        order.append("ack")
        raise nats.errors.Error("the ack did not get through")

    monkeypatch.setattr(model_loop, "publish_event", recorded_publish)
    monkeypatch.setattr(Msg, "ack", failing_ack)
    async with worker(own_nats.url, tok, tmp_path, BusLimits()), client(own_nats.url) as nc:
        events = await run_events(nc)
        requester = await Requester(nc, "order-1").start()
        await requester.publish("hello")
        await requester.wait_for(ended)
        (finished,) = await events.wait_for(1)
        assert finished.status == RunStatus.OK
        await eventually_async(lambda: _asyncify("ack" in order), 20.0, message="the ack")
        assert order == ["run.finished", "ack"]


async def _asyncify(value: bool) -> bool:
    return value


def test_sigterm_hands_unstarted_requests_to_another_worker_and_cuts_streams_with_an_error(
        own_nats: NatsServer, tmp_path: Path) -> None:
    """A worker holding 4 requests that have had no text yet and one stream mid-answer is told to
    stop: the 4 are nak'ed at once and answered by another worker (the ack wait is far longer than
    the test waits), the stream ends with a `worker_stopping` error after the stop grace, and the
    stopping worker's events say none of them was served by it."""
    holding = {"default": "never", "rules": [
        {"match": "hold", "reply": "held forever", "first_token_delay_s": 600},
        {"match": "LONG", "reply": LONG_REPLY, "token_delay_s": 0.3}]}
    env = {"NATS_URL": own_nats.url, "HELEXA_REQUEST_ACK_WAIT_S": "120", "HELEXA_HEARTBEAT_S": "0.5",
           "HELEXA_STATUS_INTERVAL_S": "0.5", "HELEXA_STOP_GRACE_S": "1", "HELEXA_MAX_NUM_SEQS": "8"}

    def start(node: str, script: dict) -> AppProcess:
        path = tmp_path / f"{node}.json"
        path.write_text(json.dumps(script), encoding="utf-8")
        return AppProcess(["worker", "--script", str(path), "--served-model-name", MODEL],
                          {**env, "HELEXA_NODE_ID": node})

    async def scenario() -> None:
        stopping = start("stopping", holding)
        taker: AppProcess | None = None
        try:
            stopping.wait_ready()
            async with client(own_nats.url) as nc:
                events = await run_events(nc)
                held = [await Requester(nc, f"held-{i}").start() for i in range(4)]
                stream = await Requester(nc, "stream-1").start()
                for requester in held:
                    await requester.publish("hold on")
                await stream.publish("LONG please")
                for requester in held:
                    await requester.wait_for(lambda fs: any(isinstance(f, wire.Accepted) for f in fs))
                await stream.wait_for(deltas(2))
                taker = start("taker", {"default": "taken over"})
                await asyncio.to_thread(taker.wait_ready)
                stopping.process.send_signal(signal.SIGTERM)
                for requester in held:
                    await requester.wait_for(ended, timeout_s=60)
                    final = requester.frames[-1]
                    assert isinstance(final, wire.Final) and final.finish_reason == FinishReason.STOP, final
                    assert final.attempt == 2 and requester.text(2) == "taken over"
                    assert not [f for f in requester.of_attempt(1) if isinstance(f, (wire.Delta, wire.Final))]
                await stream.wait_for(ended, timeout_s=60)
                error = stream.frames[-1]
                assert isinstance(error, wire.ErrorFrame) and error.code == ErrorCode.WORKER_STOPPING
                assert error.status == 503 and error.attempt == 1
                assert stream.text(1) and LONG_REPLY.startswith(stream.text(1)) and stream.text(1) != LONG_REPLY
                finished = await events.wait_for(9)
                by_node = {(e.node, e.request_id): e for e in finished}
                for requester in held:
                    handed = by_node[("stopping", requester.request_id)]
                    assert handed.served is False and handed.error == ErrorCode.WORKER_STOPPING
                    assert handed.status == RunStatus.CANCELLED
                    taken = by_node[("taker", requester.request_id)]
                    assert taken.served is True and taken.status == RunStatus.OK and taken.attempt == 2
                cut = by_node[("stopping", "stream-1")]
                assert cut.status == RunStatus.ERROR and cut.served is False
                assert await asyncio.to_thread(stopping.process.wait, 60) == 0
        finally:
            stopping.stop()
            if taker is not None:
                taker.stop()

    asyncio.run(scenario())


async def test_a_newer_attempt_waiting_on_a_stopping_worker_is_handed_back_and_the_next_worker_answers_it(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A newer attempt waits on the worker whose older run of it has not let go of the id yet (its
    abort does not reach the engine here, so the old run goes on); the worker stops meanwhile. The
    waiting attempt is not begun and not left to its ack wait (300 s here): it goes back at once, and
    the next worker answers it whole."""
    limits = BusLimits(request_ack_wait_s=300.0, max_deliver=2)
    # The first worker answers slowly (its old run must outlast the stop), the next one at once.
    slow = {"default": "", "rules": [{"match": "LONG", "reply": LONG_REPLY, "token_delay_s": 0.5}]}
    caplog.set_level(logging.INFO, logger="helexa")
    watch = LogWatch()
    logging.getLogger("helexa").addHandler(watch)
    real_abort = intake.abort_request

    async def abort_lost(*_: object) -> None:
        pass

    monkeypatch.setattr(intake, "abort_request", abort_lost)
    try:
        async with client(own_nats.url) as nc:
            requester = await Requester(nc, "handed-back-1").start()
            async with worker(own_nats.url, tok, tmp_path, limits, slow):
                await requester.publish("LONG please")
                await requester.wait_for(deltas(2))
                requester.taken_below = 2
                await requester.publish("LONG please", attempt=2)
                await watch.wait_for("a newer attempt of a request running here; the run here stops")
            await watch.wait_for("a newer attempt not begun here; handed back")
            assert not [f for f in requester.frames if f.attempt >= 2], "the waiting attempt was begun"
            monkeypatch.setattr(intake, "abort_request", real_abort)
            async with worker(own_nats.url, tok, tmp_path, limits):
                await requester.wait_for(lambda fs: any(isinstance(f, wire.Final) for f in fs), timeout_s=60)
            final = requester.frames[-1]
            assert isinstance(final, wire.Final) and final.attempt >= 2
            assert requester.text(final.attempt) == LONG_REPLY
    finally:
        logging.getLogger("helexa").removeHandler(watch)
