"""The `openai` SDK's own helpers, which parse what they receive: the chat stream helper with a
pydantic function tool (it accumulates tool-call deltas and parses the arguments into the model),
the Responses stream helper, and `with_raw_response` bodies against the SDK's types."""

from __future__ import annotations

from typing import Literal

import openai
from openai import OpenAI
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from tests.system import System


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_stream_helper_parses_a_pydantic_tool_call(system: System, compat_model: str) -> None:
    with client(system).chat.completions.stream(
            model=compat_model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    (call,) = final.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(city="Paris", unit="celsius")
    assert final.choices[0].finish_reason == "tool_calls"


def test_chat_create_with_raw_response_is_strictly_typed(system: System, compat_model: str) -> None:
    raw = client(system).chat.completions.with_raw_response.create(
        model=compat_model, messages=[{"role": "user", "content": "Hello?"}])
    completion = ChatCompletion.model_validate(raw.http_response.json(), strict=True)
    assert completion.choices[0].message.content == "Hello from helexa."
    assert raw.headers["x-request-id"] == completion.id


def test_responses_stream_helper_with_a_function_tool(system: System, compat_model: str) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
            "strict": True, "parameters": GetWeather.model_json_schema() | {"additionalProperties": False}}
    with client(system).responses.stream(model=compat_model, input="What is the weather in Paris?",
                                         tools=[tool]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    (call,) = final.output
    assert call.type == "function_call" and GetWeather.model_validate_json(call.arguments).city == "Paris"
