"""A request cannot hurt the others on its worker, nor take the worker's connection with it.

The worker runs in this process (its real `WorkerProcess` and `ModelLoop`) on a real NATS server,
with the scripted engine behind a guard that fails, as the real engine core does, when an id it
is still running is submitted again. Requests are published straight onto REQUESTS, as any NATS
client may, and their frames read from their reply subjects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import connection, topology, wire
from apps.bus.codes import ErrorCode, ModelState
from apps.bus.topology import BusLimits
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer, nats_server_binary
from apps.worker.intake import Intake, holds
from apps.worker.node_status import model_status
from apps.worker.process import EXIT_BUS_LOST
from engine.frontend.tokenizer import Tokenizer
from tests.support import AppProcess, eventually_async
from tests.worker.in_process import (
    MODEL,
    SCRIPT,
    SLOW_REPLY,
    Frames,
    Terminations,
    client,
    listen,
    publish,
    terminations,
    worker,
)


class BreakingTokenizer:
    """The model's tokenizer, except that its chat template breaks on a message saying BREAK
    (an error no validation names: what a template bug or a strange message would raise)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if any("BREAK" in str(m.get("content")) for m in messages):
            raise RuntimeError("the template fell over")
        return self.inner.apply_chat_template(messages, **kwargs)


async def request_settled(nc: NatsClient) -> bool:
    info = await nc.jetstream().consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL))
    stream = await nc.jetstream().stream_info(topology.REQUESTS_STREAM)
    return info.num_ack_pending == 0 and info.num_pending == 0 and stream.state.messages == 0


def clean_stream(frames: Frames, attempt: int = 1) -> None:
    """One attempt's frames, numbered without a gap, opened once and closed by a normal finish."""
    assert [f.seq for f in frames.frames] == list(range(len(frames.frames)))
    assert {f.attempt for f in frames.frames} == {attempt}
    assert sum(isinstance(f, wire.Accepted) for f in frames.frames) == 1
    assert isinstance(frames.frames[-1], wire.Final) and frames.frames[-1].finish_reason == "stop"


async def answered(nc: NatsClient, request_id: str, inbox: str) -> Frames:
    """A plain request's frames, once its one clean stream has ended."""
    frames = await listen(nc, inbox)
    await publish(nc, request_id, "hello", inbox)
    await asyncio.wait_for(frames.ended.wait(), 20)
    clean_stream(frames)
    return frames


