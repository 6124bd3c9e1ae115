"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

A request's `instructions`, the conversation its `previous_response_id` continues (read back from
the ledger, `response_store`), and its own input (text, or items: messages, function calls and
their outputs, reasoning) become one chat conversation, published like any chat completion
through the generation pipeline; `responses_output` shapes the answer. With `store` (the
default, as at OpenAI) the finished response is kept for its principal.

A stored response is bounded before it runs: `metadata` as at OpenAI (16 pairs, keys of at most 64
characters, values of at most 512), ids and names in input items by the schema, a NUL anywhere in
what would be stored is a 400 (PostgreSQL cannot hold it), and the stored input and settings
together at most `StoreLimits.max_response_bytes` (413); a `previous_response_id` conversation is
bounded in responses and bytes (400), all before admission.

Tools are `responses_tools`' to read (functions, namespaces of functions; hosted tools are left
out with a warning). What cannot be honoured is refused by name: image and file inputs, item
references, background runs, conversation objects, prompt templates, `truncation: auto`.
A JSON `text.format` (json_object, json_schema) is enforced with the same grammar as chat's
`response_format` (`apps/gateway/api/structured.py`). Reasoning items sent back as input are not shown
to the model again; `reasoning.effort` is echoed, and `"none"` turns a thinking template's
reasoning off (`enable_thinking`); other levels are not enforced.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
from litestar import Request, delete, get, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import Api, ErrorCode, ServingError
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.openapi_docs import operation_for
from apps.gateway.api.responses_output import ResponsesFormatter
from apps.gateway.api.responses_tools import WARNING_HEADER, OfferedTools, forced, offered_tools, qualified
from apps.gateway.api.structured import check_enforceable, json_constraint
from apps.gateway.api.validate import JsonBudget, check_metadata, template_kwargs, thinking_for_effort
from apps.gateway.response_store import NewResponse, ResponseStore, new_response_id
from engine.frontend.protocol import SamplingParams, StructuredOutput

HANDLER = "responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _refuse(message: str, param: str | None) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def parse_items(raw: str | list[dict[str, Any]], param: str) -> list[rs.InputItem]:
    """Input as typed items; a plain string is one user message."""
    if isinstance(raw, str):
        return [rs.MessageItem(role="user", content=[rs.InputText(text=raw)])]
    items = []
    for index, item in enumerate(raw):
        try:
            items.append(msgspec.convert({"type": "message", **item}, rs.InputItem))
        except msgspec.ValidationError as exc:
            raise _refuse(f"Invalid input item {index} in '{param}': {exc}.", param) from None
    return items


def _text(content: str | list[rs.ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, rs.InputText | rs.OutputText):
            texts.append(part.text)
        elif isinstance(part, rs.Refusal):
            texts.append(part.refusal)
        else:
            raise _refuse(f"Content parts of type '{type(part).__struct_config__.tag}' are not supported.", param)
    return "".join(texts)


def _template_call(item: rs.FunctionCallItem, param: str, budget: JsonBudget) -> dict[str, Any]:
    """A function call as chat templates expect it: arguments as an object, not a JSON string."""
    try:
        arguments = budget.parse(item.arguments or "{}", param)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise _refuse("Function call arguments must be a JSON object.", param)
    name = qualified(item.namespace, item.name)
    return {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_messages(items: list[rs.InputItem], instructions: str | None, param: str = "input",
                  history: int = 0) -> list[wire.ChatMessage]:
    """The conversation as the chat messages a template renders: system and developer messages
    as `system`, function calls joined to the assistant turn they belong to, outputs as `tool`."""
    out: list[wire.ChatMessage] = [wire.ChatMessage(role="system", content=instructions)] if instructions else []
    names: dict[str, str] = {}
    arguments = JsonBudget()
    for index, item in enumerate(items):
        if isinstance(item, rs.MessageItem):
            role = "system" if item.role in ("system", "developer") else item.role
            out.append(wire.ChatMessage(role=role, content=_text(item.content, param)))
        elif isinstance(item, rs.FunctionCallItem):
            names[item.call_id] = qualified(item.namespace, item.name)
            # The first `history` items are the conversation's before this request's own.
            call = _template_call(item, param if index >= history else "previous_response_id", arguments)
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1].tool_calls.append(call)  # a list made here: one call at a time, not copied each time
            elif out and out[-1].role == "assistant":
                out[-1] = msgspec.structs.replace(out[-1], tool_calls=[call])
            else:
                out.append(wire.ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, rs.FunctionCallOutputItem):
            out.append(wire.ChatMessage(role="tool", content=_text(item.output, param), tool_call_id=item.call_id,
                                        name=names.get(item.call_id)))
        elif isinstance(item, rs.ItemReference):
            raise _refuse("Input items of type 'item_reference' are not supported; send the item itself.", param)
        # Reasoning items: earlier reasoning is not shown to the model again.
    return out


def _tools(req: rs.ResponsesRequest) -> tuple[OfferedTools, bool, str | None]:
    """(what the model is offered, a call is required, the function it must call)."""
    offered = offered_tools(req.tools or [])
    required, name = forced(req.tool_choice, offered, bool(req.tools))
    if req.tool_choice == "none":
        offered.functions = []
    return offered, required, name


def _check_supported(req: rs.ResponsesRequest) -> None:
    if req.background:
        raise _refuse("Background responses are not supported.", "background")
    if req.conversation is not None:
        raise _refuse("Conversation objects are not supported; use 'previous_response_id'.", "conversation")
    if req.prompt is not None:
        raise _refuse("Stored prompt templates are not supported.", "prompt")
    if req.truncation == "auto":
        raise _refuse("'truncation: auto' is not supported; an input past the context is a 400.", "truncation")


# A NUL as JSON encodes it: the escape \u0000 after an even number of backslashes (a backslash
# escaped as \\ followed by the text "u0000" is not one).
_ENCODED_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _has_nul(value: Any) -> bool:
    """Whether a NUL is in any string (key or value) of decoded JSON: one search of its encoding
    (in C, so a body of millions of small values costs what its bytes cost)."""
    return _ENCODED_NUL.search(msgspec.json.encode(value)) is not None


def check_storable(req: rs.ResponsesRequest, store: ResponseStore, items: list[dict[str, Any]],
                   template: dict[str, Any]) -> None:
    """What a `store` request would keep: metadata within OpenAI's bounds, within the store's byte
    cap (413), and no NUL; checked before the request is accepted, the size first."""
    check_metadata(req.metadata)
    store.check_storable(items, template)
    stored = {"input": items, "instructions": req.instructions, "metadata": req.metadata, "user": req.user,
              "tools": template.get("tools"), "text": template.get("text")}
    for param, value in stored.items():
        if _has_nul(value):
            raise _refuse(f"'{param}' holds a NUL character, which a stored response cannot hold "
                          "(or send 'store': false).", param)


def wants_logprobs(req: rs.ResponsesRequest) -> bool:
    return req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])


