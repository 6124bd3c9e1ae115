"""What a worker checks rather than trusts in what it takes off the bus: a large request's object is
its own request's and no larger than any request, a request is for the model of the consumer it
came from, a migrated request's resumed tokens fit what the request may generate, a body nested
past the recursion limit ends alone, a constraint only a worker composes is refused, and every
field a template renders counts toward the prompt's text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import connection, large_requests, roles, topology, wire
from apps.bus.codes import ServingError
from apps.embedded.nats_server import NatsServer
from apps.worker.run import check_resume_fits
from apps.worker.tool_grammar import reply_constraint
from engine.frontend.protocol import SamplingParams, StructuredOutput, StructuredOutputKind
from engine.frontend.tokenizer import Tokenizer
from tests.worker.in_process import MODEL, listen, terminations, worker
from tests.worker.in_process import publish as publish_request


def request_of(request_id: str, size: int) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, model="big-model", reply_subject="_INBOX.gateway.x.y.z",
                                sampling=SamplingParams(), prompt="x" * size)


def test_a_reference_names_only_its_own_requests_object() -> None:
    def ref(request_id: str, name: str) -> wire.RequestRef:
        return wire.RequestRef(request_id=request_id, model="m", object=name, size=1)

    assert large_requests.names_its_own_object(ref("a1", "a1"))
    assert large_requests.names_its_own_object(ref("a1", "a1.4"))
    for name in ("b2", "a1.", "a1.x", "a1.4.5", "a1x", "", "../a1"):
        assert not large_requests.names_its_own_object(ref("a1", name)), name


async def connect(server: NatsServer, role: str) -> NatsClient:
    return await connection.connect(server.url_for(role), f"test-{role}", role=role, max_reconnect_attempts=0)


async def test_a_reference_cannot_point_a_worker_at_another_requests_body(own_nats: NatsServer) -> None:
    gateway, worker_nc = await connect(own_nats, roles.GATEWAY), await connect(own_nats, roles.WORKER)
    try:
        big = 10 << 20  # past the embedded server's 8 MiB: both go through the Object Store
        for request_id in ("alice-1", "bob-1"):
            await large_requests.publish_request(gateway.jetstream(), gateway, request_of(request_id, big))
        js = worker_nc.jetstream()
        honest = wire.RequestRef(request_id="alice-1", model="big-model", object="alice-1", size=big)
        assert (await large_requests.fetch(js, honest)).request_id == "alice-1"
        with pytest.raises(large_requests.RequestRefused):
            await large_requests.fetch(js, msgspec.structs.replace(honest, object="bob-1"))
        # An object under the right name that holds another request (its meta rewritten, say).
        store = await gateway.jetstream().object_store(topology.LARGE_REQUESTS_BUCKET)
        await store.put("alice-1.4", wire.encode(request_of("bob-1", 10)))
        with pytest.raises(large_requests.RequestRefused):
            await large_requests.fetch(js, msgspec.structs.replace(honest, object="alice-1.4"))
        with pytest.raises(large_requests.RequestRefused):
            await large_requests.fetch(js, msgspec.structs.replace(honest, model="other-model"))
    finally:
        await gateway.close()
        await worker_nc.close()


async def test_a_request_for_another_model_on_this_models_consumer_is_terminated_unserved(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    async with worker(own_nats.url_for(roles.WORKER), tok, tmp_path, limits=topology.BusLimits()) as (_, engine):
        nc, operator = await connect(own_nats, roles.GATEWAY), await connect(own_nats, roles.OPERATOR)
        try:
            terminated = await terminations(operator)
            reply = nc.new_inbox() + ".secret"
            frames = await listen(nc, reply)
            request = wire.GenerateRequest(request_id="other-1", model="other-model", reply_subject=reply,
                                           sampling=SamplingParams(max_tokens=4), prompt="hi")
            ack = await nc.jetstream().publish(topology.request_subject(MODEL), wire.encode(request))
            await terminated.wait_for(ack.seq)
            # The same worker serves its own model's requests.
            own = nc.new_inbox() + ".secret"
            served = await listen(nc, own)
            await publish_request(nc, "own-1", "hello", own)
            await served.ended.wait()
            assert served.text() == "fine" and frames.frames == []
            assert engine.submitted == ["own-1"]
        finally:
            await nc.close()
            await operator.close()


def test_resumed_tokens_longer_than_the_request_may_generate_are_refused() -> None:
    def resumed(*lengths: int) -> wire.GenerateRequest:
        return wire.GenerateRequest(request_id="r", model="m", reply_subject="s", prompt="hi",
                                    sampling=SamplingParams(n=len(lengths)),
                                    resume=[wire.ResumedChoice(token_ids=[1] * n) for n in lengths])

    check_resume_fits(resumed(8, 3), 8)
    check_resume_fits(resumed(0), None)
    with pytest.raises(ServingError) as refused:
        check_resume_fits(resumed(3, 9), 8)
    assert refused.value.status == 400 and refused.value.param == "resume"


async def test_a_request_nested_past_the_recursion_limit_is_terminated_and_the_worker_serves_on(
        own_nats: NatsServer, tok: Tokenizer, tmp_path: Path) -> None:
    """2 KB of brackets in a tool's parameters raised RecursionError in the decoder, which ended the
    model's pull loop for good (the worker then took no request while reporting free slots)."""
    async with worker(own_nats.url_for(roles.WORKER), tok, tmp_path, limits=topology.BusLimits()) as (_, engine):
        nc, operator = await connect(own_nats, roles.GATEWAY), await connect(own_nats, roles.OPERATOR)
        try:
            terminated = await terminations(operator)
            request = wire.GenerateRequest(request_id="deep-1", model=MODEL, reply_subject=nc.new_inbox() + ".x",
                                           sampling=SamplingParams(max_tokens=4), prompt="hi")
            deep = wire.encode(request).replace(b'"tools":null', b'"tools":[{"x":' + b"[" * 1500 + b"]" * 1500 + b"}]")
            assert b"[[[" in deep
            ack = await nc.jetstream().publish(topology.request_subject(MODEL), deep)
            await terminated.wait_for(ack.seq)
            for request_id in ("after-1", "after-2"):
                own = nc.new_inbox() + ".secret"
                served = await listen(nc, own)
                await publish_request(nc, request_id, "hello", own)
                await asyncio.wait_for(served.ended.wait(), 60)
                assert served.text() == "fine"
            assert engine.submitted == ["after-1", "after-2"]
        finally:
            await nc.close()
            await operator.close()


