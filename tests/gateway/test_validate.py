"""The input contract's own checks: nesting depth, stop-string bytes, token ids against the
vocabulary, the answer's length against the advertised output limit, and unknown model names that
do not reach JetStream again and again."""

from __future__ import annotations

import asyncio
import json
import random
import typing

import pytest
from openai.types.shared.reasoning_effort import ReasoningEffort

from apps.bus import wire
from apps.bus.codes import Api, ErrorCode, ServingError
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.gateway.api import chat, validate
from apps.gateway.api import openai_schema as oa
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.validate import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_WHOLE_LOGPROB_ENTRIES,
    PROMPT_CHARS_PER_TOKEN,
    bound_output,
    bound_whole_logprobs,
    check_prompt_size,
    check_stop_strings,
    check_token_ids,
    decode_body,
    json_too_deep,
)
from apps.gateway.bus_client import GatewayBus
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
from engine.frontend.protocol import SamplingParams


@pytest.mark.parametrize("text, deep", [
    ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, False),
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), True),
    ('{"a": "' + "[" * 500 + '"}', False),  # brackets inside a string do not nest
    ('{"a": "\\"' + "{" * 500 + '"}', False),  # nor after an escaped quote
    ('[' * 30 + '{"a": ' * 35 + "1" + "}" * 35 + "]" * 30, True),
    ("[" + "[]," * 10_000 + "[]]", False),  # many brackets, shallow
    ('["\\\\", ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "]", True),  # an escaped backslash ends its string
    ('["\\\\\\"' + "[" * 500 + '"]', False),  # three backslashes: the quote is escaped
], ids=["at-the-bound", "past-the-bound", "in-a-string", "after-an-escape", "mixed", "wide",
        "after-an-escaped-backslash", "after-an-odd-run"])
