"""Stored responses end to end: `previous_response_id` conversations rebuilt from the PostgreSQL
ledger (through a gateway restart and across gateways), per principal, and DELETE."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response

from apps.embedded import free_port
from tests.e2e.conftest import System
from tests.support import eventually
from tests.system import KeyedGateway, api_keys_file, keyed_gateway

ALICE, BOB = "sk-alice-responses", "sk-bob-responses"
MAX_TOKENS = 8


def start_gateway(system: System, keys: Path, port: int) -> KeyedGateway:
    return keyed_gateway(system, keys, ALICE, port)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return api_keys_file(tmp_path_factory.mktemp("keys"), {ALICE: "alice", BOB: "bob"})


@pytest.fixture(scope="module")
def gateways(system: System, keys: Path) -> Iterator[list[KeyedGateway]]:
    """Two gateways of one fleet, with API keys; a test may restart the first (the list is updated)."""
    started = [start_gateway(system, keys, free_port()) for _ in range(2)]
    try:
        yield started
    finally:
        for gateway in started:
            gateway.process.stop()


def prompt_tokens(system: System, turns: list[tuple[str, str]]) -> int:
    """What the chat template makes of these (role, text) turns, counted by /tokenize."""
    messages = [{"role": role, "content": text} for role, text in turns]
    answer = httpx.post(f"{system.base_url}/tokenize", json={"model": system.model, "messages": messages}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def ask(gateway: KeyedGateway, system: System, text: str, previous: str | None = None, **kw: object) -> Response:
    return gateway.client().responses.create(model=system.model, input=text, previous_response_id=previous,
                                             max_output_tokens=MAX_TOKENS, temperature=0, **kw)


def test_three_turns_see_the_earlier_ones_and_survive_a_gateway_restart(system: System, keys: Path,
                                                                        gateways: list[KeyedGateway]) -> None:
    questions = ["My name is Ada. Say hello.", "What is my name?", "Spell it backwards."]
    first = ask(gateways[0], system, questions[0])
    second = ask(gateways[0], system, questions[1], previous=first.id)  # at once: from the gateway's cache
    turns = [("user", questions[0]), ("assistant", first.output_text), ("user", questions[1])]
    assert second.usage.input_tokens == prompt_tokens(system, turns)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    # A new gateway process knows nothing but the ledger.
    port = int(gateways[0].url.rsplit(":", 1)[1])
    gateways[0].process.stop()
    gateways[0] = start_gateway(system, keys, port)
    third = ask(gateways[0], system, questions[2], previous=second.id)
    turns += [("assistant", second.output_text), ("user", questions[2])]
    assert third.usage.input_tokens == prompt_tokens(system, turns)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    again = gateways[0].client().responses.with_raw_response.retrieve(first.id).http_response.json()
    Response.model_validate(again, strict=True)
    assert again == first.model_dump(mode="json", exclude_unset=True) | {"output": again["output"]}
    assert again["output"][0]["content"][0]["text"] == first.output_text and again["status"] == first.status


def test_another_gateway_finds_a_response_made_a_moment_ago(system: System, gateways: list[KeyedGateway]) -> None:
    first = ask(gateways[0], system, "Name a colour.")
    # Straight to the other gateway, before the recorder may have projected it.
    second = ask(gateways[1], system, "Name another.", previous=first.id)
    turns = [("user", "Name a colour."), ("assistant", first.output_text), ("user", "Name another.")]
    assert second.usage.input_tokens == prompt_tokens(system, turns)
    assert gateways[1].client().responses.retrieve(first.id).id == first.id


def test_another_principals_response_is_404(system: System, gateways: list[KeyedGateway]) -> None:
    mine = ask(gateways[0], system, "A secret: 42.")
    bob = gateways[1].client(BOB)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as caught:
        bob.responses.create(model=system.model, input="Tell me.", previous_response_id=mine.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    anonymous = OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        anonymous.responses.retrieve(mine.id)
    assert gateways[1].client().responses.retrieve(mine.id).id == mine.id


def test_a_deleted_response_is_gone_and_its_turns_with_it(system: System, gateways: list[KeyedGateway]) -> None:
    """DELETE erases the content, so a conversation through the deleted response cannot go on; the
    responses after it are still there to read."""
    first = ask(gateways[0], system, "Count to three.")
    second = ask(gateways[0], system, "Now to four.", previous=first.id)
    gateways[0].client().responses.delete(first.id)
    for gateway in gateways:
        def gone(gateway: KeyedGateway = gateway) -> bool:
            try:
                gateway.client().responses.retrieve(first.id)
            except openai.NotFoundError:
                return True
            return False

        eventually(gone, 10, message=f"{first.id} still served by {gateway.url}")
    with pytest.raises(openai.NotFoundError):
        ask(gateways[1], system, "And five?", previous=first.id)
    for gateway in gateways:
        with pytest.raises(openai.NotFoundError) as caught:
            ask(gateway, system, "And five?", previous=second.id)
        assert caught.value.body["param"] == "previous_response_id" and first.id in caught.value.body["message"]
        assert gateway.client().responses.retrieve(second.id).id == second.id


def test_a_streamed_response_is_stored_as_streamed(system: System, gateways: list[KeyedGateway]) -> None:
    with gateways[0].client().responses.stream(model=system.model, input="Say hi.", max_output_tokens=32,
                                               temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    stored = gateways[1].client().responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.usage == final.usage
