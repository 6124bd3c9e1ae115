"""The `priority` field of chat completions, completions and responses: bounded (a 400 naming it
outside MIN_PRIORITY..MAX_PRIORITY), carried on the bus request; the service class is never the
client's to set (a `service_class` in the body is ignored: the request stays interactive)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.gateway.api import chat, completions, responses
from apps.gateway.api import openai_schema as oa
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.validate import decode_body
from engine.frontend.protocol import MAX_PRIORITY, MIN_PRIORITY, ServiceClass


def chat_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat.to_bus_request(decode_body(msgspec.json.encode(body), oa.ChatCompletionRequest), "r")


def completion_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    return completions.to_bus_request(decode_body(msgspec.json.encode(body), oa.CompletionRequest), "r")


def response_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "input": "hi", **fields}
    req = decode_body(msgspec.json.encode(body), rs.ResponsesRequest)
    return responses.to_bus_request(req, "resp_r", None, [], responses.parse_items(req.input, "input"))[0]


BUILDERS = [chat_request, completion_request, response_request]


@pytest.mark.parametrize("build", BUILDERS, ids=["chat", "completions", "responses"])
def test_priority_is_carried_and_the_class_stays_interactive(build: Any) -> None:
    assert build().priority == 0
    for priority in (MIN_PRIORITY, -3, MAX_PRIORITY):
        request = build(priority=priority, service_class="batch")
        assert (request.priority, request.service_class) == (priority, ServiceClass.INTERACTIVE)


@pytest.mark.parametrize("build", BUILDERS, ids=["chat", "completions", "responses"])
@pytest.mark.parametrize("priority", [MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5, "high"])
def test_priority_outside_its_range_is_a_400_naming_it(build: Any, priority: Any) -> None:
    with pytest.raises(ServingError) as caught:
        build(priority=priority)
    assert (caught.value.status, caught.value.param) == (400, "priority")


def test_the_bus_and_engine_requests_round_trip_the_class() -> None:
    request = chat_request(priority=7)
    batch = msgspec.structs.replace(request, service_class=ServiceClass.BATCH)
    decoded = msgspec.json.decode(msgspec.json.encode(batch), type=wire.GenerateRequest)
    assert (decoded.service_class, decoded.priority) == (ServiceClass.BATCH, 7)
