"""A worker in this test's process (its real `WorkerProcess` and `ModelLoop`) on a real NATS server,
with the scripted engine behind a guard that fails, as the real engine core does, when an id it is
still running is submitted again; and a raw requester's tools: publish onto REQUESTS, read a reply
subject's frames, watch for terminated messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus import connection, topology, wire
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import EMBEDDED_MAX_PAYLOAD, NatsServer
from apps.gateway.reply_router import ReplyRouter
from apps.settings import WorkerSettings
from apps.worker.model_loop import ModelLoop
from apps.worker.process import WorkerProcess
from engine.frontend.protocol import EngineOutput, EngineRequest, SamplingParams, ServiceClass
from engine.frontend.scripted import ScriptedEngine
from engine.frontend.tokenizer import Tokenizer

MODEL = "iso-model"
SLOW_REPLY = "one two three four five six"
SCRIPT = {"default": "fine", "rules": [{"match": "SLOW", "reply": SLOW_REPLY, "token_delay_s": 0.4},
                                       # Holds its slot, with no text sent, until aborted or handed back.
                                       {"match": "HOLD", "reply": "held", "first_token_delay_s": 600.0}]}


class CoreLikeEngine:
    """The scripted engine, refusing an id it is still running as the engine core does (there it
    kills the core process); every submitted id is recorded."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.submitted: list[str] = []
        self._running: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.submitted.append(request.request_id)
        if request.request_id in self._running:
            raise AssertionError(f"duplicate request id {request.request_id} reached the engine")
        self._running.add(request.request_id)
        try:
            async for out in self.inner.generate(request):
                yield out
        finally:
            self._running.discard(request.request_id)


@asynccontextmanager
async def worker(nats_url: str, tok: Tokenizer, tmp_path: Path, *, limits: BusLimits, heartbeat_s: float = 0.5,
                 tokenizer: Any = None, max_num_seqs: int = 16,
                 interactive_reserve: int = -1) -> AsyncIterator[tuple[WorkerProcess, CoreLikeEngine]]:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    settings = WorkerSettings(nats_url=nats_url, node_id="iso", heartbeat_s=heartbeat_s, status_interval_s=0.5,
                              interactive_reserve=interactive_reserve)
    engine = CoreLikeEngine(ScriptedEngine(script, tok, MODEL, max_num_seqs=max_num_seqs))
    loop = ModelLoop(settings, engine, tokenizer or tok, MODEL)  # type: ignore[arg-type]
    async with running_worker(settings, limits, loop) as process:
        yield process, engine


@asynccontextmanager
async def running_worker(settings: WorkerSettings, limits: BusLimits, loop: ModelLoop) -> AsyncIterator[WorkerProcess]:
    """A worker process serving `loop`, in this event loop, once it is ready; stopped on exit."""
    process = WorkerProcess(settings, limits)
    stop = asyncio.Event()
    running = asyncio.create_task(process.run(stop, loop))
    ready = asyncio.create_task(process.ready.wait())
    await asyncio.wait({running, ready}, return_when=asyncio.FIRST_COMPLETED)
    if running.done():
        running.result()  # it failed to start: say why
    try:
        yield process
    finally:
        stop.set()
        await running


@asynccontextmanager
async def client(url: str) -> AsyncIterator[NatsClient]:
    """A plain NATS connection to `url`, closed on exit."""
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


class Frames:
    """Every frame on one reply subject, in arrival order."""

    def __init__(self) -> None:
        self.frames: list[wire.ReplyFrame] = []
        self.accepted = asyncio.Event()
        self.ended = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        frame = wire.frame_decoder.decode(msg.data)
        self.frames.append(frame)
        if isinstance(frame, wire.Accepted):
            self.accepted.set()
        if isinstance(frame, (wire.Final, wire.ErrorFrame)):
            self.ended.set()

    def text(self) -> str:
        return "".join(f.text for f in self.frames if isinstance(f, wire.Delta))


async def listen(nc: NatsClient, reply_subject: str) -> Frames:
    frames = Frames()
    await nc.subscribe(reply_subject, cb=frames.on_msg)
    return frames


async def publish(nc: NatsClient, request_id: str, content: str, reply_subject: str, msg_id: str | None = None,
                  service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
    request = wire.GenerateRequest(request_id=request_id, model=MODEL, reply_subject=reply_subject,
                                   sampling=SamplingParams(max_tokens=32),
                                   messages=[wire.ChatMessage(role="user", content=content)],
                                   service_class=service_class)
    ack = await nc.jetstream().publish(topology.request_subject(MODEL, service_class), wire.encode(request),
                                       headers={"Nats-Msg-Id": msg_id or request_id})
    return ack.seq


class Terminations:
    """JetStream's advisories for messages of REQUESTS that a worker terminated."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        self.seqs.append(json.loads(msg.data)["stream_seq"])
        self.changed.set()

    async def wait_for(self, seq: int, timeout_s: float = 20.0) -> None:
        async def seen() -> None:
            while seq not in self.seqs:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(seen(), timeout_s)


async def terminations(nc: NatsClient) -> Terminations:
    advisories = Terminations()
    await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{topology.REQUESTS_STREAM}.*",
                       cb=advisories.on_msg)
    return advisories


@asynccontextmanager
async def gateway_and_worker(tmp_path: Path, name: str,
                             max_payload: int | None = EMBEDDED_MAX_PAYLOAD) -> AsyncIterator[
                                 tuple[NatsClient, NatsClient, ReplyRouter]]:
    """A NATS server of its own, a gateway connection with its reply router started (at the server
    before this yields), and a worker connection: (gateway, worker, router)."""
    with NatsServer(tmp_path / "nats", max_payload=max_payload) as server:
        gateway = await connection.connect(server.url, f"{name}-gateway", max_reconnect_attempts=0)
        worker = await connection.connect(server.url, f"{name}-worker", max_reconnect_attempts=0)
        try:
            router = ReplyRouter(gateway)
            await router.start()
            await connection.reached_server(gateway)  # the router's subscriptions are at the server
            yield gateway, worker, router
        finally:
            await worker.close()
            await gateway.close()
