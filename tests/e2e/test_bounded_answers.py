"""Answers are bounded by default, the same way on every API: a request without a length limit
gets the output limit the model advertises in /v1/models, and one that asks for more is a 400
`context_length_exceeded` naming its parameter. A worker of the default model with a 1024-token
context (a quarter of it, 256 tokens, is the advertised output limit) answers with `ignore_eos`,
so every answer runs into the limit."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import STATUS_INTERVAL_S, System
from tests.support import AppProcess, eventually

MODEL = "bounded-smollm2"
CONTEXT = 1024
OUTPUT_LIMIT = CONTEXT // 4
QUESTION = "Count from one to one thousand in words."
# The Responses API has no `ignore_eos`: a question the model greedily answers at length.
LONG_QUESTION = "Write a very long essay about the history of Rome."


def advertised(system: System) -> dict | None:
    models = httpx.get(f"{system.base_url}/v1/models", timeout=30).json()["data"]
    return next((m for m in models if m["id"] == MODEL), None)


@pytest.fixture(scope="module")
def bounded(system: System) -> Iterator[int]:
    """The served model's advertised output limit, once the gateway sees the worker."""
    worker = AppProcess(["worker", "--served-model-name", MODEL], {
        **system.env_for("worker"), "HELEXA_NODE_ID": "e2e-bounded", "HELEXA_MAX_MODEL_LEN": str(CONTEXT),
        "HELEXA_MAX_NUM_SEQS": "2", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
    try:
        worker.wait_ready()
        entry = eventually(lambda: advertised(system), 30, message=f"{MODEL} is not in /v1/models")
        assert entry["limit"] == {"context": CONTEXT, "input": CONTEXT - OUTPUT_LIMIT, "output": OUTPUT_LIMIT}
        yield entry["max_output_tokens"]
    finally:
        worker.stop()


def openai_client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_without_max_tokens_stops_at_the_output_limit(system: System, bounded: int) -> None:
    answer = openai_client(system).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == bounded == OUTPUT_LIMIT


def test_completions_without_max_tokens_stop_at_the_output_limit(system: System, bounded: int) -> None:
    answer = openai_client(system).completions.create(model=MODEL, prompt=QUESTION, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == bounded


def test_a_response_without_max_output_tokens_is_incomplete_at_the_output_limit(system: System,
                                                                                 bounded: int) -> None:
    response = openai_client(system).responses.create(model=MODEL, input=LONG_QUESTION, temperature=0, store=False)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == bounded


@pytest.mark.parametrize("route, param", [
    ("/v1/chat/completions", "max_tokens"),
    ("/v1/chat/completions", "max_completion_tokens"),
    ("/v1/completions", "max_tokens"),
    ("/v1/responses", "max_output_tokens"),
], ids=["chat", "chat-max_completion_tokens", "completions", "responses"])
def test_asking_past_the_output_limit_is_refused(system: System, bounded: int, route: str, param: str) -> None:
    body = {"model": MODEL, param: bounded + 1}
    body.update({"/v1/completions": {"prompt": QUESTION}, "/v1/responses": {"input": QUESTION}}.get(
        route, {"messages": [{"role": "user", "content": QUESTION}]}))
    answer = httpx.post(f"{system.base_url}{route}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", param,
                                                              "invalid_request_error")
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert f"at most {bounded}" in error["message"] and f"{bounded + 1} completion tokens" in error["message"]


def test_anthropic_max_tokens_is_bounded_the_same_way(system: System, bounded: int) -> None:
    client = anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=bounded + 1, messages=[{"role": "user", "content": QUESTION}])
    assert refused.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": refused.value.body["error"]["message"]}}
    assert f"at most {bounded}" in refused.value.body["error"]["message"]
    answer = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": QUESTION}])
    assert (answer.stop_reason, answer.usage.output_tokens) == ("max_tokens", 3)
