"""The worker's tool-call grammars, run through llguidance on the default model's tokenizer: a
forced call continues the opening the prompt wrote, strict tools hold their arguments to their
schemas inside free text, and a request's own constraint composes with strict tools."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import llguidance
import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.worker.prompt import build_prompt, resolve_sampling
from apps.worker.tool_grammar import check_composed
from engine.frontend.grammars import BOUNDS, GrammarChecker, to_llguidance
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import SamplingParams, StructuredOutput, StructuredOutputKind
from engine.frontend.tokenizer import Tokenizer
from engine.loading.default_model import default_model_path

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": None}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())[0]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer.hf.to_str(), eos_token=tokenizer.all_stop_token_ids)


def request(tools: list[dict[str, Any]], structured: StructuredOutput | None = None,
            **kw: Any) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x",
                                sampling=SamplingParams(structured=structured),
                                messages=[wire.ChatMessage(role="user", content="Weather in Paris?")],
                                tools=tools, **kw)


def matches(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer, req: wire.GenerateRequest,
            reply: str) -> tuple[bool, bool]:
    """(the whole reply is allowed, the grammar is complete after it)."""
    sampling = resolve_sampling(req, 10, 2048)
    assert sampling.structured is not None
    matcher = llguidance.LLMatcher(ll_tokenizer, to_llguidance(sampling.structured), log_level=0)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids), matcher.is_stopped()


def test_a_forced_named_call_continues_its_opening(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    req = request([WEATHER, CLOCK], tool_required=True, tool_name="weather")
    prompt = tokenizer.decode(build_prompt(tokenizer, req).token_ids, skip_special_tokens=False)
    assert prompt.endswith('<tool_call>\n{"name": "weather", "arguments": ')
    assert matches(tokenizer, ll_tokenizer, req, '{"city": "Paris"}}\n</tool_call>') == (True, True)
    assert not matches(tokenizer, ll_tokenizer, req, '{"town": "Paris"}}\n</tool_call>')[0]


def test_a_required_call_names_one_of_the_tools(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    req = request([WEATHER, CLOCK], tool_required=True)
    # Forced calls are held to every tool's schema, strict or not (clock has none: any object).
    assert matches(tokenizer, ll_tokenizer, req, '{"name": "clock", "arguments": {"zone": 1}}\n</tool_call>') \
        == (True, True)
    assert not matches(tokenizer, ll_tokenizer, req, '{"name": "weather", "arguments": {"zone": 1}}')[0]
    assert not matches(tokenizer, ll_tokenizer, req, '{"name": "radio", "arguments": {}}')[0]


def test_strict_tools_constrain_calls_inside_free_text(tokenizer: Tokenizer,
                                                       ll_tokenizer: llguidance.LLTokenizer) -> None:
    req = request([WEATHER, CLOCK])
    assert matches(tokenizer, ll_tokenizer, req, "No tool needed.")[0]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert matches(tokenizer, ll_tokenizer, req, "Let me check. " + call + "\n" + call)[0]
    assert not matches(tokenizer, ll_tokenizer, req, 'Hm <tool_call>\n{"name": "weather", "arguments": {"town": 1}}')[0]
    # A tool that is not strict still has to be called by name with an object.
    assert matches(tokenizer, ll_tokenizer, req,
                   '<tool_call>\n{"name": "clock", "arguments": {"any": 2}}\n</tool_call>')[0]


def test_own_constraint_or_strict_tool_calls(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    own = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA,
                           spec=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"]}))
    req = request([WEATHER], own)
    assert matches(tokenizer, ll_tokenizer, req, '{"a": 5}') == (True, True)
    assert not matches(tokenizer, ll_tokenizer, req, "free text")[0]
    assert matches(tokenizer, ll_tokenizer, req,
                   '<tool_call>\n{"name": "weather", "arguments": {"city": "x"}}\n</tool_call>')[0]


def test_no_strict_or_forced_tool_leaves_the_request_constraint_alone() -> None:
    own = StructuredOutput(kind=StructuredOutputKind.REGEX, spec="[a-z]+")
    assert resolve_sampling(request([CLOCK], own), 10, 2048).structured == own
    assert resolve_sampling(request([CLOCK]), 10, 2048).structured is None


def checked(req: wire.GenerateRequest, checker: GrammarChecker | None = None) -> None:
    """What a run does before any work: compose the grammar, then check it compiles."""
    sampling = resolve_sampling(req, 10, 2048)
    asyncio.run(check_composed(req, sampling, checker or GrammarChecker()))


def test_a_tool_schema_that_cannot_compile_is_refused_before_any_work() -> None:
    broken = {"type": "function", "function": {"name": "x", "parameters": {"type": "strin"}, "strict": True}}
    with pytest.raises(ServingError) as caught:
        checked(request([broken]))
    assert (caught.value.status, caught.value.param) == (400, "tools")
    assert len(caught.value.message.encode()) < 1024


def test_a_composed_grammar_past_its_bound_is_refused_before_it_compiles() -> None:
    big = {"type": "object", "description": "d" * (BOUNDS.composed_bytes // 4)}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": big, "strict": True}} for i in range(5)]
    checker = GrammarChecker()
    with pytest.raises(ServingError) as caught:
        checked(request(tools), checker)
    assert (caught.value.status, caught.value.param) == (400, "tools")
    assert checker.started == 0


def test_a_composed_grammar_is_checked_once_and_the_own_one_not_again() -> None:
    checker = GrammarChecker()
    checked(request([WEATHER]), checker)
    assert checker.started == 1
    checked(request([CLOCK], StructuredOutput(kind=StructuredOutputKind.REGEX, spec="[a-z]+")), checker)
    assert checker.started == 1  # the gateway checked the request's own constraint


def test_a_constraint_past_its_bounds_from_the_bus_is_refused_before_it_compiles() -> None:
    own = StructuredOutput(kind=StructuredOutputKind.CHOICE,
                           spec=json.dumps([f"c{i}" for i in range(BOUNDS.choices + 1)]))
    with pytest.raises(ServingError) as caught:
        resolve_sampling(request([CLOCK], own), 10, 2048)
    assert caught.value.status == 400 and "choices" in caught.value.message
    regex = StructuredOutput(kind=StructuredOutputKind.REGEX, spec="a" * (BOUNDS.regex_bytes + 1))
    with pytest.raises(ServingError):
        resolve_sampling(request([], regex), 10, 2048)
