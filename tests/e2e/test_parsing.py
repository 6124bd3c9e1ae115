"""Reasoning, tool calls and logprobs through the OpenAI surface.

SmolLM2 neither thinks nor calls tools, so those cases run against a scripted worker: the real
worker process and tokenizer, with replies taken from a script instead of a model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import anthropic
import pytest
from openai import OpenAI

from tests.e2e.conftest import System, scripted_worker

SCRIPTED = "scripted-tools"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FORCED_NAMED = '<tool_call>\n{"name": "get_weather", "arguments": '
FORCED_ANY = "Use a tool now.<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
SCRIPT = {
    "rules": [
        # A forced start lands at the end of the prompt; the reply goes on from there.
        {"match": FORCED_NAMED, "reply": '{"city": "Lyon"}}\n</tool_call>'},
        {"match": FORCED_ANY, "reply": '{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'},
        # A prefill the template closed would be a new turn: say so loudly.
        {"match": "The capital is<|im_end|>", "reply": "CLOSED"},
        {"match": "Name the capital", "reply": " Paris."},
        # First match wins: the follow-up turn also contains the question.
        {"match": "18 degrees", "reply": "It is 18 degrees in Paris."},
        {"match": "weather in Rome and Oslo",
         "reply": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                  'Checking both.'},
        {"match": "weather in Paris",
         "reply": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
        {"match": "think it over", "reply": "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."},
        {"match": "long thought", "reply": "<think>This thought goes on and on and never reaches its end"},
        {"match": "broken tool", "reply": "<tool_call>{oops}</tool_call>"},
    ],
    "default": "ok",
}


@pytest.fixture(scope="module")
def scripted(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SCRIPTED, SCRIPT):
        yield SCRIPTED


def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(system: System, content: str, stream: bool = False, **kw: object):
    messages = [{"role": "user", "content": content}]
    return client(system).chat.completions.create(model=SCRIPTED, messages=messages, stream=stream, **kw)


def collect_stream(chunks) -> dict:
    """Accumulate a stream as OpenAI clients do: a tool call opens with its index, id, type and
    name, and its arguments arrive as string fragments after that."""
    out = {"content": "", "reasoning": "", "tool_calls": [], "finish": None}
    calls: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            reasoning = getattr(delta, "reasoning_content", None) or ""
            assert (getattr(delta, "reasoning", None) or "") == reasoning
            out["reasoning"] += reasoning
            for c in delta.tool_calls or []:
                if c.index not in calls:
                    assert c.id and c.type == "function" and c.function.name, "a tool call opens with id, type, name"
                    calls[c.index] = [c.index, c.id, c.function.name, ""]
                else:
                    assert c.id is None and c.function.name is None
                assert isinstance(c.function.arguments, str)
                calls[c.index][3] += c.function.arguments
            out["finish"] = choice.finish_reason or out["finish"]
    out["tool_calls"] = [tuple(call) for _, call in sorted(calls.items())]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip(system: System, scripted: str, stream: bool) -> None:
    question = "What is the weather in Paris?"
    if stream:
        got = collect_stream(ask(system, question, stream=True, tools=[WEATHER_TOOL]))
        (index, call_id, name, arguments), = got["tool_calls"]
        assert got["finish"] == "tool_calls" and got["content"] == ""
    else:
        response = ask(system, question, tools=[WEATHER_TOOL])
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        call, = choice.message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}

    follow_up = client(system).chat.completions.create(
        model=SCRIPTED,
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "18 degrees"},
        ],
    )
    assert follow_up.choices[0].message.content == "It is 18 degrees in Paris."
    assert follow_up.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_content(system: System, scripted: str, stream: bool) -> None:
    if stream:
        got = collect_stream(ask(system, "Please think it over.", stream=True))
        content, reasoning, finish = got["content"], got["reasoning"], got["finish"]
    else:
        response = ask(system, "Please think it over.")
        message = response.choices[0].message
        content, reasoning, finish = message.content, message.reasoning_content, response.choices[0].finish_reason
        assert message.reasoning == reasoning
        assert response.usage.completion_tokens_details.reasoning_tokens > 0
    assert reasoning == "\nTwo plus two is four.\n"
    assert content == "The answer is 4."
    assert finish == "stop"


def test_cut_off_mid_thought_is_all_reasoning(system: System, scripted: str) -> None:
    response = ask(system, "A long thought, please.", max_tokens=6)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "length"
    assert message.reasoning_content and not message.content
    assert "<think>" not in message.reasoning_content


def test_malformed_tool_json_stays_content(system: System, scripted: str) -> None:
    response = ask(system, "Send a broken tool call.", tools=[WEATHER_TOOL])
    assert response.choices[0].message.content == "<tool_call>{oops}</tool_call>"
    assert response.choices[0].finish_reason == "stop"
    assert not response.choices[0].message.tool_calls


def test_logprobs_are_log_probabilities(system: System) -> None:
    response = client(system).chat.completions.create(
        model=system.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=8, logprobs=True, top_logprobs=3,
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and math.isclose(entry.logprob, tops[0], abs_tol=1e-5)
        assert sum(math.exp(lp) for lp in tops) <= 1.0 + 1e-5
    assert "".join(e.token for e in entries).startswith(response.choices[0].message.content[:10])


def test_top_logprobs_without_logprobs_is_400(system: System) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client(system).chat.completions.create(
            model=system.model, messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    assert caught.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(system: System, scripted: str,
                                                                    stream: bool) -> None:
    """The script writes two calls and some text; `parallel_tool_calls: false` keeps the first call
    alone and stops generating there (fewer tokens than the whole reply)."""
    question = "What is the weather in Rome and Oslo?"
    whole = ask(system, question, tools=[WEATHER_TOOL])
    assert [json.loads(c.function.arguments)["city"] for c in whole.choices[0].message.tool_calls] == ["Rome", "Oslo"]
    if stream:
        got = collect_stream(ask(system, question, stream=True, tools=[WEATHER_TOOL], parallel_tool_calls=False,
                                 stream_options={"include_usage": True}))
        calls = [json.loads(arguments)["city"] for _, _, _, arguments in got["tool_calls"]]
        content, finish = got["content"], got["finish"]
    else:
        single = ask(system, question, tools=[WEATHER_TOOL], parallel_tool_calls=False)
        choice = single.choices[0]
        calls = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
        assert single.usage.completion_tokens < whole.usage.completion_tokens
    assert (calls, content or "", finish) == (["Rome"], "", "tool_calls")


def test_disable_parallel_tool_use_ends_a_message_at_its_first_tool_use(system: System, scripted: str) -> None:
    """Anthropic's form of the same: `tool_choice.disable_parallel_tool_use`."""
    messages_client = anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    kw = {"model": SCRIPTED, "max_tokens": 200, "tools": [tool],
          "messages": [{"role": "user", "content": "What is the weather in Rome and Oslo?"}]}
    both = messages_client.messages.create(**kw)
    one = messages_client.messages.create(**kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in both.content if b.type == "tool_use"] == ["Rome", "Oslo"]
    assert [(b.type, b.input["city"]) for b in one.content] == [("tool_use", "Rome")]
    assert one.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice, city", [
    ("auto", None),
    ("required", "Nice"),
    ({"type": "function", "function": {"name": "get_weather"}}, "Lyon"),
], ids=["auto", "required", "named"])
def test_tool_choice_forces_a_call(system: System, scripted: str, stream: bool, choice: object,
                                   city: str | None) -> None:
    """The script answers "ok" unless the prompt ends in the forced start of a call."""
    if stream:
        got = collect_stream(ask(system, "Use a tool now.", stream=True, tools=[WEATHER_TOOL], tool_choice=choice))
        calls = [(name, json.loads(arguments)) for _, _, name, arguments in got["tool_calls"]]
        content, finish = got["content"], got["finish"]
    else:
        choice_out = ask(system, "Use a tool now.", tools=[WEATHER_TOOL], tool_choice=choice).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice_out.message.tool_calls or []]
        content, finish = choice_out.message.content, choice_out.finish_reason
    if city is None:
        assert (calls, content, finish) == ([], "ok", "stop")
    else:
        assert calls == [("get_weather", {"city": city})]
        assert not content and finish == "tool_calls"


def test_continue_final_message_extends_the_assistant_turn(system: System, scripted: str) -> None:
    response = client(system).chat.completions.create(
        model=SCRIPTED, extra_body={"continue_final_message": True},
        messages=[{"role": "user", "content": "Name the capital of France."},
                  {"role": "assistant", "content": "The capital is"}])
    assert response.choices[0].message.content == " Paris."


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
], ids=["required-without-tools", "unknown-function", "continue-a-user-turn"])
def test_impossible_tool_choice_or_continuation_is_400(system: System, scripted: str, kw: dict, param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        ask(system, "Use a tool now.", **kw)
    assert caught.value.body["param"] == param


def test_extra_template_variables_reach_the_worker(system: System, scripted: str) -> None:
    """Clients send Qwen3's switch as vLLM's `chat_template_kwargs` or as `reasoning_effort`; a
    template that reads neither renders as before."""
    reply = ask(system, "hello", reasoning_effort="none",
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("ok", "stop")
