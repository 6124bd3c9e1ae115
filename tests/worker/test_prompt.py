"""From a bus request to prompt text: assistant prefill and forced tool calls, with the default
model's real tokenizer and chat template."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.worker.prompt import build_prompt, check_sampling_ids
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from engine.loading.default_model import default_model_path

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())[0]


def request(*messages: tuple[str, str], **kw: object) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams(),
                                messages=[wire.ChatMessage(role=r, content=c) for r, c in messages], **kw)


def text_of(tokenizer: Tokenizer, req: wire.GenerateRequest) -> str:
    return tokenizer.decode(build_prompt(tokenizer, req).token_ids, skip_special_tokens=False)


def test_a_final_assistant_message_is_continued_not_closed(tokenizer: Tokenizer) -> None:
    ordinary = text_of(tokenizer, request(("user", "Capital of France?")))
    prefilled = text_of(tokenizer, request(("user", "Capital of France?"), ("assistant", "The capital is"),
                                           continue_final_message=True))
    assert prefilled.endswith("The capital is")
    # The same conversation up to the assistant header, then the prefill, with no new turn opened.
    assert prefilled == ordinary + "The capital is"


def test_an_empty_prefill_is_an_ordinary_new_turn(tokenizer: Tokenizer) -> None:
    ordinary = text_of(tokenizer, request(("user", "Hi")))
    assert text_of(tokenizer, request(("user", "Hi"), ("assistant", ""), continue_final_message=True)) == ordinary


def test_a_required_tool_call_starts_the_reply(tokenizer: Tokenizer) -> None:
    req = request(("user", "Weather in Paris?"), tools=[WEATHER], tool_required=True)
    prompt = build_prompt(tokenizer, req)
    assert tokenizer.decode(prompt.token_ids, skip_special_tokens=False).endswith("assistant\n<tool_call>\n")
    parser = prompt.output_parser()
    parsed = parser.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""


def test_a_named_tool_call_starts_with_its_name(tokenizer: Tokenizer) -> None:
    req = request(("user", "Weather in Paris?"), tools=[WEATHER], tool_required=True, tool_name="get_weather")
    prompt = build_prompt(tokenizer, req)
    assert tokenizer.decode(prompt.token_ids, skip_special_tokens=False).endswith(
        '<tool_call>\n{"name": "get_weather", "arguments": ')
    parser = prompt.output_parser()
    parsed = parser.feed('{"city": "Paris"}}')
    parsed.tool_calls += parser.finish().tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_forced_tool_call_closes_a_thought_the_template_opened(tokenizer: Tokenizer) -> None:
    thinking = Tokenizer(tokenizer.hf, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                       "{% endfor %}<|im_start|>assistant\n<think>\n")
    prompt = build_prompt(thinking, request(("user", "Weather?"), tools=[WEATHER], tool_required=True))
    assert thinking.decode(prompt.token_ids, skip_special_tokens=False).endswith(
        "assistant\n<think></think>\n\n<tool_call>\n")
    parsed = prompt.output_parser().feed('{"name": "get_weather", "arguments": {}}</tool_call>')
    assert parsed.reasoning == "" and [c.name for c in parsed.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("case", ["user-last", "tool-calls", "forced-tool"])
def test_what_cannot_be_continued_is_refused(tokenizer: Tokenizer, case: str) -> None:
    if case == "user-last":
        req = request(("user", "Hi"), continue_final_message=True)
    elif case == "tool-calls":
        req = request(("user", "Hi"), continue_final_message=True)
        req.messages.append(wire.ChatMessage(role="assistant", content="x", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]))
    else:
        req = request(("user", "Hi"), ("assistant", "Sure"), continue_final_message=True, tools=[WEATHER],
                      tool_required=True)
    with pytest.raises(ServingError) as caught:
        build_prompt(tokenizer, req)
    assert caught.value.status == 400


# Renders every text field a chat request carries, as Qwen-style templates do.
EVERY_FIELD = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}"
               "{% if m.name %} {{ m.name }}{% endif %}{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}\n"
               "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.id }} {{ c.function.name }} "
               "{{ c.function.arguments }}{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def _turns(name: str = "n", call_id: str = "c", function: str = "f", arguments: str = "{}",
           content: str = "hi", description: str = "d") -> wire.GenerateRequest:
    call = {"id": call_id, "type": "function", "function": {"name": function, "arguments": arguments}}
    tool = {"type": "function", "function": {"name": "f", "description": description}}
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams(),
                                tools=[tool], messages=[
                                    wire.ChatMessage(role="user", content=content, name=name),
                                    wire.ChatMessage(role="assistant", content="", tool_calls=[call]),
                                    wire.ChatMessage(role="tool", content="ok", tool_call_id=call_id)])


@pytest.mark.parametrize("field", ["name", "call_id", "function", "arguments", "content", "description"])
def test_text_chars_counts_every_field_the_template_renders(tokenizer: Tokenizer, field: str) -> None:
    """The prompt bound (gateway) and the inline-or-pool choice (worker) both read `text_chars`:
    text the template renders but the count misses would be tokenized unbounded, on the loop."""
    every = Tokenizer(tokenizer.hf, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      chat_template=EVERY_FIELD)
    small, large = _turns(), _turns(**{field: "x" * 5000})
    rendered = len(text_of(every, large)) - len(text_of(every, small))
    assert rendered > 4000  # the template renders the field (an id twice)
    assert large.text_chars() - small.text_chars() >= rendered


@pytest.mark.parametrize("param", ["stop_token_ids", "logit_bias"])
def test_token_ids_past_the_vocabulary_are_refused_by_the_worker_too(tokenizer: Tokenizer, param: str) -> None:
    """A bus client's request skips the gateway's vocabulary check; the worker names the parameter."""
    vocab = tokenizer.vocab_size
    past = {"stop_token_ids": [vocab], "logit_bias": {vocab: 1.0}}[param]
    within = {"stop_token_ids": [vocab - 1], "logit_bias": {vocab - 1: 1.0}}[param]
    def asking(ids: object) -> wire.GenerateRequest:
        return msgspec.structs.replace(request(("user", "hi")), sampling=SamplingParams(**{param: ids}))

    check_sampling_ids(asking(within), vocab)
    with pytest.raises(ServingError) as caught:
        check_sampling_ids(asking(past), vocab)
    assert caught.value.param == param


# Qwen3's switch, in a template of the default model's markers.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if limit is defined %}{{ 'x' * limit }}{% endif %}{% endif %}"
)


def test_extra_template_variables_reach_the_template_and_are_bounded(tokenizer: Tokenizer) -> None:
    thinking = copy.copy(tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    thinking.__dict__.pop("_template", None)
    plain = text_of(thinking, request(("user", "Hi")))
    switched_off = request(("user", "Hi"), template_kwargs={"enable_thinking": False})
    assert text_of(thinking, switched_off) == plain + "<think>\n\n</think>\n\n"
    assert not build_prompt(thinking, switched_off).opens_reasoning
    # A bus client's variables are held to the gateway's bounds; a value the template cannot use is a 400.
    for kwargs in ({"messages": []}, {"a b": 1}, {f"v{i}": 1 for i in range(17)}, {"limit": "many"}):
        with pytest.raises(ServingError) as refused:
            build_prompt(thinking, request(("user", "Hi"), template_kwargs=kwargs))
        assert refused.value.status == 400, kwargs
