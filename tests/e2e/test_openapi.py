"""The served OpenAPI document describes the generation routes as they really behave: every real
response and error body validates against the schema the gateway publishes for it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import System

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}]},
    "/v1/completions": {"prompt": "The capital of France is"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Say hi."}]},
}


@pytest.fixture(scope="module")
def document(system: System) -> dict[str, Any]:
    response = httpx.get(f"{system.base_url}/openapi/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def _validator(document: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    # Refs point at #/components/schemas/..., so validate with the document's components at the root.
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def _schema(document: dict[str, Any], path: str, status: str, media: str = "application/json") -> dict[str, Any]:
    return document["paths"][path]["post"]["responses"][status]["content"][media]["schema"]


def _all_refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _all_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _all_refs(v)]
    return []


def test_every_reference_resolves(document: dict[str, Any]) -> None:
    components = document["components"]["schemas"]
    refs = set(_all_refs(document))
    assert refs, "the generation routes document no body types"
    missing = [r for r in refs if r.removeprefix("#/components/schemas/") not in components]
    assert not missing


@pytest.mark.parametrize("path", list(ROUTES), ids=lambda p: p.rsplit("/", 1)[-1])
def test_request_body_and_statuses_are_documented(document: dict[str, Any], path: str) -> None:
    operation = document["paths"][path]["post"]
    body_ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body_schema = document["components"]["schemas"][body_ref.rsplit("/", 1)[-1]]
    assert {"model", "max_tokens", "temperature", "stream"} <= set(body_schema["properties"])
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(operation["responses"])


@pytest.mark.parametrize("path", list(ROUTES), ids=lambda p: p.rsplit("/", 1)[-1])
def test_real_bodies_validate_against_the_document(system: System, document: dict[str, Any], path: str) -> None:
    request = {"model": system.model, "max_tokens": 4, "temperature": 0, **ROUTES[path]}
    _validator(document, document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
               ).validate(request)
    with httpx.Client(base_url=system.base_url, timeout=120) as http:
        answer = http.post(path, json=request)
        assert answer.status_code == 200, answer.text
        _validator(document, _schema(document, path, "200")).validate(answer.json())

        unknown = http.post(path, json={**request, "model": "no-such-model"})
        assert unknown.status_code == 404
        _validator(document, _schema(document, path, "404")).validate(unknown.json())

        bad = http.post(path, json={**request, "temperature": "hot"})
        assert bad.status_code == 400
        _validator(document, _schema(document, path, "400")).validate(bad.json())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_stream_chunks_validate_against_the_document(system: System, document: dict[str, Any], path: str) -> None:
    request = {"model": system.model, "max_tokens": 4, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, **ROUTES[path]}
    validator = _validator(document, _schema(document, path, "200", "text/event-stream"))
    chunks = 0
    with httpx.stream("POST", f"{system.base_url}{path}", json=request, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                validator.validate(json.loads(line.removeprefix("data: ")))
                chunks += 1
    assert chunks >= 2


def _body_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return document["components"]["schemas"][ref.rsplit("/", 1)[-1]]


def _max_items(prop: dict[str, Any]) -> int:
    arrays = [prop] if prop.get("type") == "array" else [s for s in prop.get("anyOf", []) if s.get("type") == "array"]
    return arrays[0]["maxItems"]


@pytest.mark.parametrize("path", list(ROUTES), ids=lambda p: p.rsplit("/", 1)[-1])
def test_the_input_contract_is_in_the_schema(document: dict[str, Any], path: str) -> None:
    properties = _body_schema(document, path)["properties"]
    assert properties["model"]["maxLength"] == 256 and properties["model"]["pattern"]
    stops = "stop_sequences" if path == "/v1/messages" else "stop"
    assert _max_items(properties[stops]) == 16
    if path != "/v1/completions":
        assert _max_items(properties["messages"]) == 2048
        assert _max_items(properties["tools"]) == 128
    if path != "/v1/messages":
        assert _max_items(properties["stop_token_ids"]) == 64
    assert "415" in document["paths"][path]["post"]["responses"]