def test_a_constraint_only_a_worker_composes_is_refused_from_the_bus() -> None:
    request = wire.GenerateRequest(
        request_id="r", model="m", reply_subject="s", prompt="hi",
        sampling=SamplingParams(structured=StructuredOutput(kind=StructuredOutputKind.LLGUIDANCE, spec="{}")))
    with pytest.raises(ServingError) as refused:
        reply_constraint(request)
    assert refused.value.status == 400 and "llguidance" in refused.value.message


async def test_a_request_object_larger_than_any_request_is_not_read(own_nats: NatsServer) -> None:
    gateway, worker_nc = await connect(own_nats, roles.GATEWAY), await connect(own_nats, roles.WORKER)
    try:
        store = await gateway.jetstream().object_store(topology.LARGE_REQUESTS_BUCKET)
        await store.put("huge-1", b" " * (large_requests.MAX_REQUEST_OBJECT_BYTES + 1))
        ref = wire.RequestRef(request_id="huge-1", model="big-model", object="huge-1", size=10)
        with pytest.raises(large_requests.RequestRefused, match="bytes"):
            await large_requests.fetch(worker_nc.jetstream(), ref)
    finally:
        await gateway.close()
        await worker_nc.close()


def test_roles_tool_names_and_each_message_count_toward_the_prompts_text() -> None:
    one = wire.GenerateRequest(request_id="r", model="m", reply_subject="s", sampling=SamplingParams(),
                               messages=[wire.ChatMessage(role="user", content="hi")])
    many = msgspec.structs.replace(one, messages=[wire.ChatMessage(role="user", content="")] * 1000,
                                   tool_name="f" * 50)
    assert one.text_chars() == wire.MESSAGE_OVERHEAD_CHARS + len("user") + 2
    assert many.text_chars() == 1000 * (wire.MESSAGE_OVERHEAD_CHARS + len("user")) + 50
    with pytest.raises(msgspec.ValidationError):
        wire.request_decoder.decode(wire.encode(one).replace(b'"role":"user"', b'"role":"' + b"u" * 100 + b'"'))