def test_nesting_depth(text: str, deep: bool) -> None:
    assert json.loads(text) is not None  # each case is valid JSON
    assert json_too_deep(text) is deep
    assert json_too_deep(text.encode()) is deep


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@pytest.mark.parametrize("slice_bytes", [1 << 20, 7, 2, 1])
def test_nesting_depth_agrees_with_a_decoder_on_random_documents(slice_bytes: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings holding brackets, quotes and runs of backslashes, keys among them: the depth the
    check sees is the decoded document's, at every limit around it, however the text is sliced
    (a string, an escape or a run of backslashes across a slice's end)."""
    monkeypatch.setattr(validate, "_SHAPE_SLICE_BYTES", slice_bytes)
    rng = random.Random(7)
    strings = ["[", "]{", '"', "\\", '\\"[', "\\\\", "x"]

    def document(level: int) -> object:
        if level > 8 or rng.random() < 0.25:
            return rng.choice([*(rng.choice(strings) * rng.randint(1, 3) for _ in range(2)), 1, None])
        if rng.random() < 0.5:
            return [document(level + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(strings) + str(i): document(level + 1) for i in range(rng.randint(0, 3))}

    for _ in range(500):
        text = json.dumps(document(0))
        depth = _depth(json.loads(text))
        for limit in (max(depth - 1, 0), depth, depth + 1):
            assert json_too_deep(text, limit) is (depth > limit), (text, limit)
        assert validate._json_shape(text, 0) == (depth, _containers(json.loads(text))), text


def _containers(value: object) -> int:
    if isinstance(value, list):
        return 1 + sum(map(_containers, value))
    if isinstance(value, dict):
        return 1 + sum(map(_containers, value.values()))
    return 0


def test_a_body_of_too_many_arrays_and_objects_is_refused_before_it_is_decoded() -> None:
    """A tool's `parameters` is untyped: decoding builds whatever it holds, in one call on the
    loop. Past MAX_JSON_CONTAINERS arrays and objects the body is a 400; brackets in strings
    (a prompt of code) do not count."""
    def body(parameters: object, content: str = "hi") -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": parameters}}]}).encode()

    at_the_bound = {"type": "object", "x": [{} for _ in range(MAX_JSON_CONTAINERS - 8)]}  # and the body's own 8
    assert decode_body(body(at_the_bound), oa.ChatCompletionRequest).tools is not None
    with pytest.raises(ServingError) as refused:
        decode_body(body({"type": "object", "x": [[] for _ in range(MAX_JSON_CONTAINERS)]}), oa.ChatCompletionRequest)
    assert refused.value.status == 400 and f"at most {MAX_JSON_CONTAINERS}" in refused.value.message
    code = "{[()]}" * MAX_JSON_CONTAINERS  # brackets in a string
    assert decode_body(body({"type": "object"}, code), oa.ChatCompletionRequest).messages[0].content == code


def test_tool_call_arguments_share_one_budget_of_arrays_and_objects() -> None:
    """Each call's `arguments` is JSON in a string, parsed for the template: calls of tens of
    thousands of arrays each are within the body's bounds, but not past the budget together."""
    arguments = json.dumps([[] for _ in range(32_767)])

    def conversation(calls: int) -> oa.ChatCompletionRequest:
        messages = [{"role": "user", "content": "hi"}]
        for i in range(calls):
            messages += [{"role": "assistant", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"}]
        return decode_body(json.dumps({"model": "m", "messages": messages}).encode(), oa.ChatCompletionRequest)

    fits = MAX_JSON_CONTAINERS // 32_768
    assert len(chat.to_bus_request(conversation(fits), "r").messages) == 1 + 2 * fits
    with pytest.raises(ServingError) as refused:
        chat.to_bus_request(conversation(fits + 1), "r")
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert "arguments together" in refused.value.message


def test_stop_strings_are_bounded_in_bytes() -> None:
    assert check_stop_strings(["x" * 256, "é" * 128], "stop") == ["x" * 256, "é" * 128]
    with pytest.raises(ServingError) as refused:
        check_stop_strings(["é" * 129], "stop_sequences")
    assert (refused.value.status, refused.value.param) == (400, "stop_sequences")


def _node(vocab_size: int) -> wire.NodeStatus:
    return wire.NodeStatus(node="n", version="v", models=[wire.ModelStatus(model="m", vocab_size=vocab_size)])


def test_token_ids_must_be_inside_the_vocabulary() -> None:
    def request(**fields: object) -> wire.GenerateRequest:
        return wire.GenerateRequest(request_id="r", model="m", reply_subject="", **fields)  # type: ignore[arg-type]

    check_token_ids(request(sampling=SamplingParams(stop_token_ids=[99]), prompt_token_ids=[0, 99]), [_node(100)])
    for bad, param in ((request(sampling=SamplingParams(stop_token_ids=[100])), "stop_token_ids"),
                       (request(sampling=SamplingParams(), prompt_token_ids=[5, 100]), "prompt")):
        with pytest.raises(ServingError) as refused:
            check_token_ids(bad, [_node(100)])
        assert refused.value.param == param
    # Unknown vocabulary (0): only the count bounds apply.
    check_token_ids(request(sampling=SamplingParams(stop_token_ids=[10**6])), [_node(0)])


def _limits(node: str, output: int | None, context: int | None = None) -> wire.NodeStatus:
    return wire.NodeStatus(node=node, version="v", models=[
        wire.ModelStatus(model="m", max_model_len=context, max_output_tokens=output),
        wire.ModelStatus(model="other", max_model_len=64, max_output_tokens=16)])


def _asking(max_tokens: int | None) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="",
                                sampling=SamplingParams(max_tokens=max_tokens, min_tokens=2))


def test_a_missing_length_is_the_smallest_advertised_output_limit() -> None:
    nodes = [_limits("a", 256, 1024), _limits("b", 300, 1200), _limits("c", None)]
    bounded = bound_output(_asking(None), nodes)
    assert (bounded.sampling.max_tokens, bounded.sampling.min_tokens) == (256, 2)
    assert bound_output(_asking(256), nodes).sampling.max_tokens == 256
    assert bound_output(_asking(5), nodes).sampling.max_tokens == 5


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_a_length_past_the_output_limit_is_refused_naming_the_parameter(param: str) -> None:
    with pytest.raises(ServingError) as refused:
        bound_output(_asking(257), [_limits("a", 256, 1024), _limits("b", 300, 1200)], param)
    error = refused.value
    assert (error.status, error.code, error.param) == (400, ErrorCode.CONTEXT_LENGTH_EXCEEDED, param)
    assert "maximum context length is 1024 tokens" in error.message
    assert "at most 256" in error.message and f"257 completion tokens ('{param}')" in error.message


def test_without_an_advertised_limit_the_request_goes_as_it_is() -> None:
    for asked in (None, 10**6):
        request = _asking(asked)
        assert bound_output(request, [_limits("a", None)]) is request
        assert bound_output(request, []) is request


async def test_unknown_model_names_are_looked_up_once_per_ttl(own_nats: NatsServer) -> None:
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), GatewayMetrics())
    registry = NodeRegistry(bus, BusLimits())
    try:
        async def api_calls() -> int:
            return (await bus.js.account_info()).api.total

        before = await api_calls()
        # A flood, concurrent and then one after another, of one made-up name.
        assert not any(await asyncio.gather(*(registry.model_is_known("made-up") for _ in range(50))))
        for _ in range(50):
            assert not await registry.model_is_known("made-up")
        # One lookup for the name, plus the account_info call that measured it.
        assert await api_calls() - before == 2
    finally:
        await bus.close()


def _prompted(api: Api, text: str = "", ids: list[int] | None = None,
              tools: list | None = None) -> wire.GenerateRequest:
    messages = [wire.ChatMessage(role="user", content=text)] if api != Api.COMPLETIONS else None
    prompt = text if api == Api.COMPLETIONS and ids is None else None
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="", sampling=SamplingParams(), api=api,
                                messages=messages, prompt=prompt, prompt_token_ids=ids, tools=tools)


@pytest.mark.parametrize(("api", "param"), [(Api.CHAT_COMPLETIONS, "messages"), (Api.COMPLETIONS, "prompt"),
                                            (Api.MESSAGES, "messages"), (Api.RESPONSES, "input")])
def test_a_prompt_longer_than_the_context_allows_is_refused_before_tokenizing(api: Api, param: str) -> None:
    nodes = [_limits("a", 256, context=1024)]
    limit = 1024 * PROMPT_CHARS_PER_TOKEN
    # A message's role and markers count too (`text_chars`): what its content may hold is the rest.
    room = limit - (_prompted(api, "").text_chars())
    check_prompt_size(_prompted(api, "x" * room), nodes)
    with pytest.raises(ServingError) as caught:
        check_prompt_size(_prompted(api, "x" * (room + 1)), nodes)
    assert (caught.value.param, caught.value.code) == (param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    # Nothing advertised: the worker decides.
    check_prompt_size(_prompted(api, "x" * (limit + 1)), [])


def test_tools_count_toward_the_prompt_and_token_ids_against_the_context() -> None:
    nodes = [_limits("a", 256, context=1024)]
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * (1024 * PROMPT_CHARS_PER_TOKEN)}}]
    with pytest.raises(ServingError):
        check_prompt_size(_prompted(Api.CHAT_COMPLETIONS, "hi", tools=tools), nodes)
    check_prompt_size(_prompted(Api.COMPLETIONS, ids=[1] * 1024), nodes)
    with pytest.raises(ServingError) as caught:
        check_prompt_size(_prompted(Api.COMPLETIONS, ids=[1] * 1025), nodes)
    assert caught.value.param == "prompt"


