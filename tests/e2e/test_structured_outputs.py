"""Structured outputs through the whole system on the default model, with the `openai` SDK:
`chat.completions.parse` returns a parsed object for five schemas, greedy and sampled; regex and
choice constraints hold on 20 sampled completions each; a forced strict tool call's arguments
match its schema; what cannot be enforced is a 400 naming the field."""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import anthropic
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import System

# Enough room for every schema below to close: their strings and arrays are bounded.
MAX_TOKENS = 200


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Item(BaseModel):
    name: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    customer: str = Field(max_length=16)
    items: list[Item] = Field(min_length=1, max_length=3)


class Condition(enum.StrEnum):
    SUNNY = "sunny"
    RAINY = "rainy"
    CLOUDY = "cloudy"


class Weather(BaseModel):
    city: str = Field(max_length=16)
    condition: Condition
    temperature_c: int = Field(ge=-30, le=50)


class Author(BaseModel):
    name: str = Field(max_length=20)
    born: int = Field(ge=1000, le=2024)


class Book(BaseModel):
    title: str = Field(max_length=24)
    author: Author
    in_print: bool


class Tags(BaseModel):
    topic: str = Field(max_length=16)
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=4)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a famous scientist."),
    (Order, "Write a small grocery order."),
    (Weather, "What is the weather like in Paris today?"),
    (Book, "Tell me about a classic novel."),
    (Tags, "Give some tags for an article about the ocean."),
]


def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize(("model", "question"), SCHEMAS, ids=[m.__name__ for m, _ in SCHEMAS])
def test_parse_returns_the_parsed_object(system: System, model: type[BaseModel], question: str,
                                         temperature: float) -> None:
    reply = client(system).chat.completions.parse(
        model=system.model, messages=[{"role": "user", "content": question}], response_format=model,
        temperature=temperature, seed=7, max_tokens=MAX_TOKENS,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content or "") == choice.message.parsed


@pytest.mark.parametrize("spelling", ["structured_outputs", "guided"])
def test_regex_holds_on_20_sampled_completions(system: System, spelling: str) -> None:
    pattern = r"[A-Z][a-z]{2,8} \d{1,3} (Street|Road|Lane)"
    extra = ({"structured_outputs": {"regex": pattern}} if spelling == "structured_outputs"
             else {"guided_regex": pattern})
    texts = []
    for seed in (1, 2):
        reply = client(system).chat.completions.create(
            model=system.model, messages=[{"role": "user", "content": "Give me an address."}], n=10,
            temperature=1.0, seed=seed, max_tokens=32, extra_body=extra,
        )
        assert [c.finish_reason for c in reply.choices] == ["stop"] * 10
        texts += [c.message.content or "" for c in reply.choices]
    assert len(texts) == 20
    assert all(re.fullmatch(pattern, text) for text in texts), texts
    assert len(set(texts)) > 1, "sampled completions should differ"


@pytest.mark.parametrize("spelling", ["structured_outputs", "guided"])
def test_choice_holds_on_20_sampled_completions(system: System, spelling: str) -> None:
    options = ["positive", "negative", "neutral"]
    extra = ({"structured_outputs": {"choice": options}} if spelling == "structured_outputs"
             else {"guided_choice": options})
    texts = []
    for seed in (3, 4):
        reply = client(system).chat.completions.create(
            model=system.model, n=10, temperature=1.0, seed=seed, max_tokens=8, extra_body=extra,
            messages=[{"role": "user", "content": "Sentiment of: 'The food was fine, the service slow.'"}],
        )
        assert [c.finish_reason for c in reply.choices] == ["stop"] * 10
        texts += [c.message.content or "" for c in reply.choices]
    assert len(texts) == 20 and set(texts) <= set(options), texts


def test_json_object_is_a_json_object(system: System) -> None:
    reply = client(system).chat.completions.create(
        model=system.model, messages=[{"role": "user", "content": "List two fruits as JSON."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=MAX_TOKENS,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:  # a JSON object may be long; a cut-off one still opens as an object
        assert reply.choices[0].finish_reason == "length"
        assert (reply.choices[0].message.content or "").startswith("{")


def test_forced_strict_tool_call_matches_its_schema(system: System) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters, "strict": True}}]
    reply = client(system).chat.completions.create(
        model=system.model, messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), parameters)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "bad", "schema": {"type": "object",
                                                                    "properties": {"a": {"type": "strin"}}}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                   "parameters": {"type": "object",
                                                                  "properties": {"a": {"type": "strin"}}}}}]},
     "tools"),
], ids=["uncompilable-schema", "bad-regex", "unsupported-key", "uncompilable-strict-tool"])
def test_what_cannot_be_enforced_is_a_400(system: System, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(system).chat.completions.create(
            model=system.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.param == param


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("model, prompt", SCHEMAS, ids=[model.__name__ for model, _ in SCHEMAS])
def test_responses_parse_returns_the_parsed_object(system: System, model: type[BaseModel], prompt: str,
                                                   temperature: float) -> None:
    # The Responses API's `text.format` takes the same grammar as chat's `response_format`.
    response = client(system).responses.parse(
        model=system.model, input=prompt, text_format=model, temperature=temperature,
        max_output_tokens=MAX_TOKENS)
    assert response.status == "completed", response
    assert isinstance(response.output_parsed, model), response.output_text


def anthropic_client(system: System) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=300)


class Capital(BaseModel):
    country: str
    capital: str
    coastal: bool
    continent: Annotated[str, Field(json_schema_extra={"enum": ["Europe", "Asia", "Africa", "Americas"]})]


def test_anthropic_parse_returns_the_parsed_object(system: System) -> None:
    # The Anthropic SDK's `messages.parse(output_format=...)` sends `output_config.format` (a schema
    # without numeric or length bounds, which it moves into descriptions for Anthropic's models).
    message = anthropic_client(system).messages.parse(
        model=system.model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Tell me about France."}],
        output_format=Capital, extra_body={"temperature": 0})
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, Capital)


def test_anthropic_strict_tool_and_failed_tool_results(system: System) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": schema, "strict": True}
    message = anthropic_client(system).messages.create(
        model=system.model, max_tokens=64, messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    jsonschema.validate(call.input, schema)
    # A schema that cannot be enforced is a 400 naming where it came; a stream beside it runs to its end.
    stream = client(system).chat.completions.create(model=system.model, stream=True, max_tokens=16, temperature=0,
                                                    messages=[{"role": "user", "content": "Count to five."}])
    chunks = iter(stream)
    first = next(chunks)
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client(system).messages.create(
            model=system.model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
            output_config={"format": {"type": "json_schema",
                                      "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}})
    assert "output_config.format" in refused.value.message
    finish = [c.choices[0].finish_reason for c in [first, *chunks] if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])


def test_an_anthropic_tool_result_marked_as_an_error_reaches_the_model_as_one(system: System) -> None:
    def counted(is_error: bool) -> int:
        return anthropic_client(system).messages.count_tokens(model=system.model, messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timeout",
                                          "is_error": is_error}]}]).input_tokens
    assert counted(True) > counted(False)
