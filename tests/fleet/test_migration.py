"""Mid-stream failover: the worker serving a stream dies, and the stream goes on from another
worker with no repeated and no missing text (SPEC §3, issue: the bus and the ledger under faults).

The fleet's gateway takes a worker for lost after 3 s of silence; the request is published again
as attempt 1 + max_deliver (= 3) carrying the tokens its client has, and the other worker continues.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from apps.bus import connection, topology, wire
from apps.bus.codes import FinishReason
from apps.bus.events import Event, RunFinished
from apps.settings import bus_limits
from tests.fleet.conftest import Fleet, finished_subjects, wait_events
from tests.support import eventually

REPLY = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
SLOW = {"default": REPLY, "rules": [{"match": "slow", "reply": REPLY, "token_delay_s": 0.25}]}
# The attempt a migrated request continues as: 1 + the fleet's HELEXA_MAX_DELIVER.
MIGRATED_ATTEMPT = 3


@dataclass
class Streamed:
    """What one streaming client got."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    request_id: str | None = None
    done: bool = False
    # Chunks with content.
    chunks: int = 0


def stream_chat(base_url: str, body: dict[str, Any], on_text: threading.Event | None = None,
                after_chunks: int = 1) -> Streamed:
    """POST a streaming chat request and read it to the end; `on_text` is set once `after_chunks`
    chunks with content have arrived."""
    got = Streamed()
    chunks = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    got.done = True
                    continue
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    got.errors.append(chunk["error"])
                    continue
                got.request_id = chunk["id"]
                got.usage = chunk.get("usage") or got.usage
                for choice in chunk["choices"]:
                    got.finish_reason = choice.get("finish_reason") or got.finish_reason
                    content = choice["delta"].get("content")
                    if content:
                        got.text += content
                        chunks += 1
                        got.chunks = chunks
                        if on_text is not None and chunks == after_chunks:
                            on_text.set()
    return got


def finished(events: list[Event], request_id: str) -> list[RunFinished]:
    return [e for e in events if isinstance(e, RunFinished) and e.request_id == request_id]


def started_on(fleet: Fleet, model: str, request_id: str) -> str:
    events = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                         lambda es: any(e.request_id == request_id for e in es))
    return next(e.node for e in events if e.request_id == request_id)


def _dies_midway(fleet: Fleet, model: str, **env: str) -> tuple[Streamed, Streamed]:
    """A stream whose worker is killed once the client has text, beside one left undisturbed;
    checks the killed attempt and the migrated one finished as they should."""
    with fleet.workers_of([(f"{model}-a", model, SLOW), (f"{model}-b", model, SLOW)], **env) as workers:
        by_node = {f"{model}-a": workers[0], f"{model}-b": workers[1]}
        body = {"model": model, "messages": [{"role": "user", "content": "slow please"}]}
        undisturbed = stream_chat(fleet.base_url, body)
        has_text = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stream_chat, fleet.base_url, body, has_text, 3)
            assert has_text.wait(60)
            # The request id is the chunks' id; find it from the stream that is running.
            events = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                                 lambda es: len(es) >= 2)
            running = events[-1]
            by_node[running.node].kill()
            got = answer.result(timeout=120)
        survivor = next(node for node in by_node if node != running.node)
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: any(e.attempt == MIGRATED_ATTEMPT for e in finished(es, running.request_id)))
    assert got.request_id == running.request_id
    outcomes = {(e.node, e.attempt, e.status, e.error, e.served) for e in finished(events, running.request_id)}
    assert outcomes == {(running.node, 1, "error", "worker_lost", False),
                        (survivor, MIGRATED_ATTEMPT, "ok", None, True)}
    return got, undisturbed