def text_constraint(req: rs.ResponsesRequest) -> StructuredOutput | None:
    """`text.format` json_object / json_schema as the one structured-output constraint."""
    text_format = req.text.format if req.text else None
    if text_format is None or text_format.type == "text":
        return None
    return json_constraint(text_format.schema if text_format.type == "json_schema" else None, "text.format")


def sampling_params(req: rs.ResponsesRequest) -> SamplingParams:
    given: dict[str, Any] = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
             "logprobs": (req.top_logprobs or 0) if wants_logprobs(req) else None,
             "structured": text_constraint(req)}
    return SamplingParams(**{name: value for name, value in given.items() if value is not None})


def to_bus_request(req: rs.ResponsesRequest, response_id: str, principal: str | None,
                   history: list[rs.InputItem], items: list[rs.InputItem]) -> tuple[wire.GenerateRequest, OfferedTools]:
    """The bus request for a response: `history` (the turns it continues) then its own `items`;
    with the tools offered (to name calls back and to warn of those left out)."""
    _check_supported(req)
    messages = chat_messages(history + items, req.instructions, history=len(history))
    if not any(m.role != "system" for m in messages):
        raise _refuse("'input' holds no message to answer.", "input")
    offered, tool_required, tool_name = _tools(req)
    return wire.GenerateRequest(
        request_id=response_id, model=req.model, reply_subject="", messages=messages,
        tools=offered.functions or None, tool_required=tool_required, tool_name=tool_name,
        single_tool_call=not req.parallel_tool_calls, sampling=sampling_params(req), stream=req.stream,
        principal=principal, api=Api.RESPONSES,
        template_kwargs=template_kwargs(None, "reasoning",
                                        thinking_for_effort(req.reasoning.effort if req.reasoning else None)),
        priority=req.priority,
    ), offered


def response_template(req: rs.ResponsesRequest, response_id: str) -> rs.ResponseObject:
    """The response before any output: the request's settings echoed, as OpenAI does."""
    choice = req.tool_choice or "auto"
    return rs.ResponseObject(
        id=response_id, created_at=int(time.time()), status="in_progress", model=req.model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
        reasoning=req.reasoning, store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_logprobs=req.top_logprobs,
        text=req.text or rs.TextConfig(format=rs.TextFormat()),
        tool_choice=choice if isinstance(choice, str) else msgspec.to_builtins(choice),
        tools=req.tools or [], user=req.user, metadata=req.metadata or {},
    )


@post("/v1/responses", status_code=200, operation_class=operation_for("responses"))
async def create_response(request: Request, state: State) -> Response | Stream:
    req = await state.bodies.read(request, rs.ResponsesRequest)
    store: ResponseStore = state.responses
    principal = request.state.principal
    response_id = new_response_id()
    items = parse_items(req.input, "input")
    stored_items = [msgspec.to_builtins(item) for item in items]
    template = response_template(req, response_id)
    if req.store:
        check_storable(req, store, stored_items, msgspec.to_builtins(template))
    history: list[rs.InputItem] = []
    if req.previous_response_id is not None:
        history = await store.conversation(req.previous_response_id, principal)
    bus_request, offered = to_bus_request(req, response_id, principal, history, items)
    await check_enforceable(bus_request, "text.format")

    def keep(response: rs.ResponseObject) -> None:
        store.keep(NewResponse(response_id, principal, req.previous_response_id, stored_items,
                               msgspec.to_builtins(response)), req.model)

    # A response that will not be stored (unstored, or its generation failed): a read of it here
    # is a 404 at once, not a wait for the ledger.
    formatter = ResponsesFormatter(template, wants_logprobs(req), on_complete=keep if req.store else None,
                                   namespaces=offered.namespaces,
                                   on_failed=(lambda: store.not_stored(response_id)) if req.store else None)
    if not req.store:
        store.not_stored(response_id)  # checked and about to run
    answer = await state.generations.serve(request, bus_request, formatter, HANDLER, output_param="max_output_tokens")
    if (warning := offered.warning()) is not None:
        answer.headers[WARNING_HEADER] = warning
    return answer


@get("/v1/responses/{response_id:str}")
async def retrieve_response(request: Request, state: State, response_id: str) -> Response:
    stored = await state.responses.get(response_id, request.state.principal)
    return Response(stored.response_json, media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request, state: State, response_id: str) -> rs.DeletedResponse:
    await state.responses.delete(response_id, request.state.principal)
    return rs.DeletedResponse(id=response_id)
