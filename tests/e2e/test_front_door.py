"""The front door: `GET /` says how to talk to the server, and a path that is no route gets a 404
that says which base URL the client meant, in the envelope its SDK reads (Anthropic's under the
Anthropic routes), as the real `openai` and `anthropic` SDKs see it."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import System
from tests.support import eventually


def index(system: System) -> dict:
    answer = httpx.get(f"{system.base_url}/", timeout=30)
    assert answer.status_code == 200
    return answer.json()


def test_the_root_lists_routes_docs_and_models(system: System) -> None:
    body = eventually(lambda: (lambda b: b if system.model in b["models"] else None)(index(system)), 30,
                      message=lambda: repr(index(system)))
    base = system.base_url
    assert (body["openai_base_url"], body["anthropic_base_url"]) == (f"{base}/v1", base)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
            "GET /v1/models", "GET /v1/responses/{response_id}", "GET /metrics"} <= set(body["routes"])
    assert not any(route.split(" ", 1)[1].startswith("/openapi") for route in body["routes"])
    docs = httpx.get(body["docs"], timeout=30)
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    schema = httpx.get(body["openapi"], timeout=30).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_the_anthropic_sdk_with_v1_in_its_base_url_is_told_to_drop_it(system: System) -> None:
    client = anthropic.Anthropic(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model=system.model, max_tokens=4, messages=[{"role": "user", "content": "Hi."}])
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    message = body["error"]["message"]
    assert "/v1/v1/messages" in message and f'base_url="{system.base_url}" (without /v1)' in message
    assert message in str(caught.value)


@pytest.mark.parametrize("base_url", ["{base}/v1/v1", "{base}"], ids=["v1-twice", "no-v1"])
def test_the_openai_sdk_with_a_wrong_base_url_is_told_the_right_one(system: System, base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url.format(base=system.base_url), api_key="unused", max_retries=0,
                           timeout=30)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=system.model, max_tokens=4, messages=[{"role": "user", "content": "Hi."}])
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert "the route is /v1/chat/completions" in error["message"]
    assert f'base URL is "{system.base_url}/v1"' in error["message"]


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/nope"), ("POST", "/v1/v1/nope"),
                                          ("GET", "/v1/responses/r/x")])
def test_an_unknown_route_points_to_the_index_and_the_docs(system: System, method: str, path: str) -> None:
    answer = httpx.request(method, f"{system.base_url}{path}", timeout=30)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)
    assert error["message"].startswith(f"There is no route {method} {path}. GET {system.base_url}/ lists the routes")
    assert f"{system.base_url}/openapi" in error["message"]


def test_a_missing_route_under_the_anthropic_routes_answers_in_anthropic_s_envelope(system: System) -> None:
    answer = httpx.post(f"{system.base_url}/v1/messages/nope", json={}, timeout=30)
    assert answer.status_code == 404
    assert answer.json() == {"type": "error", "error": {"type": "not_found_error",
                                                        "message": answer.json()["error"]["message"]}}