def test_a_stream_whose_worker_dies_goes_on_from_another_worker(fleet: Fleet) -> None:
    got, undisturbed = _dies_midway(fleet, "migrate-model")
    assert got.errors == [] and got.done
    assert got.text == undisturbed.text == REPLY
    assert got.finish_reason == "stop"
    assert got.usage is not None and undisturbed.usage is not None
    assert (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == (
        undisturbed.usage["prompt_tokens"], undisturbed.usage["completion_tokens"])


def test_a_stream_of_multi_token_frames_goes_on_from_another_worker(fleet: Fleet) -> None:
    # A window of two and a half tokens: after the first, every frame carries two or three.
    got, undisturbed = _dies_midway(fleet, "migrate-window-model", HELEXA_FRAME_WINDOW_MS="600")
    assert undisturbed.chunks < len(REPLY.split())
    assert got.errors == [] and got.done
    assert got.text == undisturbed.text == REPLY
    assert got.finish_reason == "stop"
    assert got.usage is not None and undisturbed.usage is not None
    assert got.usage["completion_tokens"] == undisturbed.usage["completion_tokens"]


def test_with_the_migration_limit_at_0_the_client_gets_worker_lost(fleet: Fleet) -> None:
    model = "no-migrate-model"
    with (fleet.gateway_with(HELEXA_MAX_MIGRATIONS="0") as base_url,
          fleet.workers_of([("nomig-a", model, SLOW), ("nomig-b", model, SLOW)]) as workers):
        by_node = {"nomig-a": workers[0], "nomig-b": workers[1]}
        body = {"model": model, "messages": [{"role": "user", "content": "slow please"}]}
        has_text = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stream_chat, base_url, body, has_text, 2)
            assert has_text.wait(60)
            running = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                                  lambda es: len(es) >= 1)[-1]
            by_node[running.node].kill()
            got = answer.result(timeout=120)
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: bool(finished(es, running.request_id)))
    assert got.done and [e["code"] for e in got.errors] == ["worker_lost"]
    assert got.text and REPLY.startswith(got.text) and got.text != REPLY
    assert got.finish_reason is None
    outcomes = [(e.node, e.status, e.error, e.attempt) for e in finished(events, running.request_id)]
    assert outcomes == [(running.node, "error", "worker_lost", 1)]


PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how rivers shape valleys, in detail.",
    "Describe a busy market in the morning.",
    "Tell me about the history of bread.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue to a child.",
    "Describe the life of a honeybee.",
    "Write a poem about the sea and then explain it.",
]
MAX_TOKENS = 120