async def test_a_redelivery_while_the_first_attempt_runs_never_reaches_the_engine(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Heartbeats far apart and a short ack wait: JetStream redelivers the message to this same
    # worker while it is still running it, as it does when in-progress acks come late.
    limits = BusLimits(request_ack_wait_s=1.0, max_deliver=3)
    caplog.set_level(logging.INFO, logger="helexa")
    async with worker(own_nats.url, tok, tmp_path, limits=limits, heartbeat_s=30.0) as (_, engine), \
            client(own_nats.url) as nc:
        terminated = await terminations(nc)
        frames = await listen(nc, "_INBOX.dup")
        seq = await publish(nc, "dup-1", "SLOW please", "_INBOX.dup")
        await asyncio.wait_for(frames.ended.wait(), 30)
        clean_stream(frames)
        assert frames.text() == SLOW_REPLY
        assert engine.submitted == ["dup-1"]
        assert any("left to that attempt" in r.getMessage() for r in caplog.records), "never redelivered"
        # The running attempt's ack settles the message, whichever delivery it came with.
        await eventually_async(lambda: request_settled(nc), 20.0, message="the message acked")
        assert seq not in terminated.seqs


async def reuse_a_running_id(nc: NatsClient) -> tuple[Terminations, Frames, Frames, int]:
    """A slow request once it is accepted, then another message (its own msg id) reusing its id: the
    termination advisories, both reply subjects' frames and the second message's stream sequence."""
    terminated = await terminations(nc)
    first = await listen(nc, "_INBOX.first")
    await publish(nc, "reused", "SLOW please", "_INBOX.first")
    await asyncio.wait_for(first.accepted.wait(), 20)
    second = await listen(nc, "_INBOX.second")
    seq = await publish(nc, "reused", "hello", "_INBOX.second", msg_id="reused-again")
    return terminated, first, second, seq


async def test_another_message_reusing_a_running_id_is_refused_alone(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits()) as (_, engine), client(own_nats.url) as nc:
        terminated, first, second, seq = await reuse_a_running_id(nc)
        await asyncio.wait_for(second.ended.wait(), 20)
        refusal = second.frames[-1]
        assert isinstance(refusal, wire.ErrorFrame) and refusal.status == 409
        assert refusal.code == ErrorCode.INVALID_REQUEST
        await terminated.wait_for(seq)
        await asyncio.wait_for(first.ended.wait(), 30)
        clean_stream(first)
        assert first.text() == SLOW_REPLY
        assert engine.submitted == ["reused"]


async def test_a_duplicate_whose_running_run_ends_before_its_refusal_is_served(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The intake sees the id held and schedules the refusal; the run holding it ends before the
    # refusal runs (a migrated attempt arriving as its engine-lost run settles). The refusal is
    # held back here until that run is over, so the race is taken every time.
    refuse = Intake._refuse_duplicate
    first_ended = asyncio.Event()
    refusals_started = 0

    async def late_refusal(self: Intake, msg: Any, request: wire.GenerateRequest, ref: Any = None) -> None:
        nonlocal refusals_started
        refusals_started += 1
        await first_ended.wait()
        await eventually_async(lambda: not holds(self.held, request), 20.0, message="the first run let go of the id")
        await refuse(self, msg, request, ref)

    monkeypatch.setattr(Intake, "_refuse_duplicate", late_refusal)
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits()) as (_, engine), client(own_nats.url) as nc:
        terminated, first, second, seq = await reuse_a_running_id(nc)
        await eventually_async(lambda: refusals_started == 1, 20.0, message="the duplicate seen as held")
        await asyncio.wait_for(first.ended.wait(), 30)
        first_ended.set()
        clean_stream(first)
        assert first.text() == SLOW_REPLY
        # Nothing holds the id any more: the second message is served, not refused.
        await asyncio.wait_for(second.ended.wait(), 20)
        clean_stream(second, attempt=2)  # its second delivery: the first went back unanswered
        assert second.text() == "fine"
        assert engine.submitted == ["reused", "reused"]
        await eventually_async(lambda: request_settled(nc), 20.0, message="both messages acked")
        assert seq not in terminated.seqs


async def test_a_failing_preparation_is_an_error_frame_and_a_term_and_poisons_nothing(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    tokenizer = BreakingTokenizer(tok)
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits(), tokenizer=tokenizer) as (process, engine), \
            client(own_nats.url) as nc:
        terminated = await terminations(nc)
        broken = await listen(nc, "_INBOX.broken")
        seq = await publish(nc, "broken-1", "BREAK the template", "_INBOX.broken")
        await asyncio.wait_for(broken.ended.wait(), 20)
        assert len(broken.frames) == 1
        error = broken.frames[0]
        assert isinstance(error, wire.ErrorFrame) and error.status == 500
        assert error.code == ErrorCode.INTERNAL_ERROR and "RuntimeError" not in error.message
        await terminated.wait_for(seq)
        assert engine.submitted == []
        # The next request on the same model is served; the model was never out of service.
        fine = await answered(nc, "fine-1", "_INBOX.fine")
        assert fine.text() == "fine"
        assert model_status(process.models[MODEL]).state == ModelState.READY


async def test_a_reply_subject_the_server_would_refuse_is_terminated_unanswered(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    async with worker(own_nats.url, tok, tmp_path, limits=BusLimits()) as (process, engine), client(own_nats.url) as nc:
        terminated = await terminations(nc)
        seq = await publish(nc, "long-reply", "hello", "_INBOX." + "x" * 5000)
        await terminated.wait_for(seq)
        assert engine.submitted == []
        await answered(nc, "after-1", "_INBOX.after")
        assert process.nc.is_connected


def _server_with_short_control_lines(folder: Path, max_control_line: int) -> tuple[subprocess.Popen[bytes], str]:
    """A nats-server that refuses protocol lines longer than `max_control_line` (an operator may
    lower it) by closing the connection that sent one, with `-ERR`."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "nats.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\nmax_control_line: {max_control_line}\n'
                      f'jetstream {{ store_dir: "{folder / "js"}" }}\n', encoding="utf-8")
    server = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:  # listening is the server's readiness event
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("nats-server did not start") from None
            time.sleep(0.05)
    return server, f"nats://127.0.0.1:{port}"


def test_a_worker_whose_connection_the_server_closed_exits_non_zero(tmp_path: Path) -> None:
    server, url = _server_with_short_control_lines(tmp_path / "nats", max_control_line=700)
    asyncio.run(connection.setup(url, BusLimits()))  # as its administrator: a worker may not declare it
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    app = None
    try:
        app = AppProcess(["worker", "--script", str(script), "--served-model-name", MODEL],
                         {"NATS_URL": url, "HELEXA_NODE_ID": "closing"})
        app.wait_ready()

        async def send() -> None:
            nc = await nats.connect(url)
            try:
                # Short enough for the worker, too long for this server: answering it, the worker
                # sends a line the server refuses, and the server closes its connection for good.
                await publish(nc, "too-long", "hello", "_INBOX." + "y" * 800)
            finally:
                await nc.close()

        asyncio.run(send())
        app.wait_for(lambda e: "closed by the server" in e.get("event", ""), timeout_s=60)
        assert app.process.wait(timeout=60) == EXIT_BUS_LOST
    finally:
        if app is not None:
            app.stop()
        server.terminate()
        server.wait(timeout=10)
