"""The gateway's structured-output fields: each spelling becomes the one `StructuredOutput` on
`SamplingParams`, and nothing that cannot be enforced gets through (a 400 naming the field)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from apps.bus.codes import ServingError
from apps.gateway import openai_schema as oa
from apps.gateway.validate import decode_body
from engine.protocol import StructuredOutput
from engine.protocol import StructuredOutputKind as Kind

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), oa.ChatCompletionRequest)


def structured(**fields: Any) -> StructuredOutput | None:
    return chat(**fields).sampling_params().structured


def refused(**fields: Any) -> ServingError:
    with pytest.raises(ServingError) as caught:
        chat(**fields).sampling_params()
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("fields", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, Kind.JSON_SCHEMA, {"type": "object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     Kind.JSON_SCHEMA, PERSON),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, Kind.JSON_SCHEMA, {"type": "object"}),
    ({"structured_outputs": {"json": PERSON}}, Kind.JSON_SCHEMA, PERSON),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, Kind.JSON_SCHEMA, PERSON),
    ({"structured_outputs": {"json_object": True}}, Kind.JSON_SCHEMA, {"type": "object"}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, Kind.REGEX, "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Kind.CHOICE, ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, Kind.GRAMMAR, 'root ::= "a" | "b"'),
    ({"guided_json": PERSON}, Kind.JSON_SCHEMA, PERSON),
    ({"guided_regex": r"\d+"}, Kind.REGEX, r"\d+"),
    ({"guided_choice": ["a", "b"]}, Kind.CHOICE, ["a", "b"]),
    ({"guided_grammar": 'start: "x"'}, Kind.GRAMMAR, 'start: "x"'),
], ids=["json_object", "json_schema", "json_schema-no-schema", "so-json", "so-json-text", "so-json_object",
        "so-regex", "so-choice", "so-gbnf", "guided_json", "guided_regex", "guided_choice", "guided_grammar"])
def test_each_spelling_becomes_one_constraint(fields: dict[str, Any], kind: Kind, spec: Any) -> None:
    constraint = structured(**fields)
    assert constraint is not None and constraint.kind is kind
    got = json.loads(constraint.spec) if kind in (Kind.JSON_SCHEMA, Kind.CHOICE) else constraint.spec
    assert got == spec


def test_text_format_and_no_fields_mean_no_constraint() -> None:
    assert structured() is None
    assert structured(response_format={"type": "text"}) is None


def test_completions_take_the_same_fields() -> None:
    body = {"model": "m", "prompt": "x", "structured_outputs": {"regex": "[0-9]"}}
    req = decode_body(msgspec.json.encode(body), oa.CompletionRequest)
    assert req.sampling_params().structured == StructuredOutput(kind=Kind.REGEX, spec="[0-9]")


def test_whitespace_pattern_reaches_the_schema_options() -> None:
    constraint = structured(guided_json=PERSON, guided_whitespace_pattern=r"[ ]?")
    assert constraint is not None
    assert json.loads(constraint.spec)["x-guidance"]["whitespace_pattern"] == "[ ]?"


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
], ids=["bad-type", "bad-pattern", "no-json_schema", "unknown-format", "bad-regex", "bad-grammar", "no-choices",
        "two-keys", "no-key", "unsupported-key", "whitespace-without-json", "guided_json-not-json",
        "whitespace-alone", "two-constraints"])
def test_what_cannot_be_enforced_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    try:
        error = refused(**fields)
    except ServingError as exc:  # refused at decode time: a bad value for the field
        error = exc
    assert error.param == param, error.message


def strict_tool(parameters: dict[str, Any], strict: bool | None = True) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "lookup", "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def test_tool_schemas_that_will_be_enforced_must_compile() -> None:
    bad = {"type": "object", "properties": {"q": {"type": "strin"}}}
    assert refused(tools=[strict_tool(bad)]).param == "tools"
    assert refused(tools=[strict_tool(bad, strict=None)], tool_choice="required").param == "tools"
    # Not strict and not forced: the tool's calls are not constrained, so the schema is not compiled.
    assert structured(tools=[strict_tool(bad, strict=None)]) is None
    assert structured(tools=[strict_tool(bad)], tool_choice="none") is None


def test_strict_reaches_the_template_only_when_the_client_set_it() -> None:
    ok = {"type": "object"}
    assert chat(tools=[strict_tool(ok)]).tool_dicts()[0]["function"]["strict"] is True
    assert "strict" not in chat(tools=[strict_tool(ok, strict=None)]).tool_dicts()[0]["function"]
