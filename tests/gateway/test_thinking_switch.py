"""A thinking template's switch (Qwen3's `enable_thinking`) from each API's own field, and vLLM's
`chat_template_kwargs` on chat: carried on the bus request as extra template variables."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.gateway.api import anthropic, chat, responses
from apps.gateway.api import anthropic_schema as an
from apps.gateway.api import openai_schema as oa
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.validate import decode_body


def chat_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return chat.to_bus_request(decode_body(msgspec.json.encode(body), oa.ChatCompletionRequest), "r")


def response_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "input": "hi", **fields}
    req = decode_body(msgspec.json.encode(body), rs.ResponsesRequest)
    return responses.to_bus_request(req, "resp_r", None, [], responses.parse_items(req.input, "input"))[0]


def message_request(**fields: Any) -> wire.GenerateRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return anthropic.to_bus_request(decode_body(msgspec.json.encode(body), an.MessagesRequest), "r")


def test_each_apis_reasoning_switch_sets_enable_thinking() -> None:
    assert chat_request().template_kwargs is None
    assert chat_request(reasoning_effort="high").template_kwargs is None
    assert chat_request(reasoning_effort="none").template_kwargs == {"enable_thinking": False}
    assert response_request(reasoning={"effort": "none"}).template_kwargs == {"enable_thinking": False}
    assert response_request(reasoning={"effort": "low"}).template_kwargs is None
    assert message_request().template_kwargs is None
    assert message_request(thinking={"type": "disabled"}).template_kwargs == {"enable_thinking": False}
    assert message_request(thinking={"type": "enabled", "budget_tokens": 1024}).template_kwargs == {
        "enable_thinking": True}


def test_chat_template_kwargs_are_carried_and_win_over_the_effort() -> None:
    kwargs = {"enable_thinking": True, "custom_instructions": "be brief"}
    assert chat_request(chat_template_kwargs=kwargs, reasoning_effort="none").template_kwargs == kwargs


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": False}, {"tools": []}, {"1st": 1}, {"x" * 65: 1}, {f"v{i}": 0 for i in range(17)},
    {"doc": "d" * 4096},
], ids=["own-variable", "tools", "not-an-identifier", "long-name", "17-variables", "past-4-kib"])
def test_chat_template_kwargs_past_their_bounds_are_a_400_naming_them(kwargs: dict) -> None:
    with pytest.raises(ServingError) as refused:
        chat_request(chat_template_kwargs=kwargs)
    assert (refused.value.status, refused.value.param) == (400, "chat_template_kwargs")


def test_the_variable_the_reasoning_setting_adds_counts_toward_the_bounds() -> None:
    sixteen = {f"v{i}": 0 for i in range(16)}
    assert chat_request(chat_template_kwargs=sixteen).template_kwargs == sixteen
    with pytest.raises(ServingError) as refused:
        chat_request(chat_template_kwargs=sixteen, reasoning_effort="none")
    assert refused.value.param == "chat_template_kwargs" and "enable_thinking" in refused.value.message
