"""The Responses API at the gateway, without a bus: input items into the chat conversation a worker
renders, and deltas into output items and the event stream (checked against the openai SDK's
types in strict mode)."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason, ServingError
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.responses import _has_nul, parse_items, response_template, to_bus_request
from apps.gateway.api.responses_output import ResponsesFormatter
from apps.gateway.api.validate import decode_body

EVENTS = TypeAdapter(ResponseStreamEvent)


def request(**fields: object) -> rs.ResponsesRequest:
    return decode_body(json.dumps({"model": "m", "input": "hi", **fields}).encode(), rs.ResponsesRequest)


def bus(req: rs.ResponsesRequest, history: list[dict] | None = None) -> wire.GenerateRequest:
    return to_bus_request(req, "resp_1", None, parse_items(history or [], "previous_response_id"),
                          parse_items(req.input, "input"))[0]


def test_items_become_the_chat_conversation() -> None:
    req = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Policy."},
        {"role": "user",
         "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ])
    messages = bus(req).messages
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."), ("system", "Policy."), ("user", "Weather now?"), ("assistant", "Checking."),
        ("tool", "18"), ("tool", "noon")]
    assert [c["function"] for c in messages[3].tool_calls] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    assert (messages[4].tool_call_id, messages[4].name, messages[5].name) == ("c1", "get_weather", "get_time")


def test_history_comes_before_the_new_input_and_instructions_are_not_carried_over() -> None:
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
               {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "one", "annotations": []}]}]
    messages = bus(request(input="second", instructions="Now this."), history).messages
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Now this."), ("user", "first"), ("assistant", "one"), ("user", "second")]


def test_tools_and_sampling_are_translated() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    out = bus(request(tools=[tool], tool_choice={"type": "function", "name": "f"}, max_output_tokens=7,
                      temperature=0.5, top_p=0.9, top_logprobs=3))
    assert out.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                           "strict": True}}]
    assert (out.tool_required, out.tool_name) == (True, "f")
    assert (out.sampling.max_tokens, out.sampling.temperature, out.sampling.top_p, out.sampling.logprobs) == (
        7, 0.5, 0.9, 3)
    assert bus(request(tools=[tool], tool_choice="none")).tools is None
    assert (out.single_tool_call, bus(request(tools=[tool], parallel_tool_calls=False)).single_tool_call) == (
        False, True)


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "system", "content": "only a system prompt"}]}, "input"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
], ids=["arguments-not-an-object", "file", "nothing-to-answer", "unknown-function", "conversation",
        "prompt"])
def test_what_cannot_be_honoured_is_refused(fields: dict, param: str) -> None:
    with pytest.raises(ServingError) as caught:
        bus(request(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)


NAMESPACE = {"type": "namespace", "name": "files", "description": "File tools.", "tools": [
    {"type": "function", "name": "read", "parameters": {"type": "object"}, "strict": False},
    {"type": "function", "name": "list", "description": "List a folder."}]}


def test_namespace_functions_are_offered_qualified_and_hosted_tools_left_out() -> None:
    req = request(tools=[{"type": "function", "name": "shell", "strict": True}, NAMESPACE,
                         {"type": "web_search", "external_web_access": False}],
                  tool_choice={"type": "function", "name": "read", "namespace": "files"})
    out, offered = to_bus_request(req, "resp_1", None, [], parse_items(req.input, "input"))
    assert [t["function"]["name"] for t in out.tools or []] == ["shell", "files.read", "files.list"]
    assert (out.tool_required, out.tool_name) == (True, "files.read")
    assert offered.namespaces == {"files.read": ("files", "read"), "files.list": ("files", "list")}
    assert offered.warning() is not None and "web_search" in offered.warning()


def test_a_namespaced_call_sent_back_is_qualified_for_the_template() -> None:
    messages = bus(request(input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "files", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "contents"}])).messages
    assert messages[1].tool_calls[0]["function"]["name"] == "files.read" and messages[2].name == "files.read"


@pytest.mark.parametrize("choice", [{"type": "web_search"}, {"type": "file_search"}, {"type": "mcp"}])
def test_forcing_a_hosted_tool_is_refused_by_name(choice: dict) -> None:
    with pytest.raises(ServingError) as caught:
        bus(request(tools=[{"type": choice["type"]}], tool_choice=choice))
    assert (caught.value.status, caught.value.param) == (400, "tool_choice") and choice["type"] in caught.value.message


@pytest.mark.parametrize("tools", [
    [{"type": "web_serch"}],
    [{**NAMESPACE, "name": f"n{i}", "tools": [{"type": "function", "name": f"f{j}"} for j in range(100)]}
     for i in range(2)],
    [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}],
], ids=["unknown-type", "too-many-functions", "same-name"])
def test_tools_past_what_can_be_offered_are_refused(tools: list) -> None:
    with pytest.raises(ServingError) as caught:
        bus(request(tools=tools))
    assert (caught.value.status, caught.value.param) == (400, "tools")


def test_a_namespaced_call_comes_back_with_its_namespace() -> None:
    template = response_template(request(tools=[NAMESPACE, {"type": "web_search"}]), "resp_3")
    formatter = ResponsesFormatter(template, False, namespaces={"files.read": ("files", "read")})
    chunks = formatter.stream_start(wire.Accepted(seq=0, node="n", prompt_tokens=10))
    chunks += formatter.stream_delta(delta(calls=[wire.ToolCallDelta(index=0, id="call_1", name="files.read",
                                                                     arguments="{}")]))
    chunks += formatter.stream_final(FINAL)
    final = parse_stream(chunks)[-1].response
    call = final.output[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "read", "files")


def delta(text: str = "", reasoning: str = "", calls: list[wire.ToolCallDelta] | None = None,
          finish: FinishReason | None = None) -> wire.Delta:
    return wire.Delta(seq=1, text=text, reasoning=reasoning, tool_calls=calls or [], num_tokens=1,
                      finish_reason=finish)


FINAL = wire.Final(seq=9, finish_reason=FinishReason.TOOL_CALLS,
                   usage=wire.Usage(prompt_tokens=10, completion_tokens=6, reasoning_tokens=2))
DELTAS = [delta(reasoning="Let me "), delta(reasoning="see."), delta(text="Calling"), delta(text=" now."),
          delta(calls=[wire.ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a": 1}')],
                finish=FinishReason.TOOL_CALLS)]


def parse_stream(chunks: list[bytes]) -> list[object]:
    events = []
    for chunk in chunks:
        for block in chunk.decode().strip().split("\n\n"):
            name, data = block.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == f"event: {payload['type']}"
            events.append(EVENTS.validate_python(payload, strict=True))
    return events


def test_the_event_stream_is_in_order_and_agrees_with_the_whole_answer() -> None:
    kept: list[rs.ResponseObject] = []
    template = response_template(request(), "resp_1")
    formatter = ResponsesFormatter(template, with_logprobs=False, on_complete=kept.append)
    chunks = formatter.stream_start(wire.Accepted(seq=0, node="n", prompt_tokens=10))
    for d in DELTAS:
        chunks += formatter.stream_delta(d)
    chunks += formatter.stream_final(FINAL)
    events = parse_stream(chunks)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1, 2] and all(e.item.status == "in_progress" for e in added)
    assert added[1].item.content == [] and added[2].item.arguments == ""
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Calling now." and final.usage.output_tokens_details.reasoning_tokens == 2

    whole = ResponsesFormatter(template, with_logprobs=False).whole(DELTAS, FINAL)
    body = msgspec.to_builtins(whole)
    Response.model_validate(body, strict=True)
    ids = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert ids(body["output"]) == ids(final.model_dump(mode="json", exclude_unset=True)["output"])
    assert msgspec.to_builtins(kept[0])["output"] == final.model_dump(mode="json", exclude_unset=True)["output"]


def test_a_cut_short_answer_is_incomplete() -> None:
    final = wire.Final(seq=3, finish_reason=FinishReason.LENGTH, usage=wire.Usage(prompt_tokens=3, completion_tokens=2))
    whole = ResponsesFormatter(response_template(request(), "resp_2"), False).whole(
        [delta(text="Par"), delta(text="is", finish=FinishReason.LENGTH)], final)
    body = msgspec.to_builtins(whole)
    Response.model_validate(body, strict=True)
    assert (body["status"], body["incomplete_details"], body["output"][0]["status"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "incomplete")


def test_the_done_event_carries_every_deltas_logprobs_and_the_output_has_them_with_bytes() -> None:
    def token(text: str) -> wire.TokenLogprobs:
        return wire.TokenLogprobs(token=text, logprob=-0.5, bytes=list(text.encode()), top=[(text, -0.5, [1])])

    formatter = ResponsesFormatter(response_template(request(), "resp_4"), with_logprobs=True)
    chunks = formatter.stream_start(wire.Accepted(seq=0, node="n", prompt_tokens=3))
    for text in ("Par", "is"):
        chunks += formatter.stream_delta(msgspec.structs.replace(delta(text=text), logprobs=[token(text)]))
    chunks += formatter.stream_final(wire.Final(seq=9, finish_reason=FinishReason.STOP,
                                                usage=wire.Usage(prompt_tokens=3, completion_tokens=2)))
    events = parse_stream(chunks)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == [lp.token for lp in done.logprobs] == ["Par", "is"]
    output = events[-1].response.output[0].content[0]
    assert [(lp.token, lp.bytes) for lp in output.logprobs] == [("Par", list(b"Par")), ("is", list(b"is"))]


def test_a_failed_stream_shows_the_text_it_had_so_far() -> None:
    formatter = ResponsesFormatter(response_template(request(), "resp_3"), False)
    chunks = formatter.stream_start(wire.Accepted(seq=0, node="n", prompt_tokens=3))
    for d in [delta(text="Par"), delta(text="is is")]:
        chunks += formatter.stream_delta(d)
    chunks.append(formatter.stream_error(ServingError(503, ErrorCode.WORKER_LOST, "The worker stopped.")))
    failed = parse_stream(chunks)[-1]
    assert failed.type == "response.failed" and failed.response.output[0].content[0].text == "Paris is"


@pytest.mark.parametrize(("value", "nul"), [
    ("a\x00b", True), ({"k\x00": 1}, True), ([{"x": ["y", "z\x00"]}], True), ("a\\\x00", True),
    # Text that reads like an escaped NUL is none: a backslash, then "u0000".
    ("a\\u0000", False), (["\\\\u0000"], False), ({"plain": [1, None, "x"]}, False), (None, False)])
def test_a_nul_is_found_in_any_string_and_only_there(value: object, nul: bool) -> None:
    assert _has_nul(value) is nul