def test_a_whole_answers_logprobs_are_bounded_and_a_chat_stream_is_not() -> None:
    def asking(n: int, max_tokens: int, top: int, api: Api = Api.CHAT_COMPLETIONS,
               stream: bool = False) -> wire.GenerateRequest:
        return wire.GenerateRequest(request_id="r", model="m", reply_subject="", api=api, stream=stream, prompt="hi",
                                    sampling=SamplingParams(n=n, max_tokens=max_tokens, logprobs=top))

    at_bound = MAX_WHOLE_LOGPROB_ENTRIES // (4 * 8)  # tokens, for n=4 and 7 alternatives
    assert bound_whole_logprobs(asking(4, at_bound, 7), False).sampling.max_tokens == at_bound
    for api, param in [(Api.CHAT_COMPLETIONS, "top_logprobs"), (Api.COMPLETIONS, "logprobs")]:
        with pytest.raises(ServingError) as caught:
            bound_whole_logprobs(asking(4, at_bound + 1, 7, api=api), False)
        assert (caught.value.status, caught.value.param) == (400, param)
    # A length the client left out (the advertised limit filled in) is shortened to fit instead.
    assert bound_whole_logprobs(asking(4, at_bound + 1, 7), True).sampling.max_tokens == at_bound
    # A chat stream goes a frame at a time; a Responses stream ends with every logprob again.
    assert bound_whole_logprobs(asking(4, at_bound + 1, 7, stream=True), False).sampling.max_tokens == at_bound + 1
    with pytest.raises(ServingError):
        bound_whole_logprobs(asking(1, MAX_WHOLE_LOGPROB_ENTRIES // 8 + 1, 7, api=Api.RESPONSES, stream=True), False)
    no_logprobs = wire.GenerateRequest(request_id="r", model="m", reply_subject="", prompt="hi",
                                       sampling=SamplingParams(n=16, max_tokens=100_000))
    assert bound_whole_logprobs(no_logprobs, False) is no_logprobs


@pytest.mark.parametrize("kind, body, field, default", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": None, "logprobs": None}, "stream", False),
    ("completions", {"prompt": "hi", "echo": None}, "echo", False),
    ("responses", {"input": "hi", "store": None, "parallel_tool_calls": None, "stream": None}, "store", True),
])
def test_a_null_boolean_flag_means_its_default_as_the_sdks_send_it(kind: str, body: dict, field: str,
                                                                   default: bool) -> None:
    request_type = {"chat": oa.ChatCompletionRequest, "completions": oa.CompletionRequest,
                    "responses": rs.ResponsesRequest}[kind]
    decoded = decode_body(json.dumps({"model": "m", **body}).encode(), request_type)
    assert getattr(decoded, field) is default
    # A null where no null means anything is still refused by name.
    with pytest.raises(ServingError) as refused:
        decode_body(json.dumps({**body, "model": None}).encode(), request_type)
    assert refused.value.param == "model"


def test_reasoning_effort_takes_every_value_the_sdk_has() -> None:
    for effort in typing.get_args(typing.get_args(ReasoningEffort)[0]):
        decoded = decode_body(json.dumps({"model": "m", "input": "hi", "reasoning": {"effort": effort}}).encode(),
                              rs.ResponsesRequest)
        assert decoded.reasoning is not None and decoded.reasoning.effort == effort
