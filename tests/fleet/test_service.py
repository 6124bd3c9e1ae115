"""Workers as NATS micro services; model load/unload, cold start from the catalogue, poisoning."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import nats
import openai
import pytest

from apps.bus import topology, wire
from engine.frontend.protocol import SamplingParams, ServiceClass
from tests.fleet.conftest import COLD_MODEL, Fleet, finished_subjects, wait_events
from tests.support import REPO


async def _service_replies(nats_url: str, verb: str, node: str) -> dict:
    """Ask every helexa worker service (as `nats micro <verb>` does) and return `node`'s answer."""
    nc = await nats.connect(nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$SRV.{verb}.{topology.WORKER_SERVICE}", b"", reply=inbox)
        while True:
            reply = json.loads((await sub.next_msg(timeout=10)).data)
            if reply.get("metadata", {}).get("node") == node:
                return reply
    finally:
        await nc.close()


async def _generate(nats_url: str, node: str, request: wire.GenerateRequest) -> dict:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(topology.node_endpoint(node, "generate"), wire.encode(request), timeout=30)
        return json.loads(msg.data)
    finally:
        await nc.close()


def test_worker_is_a_discoverable_micro_service(fleet: Fleet) -> None:
    with fleet.worker("svc-a", "svc-model", {"default": "micro hello"}):
        ping = asyncio.run(_service_replies(fleet.nats_url, "PING", "svc-a"))
        assert ping["name"] == topology.WORKER_SERVICE and ping["type"] == "io.nats.micro.v1.ping_response"
        info = asyncio.run(_service_replies(fleet.nats_url, "INFO", "svc-a"))
        endpoints = {e["name"]: e["subject"] for e in info["endpoints"]}
        assert endpoints == {"generate": topology.node_endpoint("svc-a", "generate"),
                             "control": topology.node_endpoint("svc-a", "control"),
                             "tokenize": topology.node_endpoint("svc-a", "tokenize")}
        request = wire.GenerateRequest(request_id="micro-1", model="svc-model", reply_subject="",
                                       sampling=SamplingParams(),
                                       messages=[wire.ChatMessage(role="user", content="hi")])
        answer = asyncio.run(_generate(fleet.nats_url, "svc-a", request))
        assert answer["text"] == "micro hello" and answer["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] > 0
        stats = asyncio.run(_service_replies(fleet.nats_url, "STATS", "svc-a"))
        generate = next(e for e in stats["endpoints"] if e["name"] == "generate")
        assert generate["num_requests"] == 1 and generate["num_errors"] == 0


def test_generate_is_refused_while_the_workers_slots_are_taken(fleet: Fleet) -> None:
    # The endpoint takes no more than the engine has room for, as the intake pulls no more: a
    # second request beside a running one on a one-sequence worker is a 503 at once, while the
    # first finishes whole, and the worker serves the next one once it has room again.
    slow = " ".join(["word"] * 15)  # about 15 s: room to see it start and ask beside it on a loaded machine
    script = {"default": "room again", "rules": [{"match": "SLOW", "reply": slow, "token_delay_s": 1.0}]}
    subject = topology.node_endpoint("full-a", "generate")

    def request(request_id: str, content: str) -> bytes:
        return wire.encode(wire.GenerateRequest(request_id=request_id, model="full-model", reply_subject="",
                                                sampling=SamplingParams(),
                                                messages=[wire.ChatMessage(role="user", content=content)]))

    async def scenario() -> tuple[dict, object, dict]:
        nc = await nats.connect(fleet.nats_url)
        try:
            running = asyncio.create_task(nc.request(subject, request("full-slow", "SLOW please"), timeout=120))
            await asyncio.to_thread(wait_events, fleet.nats_url, topology.event_subject("run.started", "full-model"),
                                    lambda es: any(e.request_id == "full-slow" for e in es))
            refused = await nc.request(subject, request("full-busy", "hello"), timeout=30)
            first = json.loads((await running).data)
            after = await nc.request(subject, request("full-after", "hello"), timeout=30)
            return first, refused, json.loads(after.data)
        finally:
            await nc.close()

    with fleet.worker("full-a", "full-model", script, HELEXA_MAX_NUM_SEQS="1"):
        first, refused, after = asyncio.run(scenario())
    assert refused.headers is not None and refused.headers.get("Nats-Service-Error-Code") == "503"
    assert "no free sequence" in refused.headers.get("Nats-Service-Error", "")
    assert first["text"] == slow and first["finish_reason"] == "stop"
    assert after["text"] == "room again"


def test_generate_keeps_the_interactive_reserve_from_batch_class_requests(fleet: Fleet) -> None:
    # A two-sequence worker keeps one for interactive work (HELEXA_INTERACTIVE_RESERVE's default):
    # beside a running request, a batch-class one is a 503, an interactive one is served; a
    # batch-class request for more choices than the reserve ever leaves it is a 400, not a 503.
    slow = " ".join(["word"] * 10)
    script = {"default": "served", "rules": [{"match": "SLOW", "reply": slow, "token_delay_s": 1.0}]}
    subject = topology.node_endpoint("reserve-a", "generate")

    def request(request_id: str, content: str, service_class: ServiceClass, n: int = 1) -> bytes:
        return wire.encode(wire.GenerateRequest(request_id=request_id, model="reserve-model", reply_subject="",
                                                sampling=SamplingParams(n=n), service_class=service_class,
                                                messages=[wire.ChatMessage(role="user", content=content)]))

    async def scenario() -> tuple[dict, object, dict]:
        nc = await nats.connect(fleet.nats_url)
        try:
            never = await nc.request(subject, request("reserve-two", "hello", ServiceClass.BATCH, n=2), timeout=30)
            assert never.headers is not None and never.headers.get("Nats-Service-Error-Code") == "400"
            running = asyncio.create_task(nc.request(subject, request("reserve-slow", "SLOW please",
                                                                      ServiceClass.INTERACTIVE), timeout=120))
            await asyncio.to_thread(wait_events, fleet.nats_url,
                                    topology.event_subject("run.started", "reserve-model"),
                                    lambda es: any(e.request_id == "reserve-slow" for e in es))
            refused = await nc.request(subject, request("reserve-batch", "hello", ServiceClass.BATCH), timeout=30)
            served = await nc.request(subject, request("reserve-chat", "hello", ServiceClass.INTERACTIVE),
                                      timeout=60)
            return json.loads((await running).data), refused, json.loads(served.data)
        finally:
            await nc.close()

    with fleet.worker("reserve-a", "reserve-model", script, HELEXA_MAX_NUM_SEQS="2"):
        first, refused, served = asyncio.run(scenario())
    assert refused.headers is not None and refused.headers.get("Nats-Service-Error-Code") == "503"
    assert served["text"] == "served"
    assert first["text"] == slow and first["finish_reason"] == "stop"


def helexa(fleet: Fleet, *args: str) -> dict:
    """Run the `helexa` CLI against the fleet and return its JSON answer."""
    done = subprocess.run([sys.executable, "-m", "apps.cli", "--log-level", "WARNING", *args], cwd=REPO,
                          env={**__import__("os").environ, **fleet.env_for("operator")}, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout + done.stderr
    return json.loads(lines[-1])


def ask(fleet: Fleet, model: str, content: str) -> str:
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=90)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
    return reply.choices[0].message.content or ""


def test_cold_start_load_unload_and_poisoning(fleet: Fleet) -> None:
    script = {"default": "loaded on demand", "rules": [{"match": "FAULT", "reply": "", "fault": "device"}]}
    with fleet.worker("life-a", "life-warm", script, HELEXA_WORKER_MEMORY_MB="1000"):
        assert COLD_MODEL not in helexa(fleet, "models", "ls")["models"]
        # Nobody has the catalogued model: the first request has a worker load it, then is answered.
        assert ask(fleet, COLD_MODEL, "hello") == "loaded on demand"
        listing = helexa(fleet, "models", "ls")
        assert set(listing["models"]) == {"life-warm", COLD_MODEL}
        node = next(n for n in listing["nodes"] if n["node"] == "life-a")
        assert node["free_memory_mb"] == 900  # the catalogue's min_memory_mb is taken

        assert helexa(fleet, "models", "unload", COLD_MODEL) == {"ok": True, "model": COLD_MODEL,
                                                                  "nodes": ["life-a"]}
        assert helexa(fleet, "models", "ls")["models"] == ["life-warm"]
        assert helexa(fleet, "models", "load", COLD_MODEL)["nodes"] == ["life-a"]
        assert ask(fleet, COLD_MODEL, "again") == "loaded on demand"

        # A device fault poisons the model: that request and the next fail fast with a 503.
        with pytest.raises(openai.APIStatusError) as fault:
            ask(fleet, COLD_MODEL, "FAULT now")
        assert fault.value.status_code == 503 and "device fault" in fault.value.message
        with pytest.raises(openai.APIStatusError) as refused:
            ask(fleet, COLD_MODEL, "hello again")
        assert refused.value.status_code == 503 and "reload" in refused.value.message
        poisoned = next(m for n in helexa(fleet, "models", "ls")["nodes"] for m in n["models"]
                        if m["model"] == COLD_MODEL)
        assert poisoned["state"] == "poisoned"
        wait_events(fleet.nats_url, topology.event_wildcard("node.status"),
                    lambda es: any(e.node == "life-a" and e.status == "degraded" for e in es))
        # A reload clears it.
        assert helexa(fleet, "models", "load", COLD_MODEL)["nodes"] == ["life-a"]
        assert ask(fleet, COLD_MODEL, "healed?") == "loaded on demand"
        assert ask(fleet, "life-warm", "unaffected") == "loaded on demand"


def test_a_request_level_engine_error_does_not_poison(fleet: Fleet) -> None:
    # Beside the device fault above: an engine error for one request (a bad row) fails that
    # request alone; the model stays in service for the next one, on the same worker.
    script = {"default": "still serving", "rules": [{"match": "BAD ROW", "reply": "", "fault": "error"}]}
    with fleet.worker("row-a", "row-model", script):
        with pytest.raises(openai.APIStatusError) as failed:
            ask(fleet, "row-model", "BAD ROW please")
        assert failed.value.status_code == 500
        assert ask(fleet, "row-model", "and now?") == "still serving"
        state = next(m for n in helexa(fleet, "models", "ls")["nodes"] for m in n["models"]
                     if m["model"] == "row-model")
        assert state["state"] == "ready" and state["detail"] is None
        finished = wait_events(fleet.nats_url, finished_subjects("row-model"),
                               lambda es: len([e for e in es if e.node == "row-a"]) >= 2)
        errors = [e.error for e in finished if e.node == "row-a"]
        assert errors == ["injected request error", None]


def test_cold_start_answers_503_when_loading_outlasts_the_wait(fleet: Fleet) -> None:
    from apps.embedded import free_port
    from tests.support import AppProcess

    port = free_port()
    impatient = AppProcess(["gateway"], {**fleet.env_for("gateway"), "HELEXA_PORT": str(port),
                                         "HELEXA_COLD_START_WAIT_S": "0.01"})
    try:
        impatient.wait_ready()
        with fleet.worker("slow-load", "slow-warm", {"default": "eventually"}):
            body = {"model": COLD_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "model_loading"
            assert int(response.headers["retry-after"]) >= 1
            # The load goes on without the client: the model is served soon after.
            fleet_ask = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=8)
            reply = fleet_ask.chat.completions.create(model=COLD_MODEL, messages=[{"role": "user", "content": "x"}])
            assert reply.choices[0].message.content == "eventually"
    finally:
        impatient.stop()
