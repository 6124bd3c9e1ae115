"""The gateway's structured-output fields: each spelling becomes the one `StructuredOutput` on
`SamplingParams`, and nothing that cannot be enforced gets through (a 400 naming the field): past
the grammar bounds before anything compiles, and what does not compile."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from apps.bus.codes import ServingError
from apps.gateway.api import chat as chat_route
from apps.gateway.api import openai_schema as oa
from apps.gateway.api.structured import CHECKER, check_enforceable
from apps.gateway.api.validate import decode_body
from engine.frontend.grammars import BOUNDS
from engine.frontend.protocol import StructuredOutput
from engine.frontend.protocol import StructuredOutputKind as Kind

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), oa.ChatCompletionRequest)


def structured(**fields: Any) -> StructuredOutput | None:
    return chat(**fields).sampling_params().structured


def enforceable(**fields: Any) -> None:
    """What the chat route checks before it serves: the bounds, then the compile."""
    req = chat(**fields)
    asyncio.run(check_enforceable(chat_route.to_bus_request(req, "r"), req.constraint_param()))


def refused(**fields: Any) -> ServingError:
    with pytest.raises(ServingError) as caught:
        enforceable(**fields)
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


def gbnf_chain(rules: int) -> str:
    """A GBNF grammar of `rules` rules, each naming the next (its conversion to Lark is what grows
    with rules x bytes)."""
    links = rules - 2
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(links)) + f'r{links} ::= "c"\n'


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
    enforceable(tools=[strict_tool(bad, strict=None)])
    enforceable(tools=[strict_tool(bad)], tool_choice="none")


def test_strict_reaches_the_template_only_when_the_client_set_it() -> None:
    ok = {"type": "object"}
    assert chat(tools=[strict_tool(ok)]).tool_dicts()[0]["function"]["strict"] is True
    assert "strict" not in chat(tools=[strict_tool(ok, strict=None)]).tool_dicts()[0]["function"]


def compiles_started() -> int:
    return CHECKER.started


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_choice": [f"c{i}" for i in range(BOUNDS.choices + 1)]}, "guided_choice"),
    ({"structured_outputs": {"choice": ["x" * (BOUNDS.choice_bytes + 1)]}}, "structured_outputs"),
    ({"guided_choice": ["é" * 500] * 100}, "guided_choice"),
    ({"guided_regex": "a" * (BOUNDS.regex_bytes + 1)}, "guided_regex"),
    ({"guided_grammar": 'start: "' + "a" * BOUNDS.grammar_bytes + '"'}, "guided_grammar"),
    ({"structured_outputs": {"grammar": gbnf_chain(BOUNDS.gbnf_rules + 1)}}, "structured_outputs"),
    ({"guided_json": {"type": "object", "description": "d" * BOUNDS.schema_bytes}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["e" * BOUNDS.schema_bytes]}}}},
     "response_format"),
    ({"guided_json": "[" * 5000}, "guided_json"),
    ({"structured_outputs": {"json": "{" * 100 + "}" * 100}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " " * (BOUNDS.regex_bytes + 1)}, "guided_json"),
    ({"tools": [strict_tool({"type": "object", "description": "d" * BOUNDS.tool_schema_bytes})]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "strict": True,
                                                  "parameters": {"description": "d" * (60 << 10)}}}
                for i in range(5)]}, "tools"),
], ids=["choices-count", "choice-bytes", "choices-total", "regex", "grammar", "gbnf-rules", "schema",
        "response_format-schema",
        "string-schema-deep", "string-schema-deep-object", "whitespace-pattern", "tool-schema", "tool-schemas-total"])
def test_past_a_grammar_bound_is_a_400_naming_the_field_before_any_compile(fields: dict[str, Any], param: str) -> None:
    before = compiles_started()
    error = refused(**fields)
    assert error.param == param, error.message
    assert compiles_started() == before, "a grammar past its bounds was compiled"


def test_grammars_at_their_bounds_are_accepted() -> None:
    enforceable(guided_choice=[f"{i:07d}" for i in range(BOUNDS.choices)])
    enforceable(guided_grammar=gbnf_chain(BOUNDS.gbnf_rules))
    enforceable(guided_regex="(" + "|".join(f"a{i}" for i in range(1500)) + ")")
    enforceable(guided_json=json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                         for i in range(2000)}}))


def test_a_check_past_its_deadline_is_a_400_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from engine.frontend import grammars

    release = threading.Event()
    checker = grammars.GrammarChecker(threads=1, deadline_s=0.2, check=lambda s: release.wait(30) and None)
    monkeypatch.setattr("apps.gateway.api.structured.CHECKER", checker)
    try:
        error = refused(guided_regex="[a-z]+")
    finally:
        release.set()
    assert error.param == "guided_regex" and error.code == "grammar_too_complex"


def test_a_check_that_cannot_start_before_its_deadline_is_busy_not_too_complex() -> None:
    import threading

    from engine.frontend import grammars

    release = threading.Event()
    checker = grammars.GrammarChecker(threads=1, deadline_s=0.2, check=lambda s: release.wait(30) and None)
    regex = StructuredOutput(kind=Kind.REGEX, spec="[a-z]+")

    async def two() -> list[BaseException | str | None]:
        return await asyncio.gather(checker.error(regex), checker.error(regex), return_exceptions=True)

    try:
        first, second = asyncio.run(two())
    finally:
        release.set()
    assert isinstance(first, grammars.CheckTimeout) and isinstance(second, grammars.CheckBusy)
    assert checker.started == 1
