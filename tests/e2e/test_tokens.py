"""The token endpoints end to end: vLLM's /tokenize and /detokenize and Anthropic's
/v1/messages/count_tokens count exactly what a generation of the same request is sent."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import nats
import pytest
from nats.aio.msg import Msg
from openai import OpenAI

from apps.bus import topology
from apps.bus.events import AdmissionDecided, decode_events
from tests.e2e.conftest import System, scripted_worker

SCRIPTED = "scripted-tokens"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Answer in 3 words."}]


@pytest.fixture(scope="module")
def scripted(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SCRIPTED, {"rules": [], "default": "ok"}):
        yield SCRIPTED


def post(system: System, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{system.base_url}{path}", json=body, timeout=60)


def tokenize(system: System, **body: object) -> dict:
    response = post(system, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()


def openai_client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_tokenize_a_chat_counts_its_prompt_tokens(system: System) -> None:
    counted = tokenize(system, model=system.model, messages=CHAT)
    assert set(counted) == {"count", "max_model_len", "tokens", "token_strs"}
    assert counted["count"] == len(counted["tokens"]) > 10 and counted["token_strs"] is None
    assert counted["max_model_len"] > counted["count"]
    reply = openai_client(system).chat.completions.create(model=system.model, messages=CHAT, max_tokens=1)
    assert counted["count"] == reply.usage.prompt_tokens

    without_prompt = tokenize(system, model=system.model, messages=CHAT, add_generation_prompt=False)
    assert without_prompt["count"] < counted["count"]
    assert without_prompt["tokens"] == counted["tokens"][:without_prompt["count"]]


def test_a_developer_message_is_rendered_as_the_system_prompt(system: System) -> None:
    # OpenAI's newer name for the system prompt: the model's template knows only `system`, and
    # would otherwise render an unknown turn beside its own default system prompt.
    as_developer = [{"role": "developer", "content": CHAT[0]["content"]}, CHAT[1]]
    assert tokenize(system, model=system.model, messages=as_developer)["tokens"] == \
        tokenize(system, model=system.model, messages=CHAT)["tokens"]


def test_tokenize_counts_what_tool_use_adds(system: System, scripted: str) -> None:
    """Tools in the template and a forced call's opening are part of what the model is sent."""
    client = openai_client(system)
    for extra in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"}):
        counted = tokenize(system, model=scripted, messages=CHAT, **extra)
        reply = client.chat.completions.create(model=scripted, messages=CHAT, max_tokens=1, **extra)
        assert counted["count"] == reply.usage.prompt_tokens, extra


def test_tokenize_a_prompt_counts_like_a_completion(system: System) -> None:
    prompt = "The capital of France is"
    counted = tokenize(system, model=system.model, prompt=prompt, return_token_strs=True)
    assert len(counted["token_strs"]) == counted["count"]
    reply = openai_client(system).completions.create(model=system.model, prompt=prompt, max_tokens=1)
    assert counted["count"] == reply.usage.prompt_tokens


def test_detokenize_round_trips(system: System) -> None:
    text = "Paris is the capital of France; 1234 people agree."
    tokens = tokenize(system, model=system.model, prompt=text, add_special_tokens=False)["tokens"]
    back = post(system, "/detokenize", {"model": system.model, "tokens": tokens})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}

    chat_tokens = tokenize(system, model=system.model, messages=CHAT)["tokens"]
    rendered = post(system, "/detokenize", {"model": system.model, "tokens": chat_tokens}).json()["prompt"]
    assert CHAT[1]["content"] in rendered
    again = tokenize(system, model=system.model, prompt=rendered, add_special_tokens=False)["tokens"]
    assert again == chat_tokens


def test_count_tokens_equals_the_messages_input_tokens(system: System, scripted: str) -> None:
    client = anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Current temperature in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    cases = [
        (system.model, {"system": "You are terse.", "messages": [{"role": "user", "content": "Hi there."}]}),
        (scripted, {"system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
                    "tools": [tool], "tool_choice": {"type": "any"},
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]}),
    ]
    for model, request in cases:
        counted = client.messages.count_tokens(model=model, **request)
        message = client.messages.create(model=model, max_tokens=1, **request)
        assert counted.input_tokens == message.usage.input_tokens > 0


def test_model_may_be_left_out_only_when_one_is_served(system: System, scripted: str) -> None:
    response = post(system, "/tokenize", {"prompt": "hello"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": "x", "messages": []}, 400, "messages"),
    ("/detokenize", {"model": "x", "tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"model": "x", "messages": [{"role": "user", "content": "hi"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
], ids=["unknown-model", "no-messages", "negative-id", "continue-and-generation-prompt"])
def test_bad_token_requests_are_refused(system: System, path: str, body: dict, status: int, param: str) -> None:
    if body["model"] == "x":
        body = {**body, "model": system.model}
    response = post(system, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_detokenize_outside_the_vocabulary_is_400(system: System) -> None:
    response = post(system, "/detokenize", {"model": system.model, "tokens": [10**9]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_prompt"


def test_count_tokens_errors_are_anthropic_shaped(system: System) -> None:
    response = post(system, "/v1/messages/count_tokens", {"model": "no-such-model",
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    error = anthropic.types.ErrorResponse.model_validate(response.json(), strict=True)
    assert error.error.type == "not_found_error"


def test_a_model_nobody_serves_is_refused_before_it_is_admitted(system: System) -> None:
    """A token call naming a model nobody serves is a 404 before admission, as a generation is: no
    admission pool is made for the name (the gateway keeps one per model it admits for, so each
    made-up name was kept for good) and no admission decided, while a call on the served model is
    admitted as ever."""

    async def calls() -> list[AdmissionDecided]:
        nc = await nats.connect(system.nats_url)
        seen: list[AdmissionDecided] = []
        served_admitted = asyncio.Event()

        async def on_events(msg: Msg) -> None:
            for event in decode_events(msg.data):
                assert isinstance(event, AdmissionDecided)
                seen.append(event)
                if event.model == system.model and event.detail == "tokenize":
                    served_admitted.set()

        try:
            await nc.subscribe(topology.event_wildcard("admission"), cb=on_events)
            await nc.flush()
            made_up = f"made-up-{uuid.uuid4().hex}"
            for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                               ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]})):
                response = await asyncio.to_thread(post, system, path, {"model": made_up, **body})
                assert response.status_code == 404, response.text
            response = await asyncio.to_thread(post, system, "/tokenize", {"model": system.model, "prompt": "hi"})
            assert response.status_code == 200, response.text
            await asyncio.wait_for(served_admitted.wait(), 30)
            return [event for event in seen if event.model == made_up]
        finally:
            await nc.close()

    assert asyncio.run(calls()) == []