def bodies(model: str) -> list[dict[str, Any]]:
    """Six greedy streams and two seeded sampled ones, each exactly MAX_TOKENS long."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        sampling = {"temperature": 0} if i < 6 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        out.append({"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, **sampling})
    return out


def test_streams_of_a_killed_model_worker_finish_as_if_undisturbed(fleet: Fleet) -> None:
    """Two workers running the default model, eight concurrent 120-token streams; the worker
    serving most of them is killed (-9) mid-stream: every stream ends as it did undisturbed."""
    model = "migrate-real"
    specs: list[tuple[str, str, dict | None]] = [("real-a", model, None), ("real-b", model, None)]
    with fleet.workers_of(specs, HELEXA_MAX_NUM_SEQS="8") as workers:
        by_node = {"real-a": workers[0], "real-b": workers[1]}
        requests = bodies(model)
        with ThreadPoolExecutor(len(requests)) as pool:
            undisturbed = list(pool.map(lambda body: stream_chat(fleet.base_url, body), requests))
        assert all(u.finish_reason == "length" and u.usage["completion_tokens"] == MAX_TOKENS
                   for u in undisturbed), undisturbed
        texts = [threading.Event() for _ in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = [pool.submit(stream_chat, fleet.base_url, body, has_text, 5)
                       for body, has_text in zip(requests, texts, strict=True)]
            for has_text in texts:
                assert has_text.wait(120)
            started = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                                  lambda es: len(es) >= 2 * len(requests))[len(requests):]
            busiest = Counter(e.node for e in started).most_common(1)[0][0]
            by_node[busiest].kill()
            got = [answer.result(timeout=300) for answer in answers]
    for before, after in zip(undisturbed, got, strict=True):
        assert after.errors == [] and after.done
        assert after.finish_reason == "length"
        assert after.usage["completion_tokens"] == MAX_TOKENS
        assert after.text == before.text


# -- gaps in a reply's frame sequence ----------------------------------------------------------

PIECES = [("Hello", 1), (" world", 2), ("!", 3)]


async def _gap_worker(nats_url: str, model: str, node: str, stop: asyncio.Event) -> None:
    """A worker of `model` that loses a frame: the first attempt's frames go 0, 1, 3, 4 (the delta
    with " world" never leaves). A migrated attempt goes on after the tokens its client has."""
    nc = await connection.connect(nats_url, "gap-worker", role="worker")
    try:
        js = nc.jetstream()
        limits = bus_limits()
        kv = await topology.node_registry(js, limits)
        puller = await topology.worker_puller(nc, model, limits)
        status = wire.NodeStatus(node=node, version="test", models=[wire.ModelStatus(model=model, slots=4,
                                                                                     free_slots=4)])
        while not stop.is_set():
            await kv.put(node, wire.encode(msgspec.structs.replace(status, updated_at=time.time())))
            for msg in await puller.fetch(1, timeout=0.5):
                request = wire.request_decoder.decode(msg.data)
                attempt = request.attempt - 1 + msg.metadata.num_delivered
                have = len(request.resume[0].token_ids) if request.resume else 0
                frames: list[wire.ReplyFrame] = [wire.Accepted(seq=0, attempt=attempt, node=node, prompt_tokens=3)]
                for text, token in PIECES[have:]:
                    last = token == PIECES[-1][1]
                    frames.append(wire.Delta(seq=len(frames), attempt=attempt, text=text, num_tokens=1,
                                             token_ids=[token], index=0,
                                             finish_reason=FinishReason.STOP if last else None))
                frames.append(wire.Final(seq=len(frames), attempt=attempt, finish_reason=FinishReason.STOP,
                                         usage=wire.Usage(prompt_tokens=3, completion_tokens=len(PIECES))))
                if not request.resume:
                    del frames[2]  # lost on the way
                for frame in frames:
                    await nc.publish(request.reply_subject, wire.encode(frame))
                await msg.ack()
        await kv.delete(node)
    finally:
        await nc.close()


@contextmanager
def gap_worker(fleet: Fleet, model: str) -> Iterator[None]:
    stop: asyncio.Event | None = None
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        ready.set()
        await _gap_worker(fleet.server.url_for("worker"), model, f"{model}-node", stop)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def wait_listed(base_url: str, model: str) -> None:
    eventually(lambda: model in {m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]},
               timeout_s=30, message=f"{model} never listed")


def test_a_lost_frame_ends_the_stream_with_an_error_and_an_error_row(fleet: Fleet) -> None:
    model = "gap-model"
    with fleet.gateway_with(HELEXA_MAX_MIGRATIONS="0") as base_url, gap_worker(fleet, model):
        wait_listed(base_url, model)
        got = stream_chat(base_url, {"model": model, "messages": [{"role": "user", "content": "hi"}]})
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: bool(finished(es, got.request_id or "")))
    assert got.text == "Hello" and got.done and got.finish_reason is None
    assert [e["code"] for e in got.errors] == ["frames_lost"]
    assert [(e.status, e.error) for e in finished(events, got.request_id or "")] == [("error", "frames_lost")]


def test_a_lost_frame_is_recovered_by_migrating_from_what_the_client_has(fleet: Fleet) -> None:
    model = "gap-mig-model"
    with gap_worker(fleet, model):
        wait_listed(fleet.base_url, model)
        got = stream_chat(fleet.base_url, {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert got.errors == [] and got.done
    assert got.text == "Hello world!" and got.finish_reason == "stop"
