"""POST /v1/messages: the Anthropic Messages API, translated to and from the bus, streaming (SSE) and not.

Errors on this route, including those raised before the handler runs its own code (bad body,
unknown model, busy workers), are answered in Anthropic's envelope rather than OpenAI's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Response, Stream
from litestar.types import ExceptionHandlersMap

from apps.bus import wire
from apps.bus.codes import Api, ErrorCode, FinishReason, ServingError
from apps.gateway.api import anthropic_schema as an
from apps.gateway.api.openapi_docs import operation_for
from apps.gateway.api.structured import check_enforceable
from apps.gateway.api.validate import template_kwargs
from apps.gateway.errors import http_error_handler, internal_error_handler, serving_error_handler

HANDLER = "messages"
_encode = msgspec.json.encode


def _refuse(message: str, param: str | None = None) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def _unsupported(block: msgspec.Struct, where: str) -> ServingError:
    return _refuse(f"Content blocks of type '{type(block).__struct_config__.tag}' are not supported in {where}.",
                   "messages")


def _joined(blocks: list[an.TextBlock | an.ImageBlock | an.DocumentBlock], where: str) -> str:
    texts = []
    for block in blocks:
        if not isinstance(block, an.TextBlock):
            raise _unsupported(block, where)
        texts.append(block.text)
    return "\n".join(texts)


def chat_messages(req: an.MessagesRequest) -> list[wire.ChatMessage]:
    """System prompt, turns and tool traffic as the chat messages a template renders."""
    out: list[wire.ChatMessage] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined(list(req.system), "system")
        out.append(wire.ChatMessage(role="system", content=system))
    tool_names: dict[str, str] = {}
    for turn in req.messages:
        if isinstance(turn.content, str):
            out.append(wire.ChatMessage(role=turn.role, content=turn.content))
        elif turn.role == "assistant":
            out.append(_assistant_turn(turn.content, tool_names))
        else:
            out.extend(_user_turn(turn.content, tool_names))
    return out


def _assistant_turn(blocks: list[an.ContentBlockIn], tool_names: dict[str, str]) -> wire.ChatMessage:
    texts, calls = [], []
    for block in blocks:
        if isinstance(block, an.TextBlock):
            texts.append(block.text)
        elif isinstance(block, an.ToolUseBlock):
            tool_names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, an.ThinkingBlock | an.RedactedThinkingBlock):
            continue  # earlier reasoning is not shown to the model again
        else:
            raise _unsupported(block, "assistant messages")
    return wire.ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)


def _user_turn(blocks: list[an.ContentBlockIn], tool_names: dict[str, str]) -> list[wire.ChatMessage]:
    """Tool results become `tool` messages; runs of text between them become user messages."""
    out: list[wire.ChatMessage] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, an.TextBlock):
            texts.append(block.text)
        elif isinstance(block, an.ToolResultBlock):
            if texts:
                out.append(wire.ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            content = block.content if isinstance(block.content, str) else _joined(block.content, "tool results")
            if block.is_error:  # the model must know the call failed, as Anthropic's models are told
                content = f"Error: {content}" if content else "Error"
            out.append(wire.ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id,
                                        name=tool_names.get(block.tool_use_id)))
        else:
            raise _unsupported(block, "user messages")
    if texts or not out:
        out.append(wire.ChatMessage(role="user", content="\n".join(texts)))
    return out


def function_tools(req: an.MessagesRequest) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions as the OpenAI function tools chat templates expect."""
    names = {tool.name for tool in req.tools or []}
    choice = req.tool_choice
    if isinstance(choice, an.ToolChoiceAny | an.ToolChoiceTool) and not names:
        raise _refuse("'tool_choice' requires 'tools'.", "tool_choice")
    if isinstance(choice, an.ToolChoiceTool) and choice.name not in names:
        raise _refuse(f"'tool_choice' names the tool '{choice.name}', which is not in 'tools'.", "tool_choice")
    if not req.tools or isinstance(choice, an.ToolChoiceNone):
        return None
    tools = []
    for tool in req.tools:
        if tool.type not in (None, "custom"):
            raise _refuse(f"Tools of type '{tool.type}' are not supported.", "tools")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        tools.append({"type": "function", "function": function})
    return tools


def to_bus_request(req: an.MessagesRequest, request_id: str, principal: str | None = None) -> wire.GenerateRequest:
    """The bus request for a Messages call; the pipeline gives it its reply subject and deadline."""
    choice = req.tool_choice
    messages = chat_messages(req)
    return wire.GenerateRequest(
        request_id=request_id,
        model=req.model,
        reply_subject="",
        messages=messages,
        tools=function_tools(req),
        tool_required=isinstance(choice, an.ToolChoiceAny | an.ToolChoiceTool),
        tool_name=choice.name if isinstance(choice, an.ToolChoiceTool) else None,
        single_tool_call=isinstance(choice, an.ToolChoiceAuto | an.ToolChoiceAny | an.ToolChoiceTool)
        and choice.disable_parallel_tool_use,
        template_kwargs=template_kwargs(None, "thinking", req.thinking.switch() if req.thinking else None),
        # A conversation that ends on an assistant turn is a prefill: the reply continues it.
        continue_final_message=messages[-1].role == "assistant",
        sampling=req.sampling_params(),
        stream=req.stream,
        principal=principal,
        api=Api.MESSAGES,
    )


def _tool_input(arguments: str) -> dict[str, Any]:
    # The worker's parser only emits calls whose arguments are a JSON object; anything else is empty.
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBuilder:
    """A generation's deltas as Anthropic content blocks: stream events as they come, the list at the end.

    Both response shapes are built from the same events, so streamed and whole answers agree.
    """

    def __init__(self) -> None:
        self.blocks: list[an.ContentBlockOut] = []
        self._open: an.TextOut | an.ThinkingOut | None = None
        # The open block's text so far, joined into it when it closes (a `+=` per delta on the
        # block would copy the whole text each time).
        self._parts: list[str] = []

    @property
    def has_tool_use(self) -> bool:
        return any(isinstance(block, an.ToolUseOut) for block in self.blocks)

    def feed(self, delta: wire.Delta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._append_thinking(delta.reasoning)
        if delta.text:
            events += self._append_text(delta.text)
        for call in delta.tool_calls:
            events += self._tool_use(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        """End the open block (its text whole from here on)."""
        if self._open is None:
            return []
        if isinstance(self._open, an.TextOut):
            self._open.text = "".join(self._parts)
        else:
            self._open.thinking = "".join(self._parts)
        self._open, self._parts = None, []
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: an.ContentBlockOut, shown: an.ContentBlockOut) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown})
        return events

    def _append_text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if not isinstance(self._open, an.TextOut):
            block = an.TextOut(text="")
            events += self._start(block, an.TextOut(text=""))
            self._open = block
        self._parts.append(text)
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _append_thinking(self, thinking: str) -> list[dict[str, Any]]:
        events = []
        if not isinstance(self._open, an.ThinkingOut):
            block = an.ThinkingOut(thinking="")
            events += self._start(block, an.ThinkingOut(thinking=""))
            self._open = block
        self._parts.append(thinking)
        return [*events, self._delta({"type": "thinking_delta", "thinking": thinking})]

    def _tool_use(self, call: wire.ToolCallDelta) -> list[dict[str, Any]]:
        arguments = _tool_input(call.arguments)
        events = self._start(an.ToolUseOut(id=call.id, name=call.name, input=arguments),
                             an.ToolUseOut(id=call.id, name=call.name, input={}))
        events.append(self._delta({"type": "input_json_delta", "partial_json": _encode(arguments).decode()}))
        events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def stop_reason(finish: FinishReason, content: ContentBuilder, stop_sequence: str | None = None) -> str:
    if finish in (FinishReason.STOP, FinishReason.TOOL_CALLS) and content.has_tool_use:
        return "tool_use"
    if finish == FinishReason.STOP and stop_sequence:
        return "stop_sequence"
    return an.STOP_REASONS.get(finish, "end_turn")


def _anthropic_envelope(handler: Callable[[Request, Any], Response]) -> Callable[[Request, Any], Response]:
    """Let the gateway's handler log the failure and choose status, message and headers; answer
    in Anthropic's envelope instead of OpenAI's."""

    def handle(request: Request, exc: Exception) -> Response:
        response = handler(request, exc)
        message = response.content["error"]["message"]
        status = response.status_code or 500  # the gateway's handlers always set one
        return Response(an.error_body(status, message), status_code=status,
                        headers=response.headers)

    return handle


# The exception handlers of every Anthropic route.
ANTHROPIC_ERRORS: ExceptionHandlersMap = {
    ServingError: _anthropic_envelope(serving_error_handler),
    HTTPException: _anthropic_envelope(http_error_handler),
    Exception: _anthropic_envelope(internal_error_handler),
}


@post("/v1/messages", status_code=200, operation_class=operation_for("messages"), exception_handlers=ANTHROPIC_ERRORS)
async def messages(request: Request, state: State) -> Response | Stream:
    req = await state.bodies.read(request, an.MessagesRequest)
    bus_request = to_bus_request(req, f"msg_{uuid.uuid4().hex}", request.state.principal)
    await check_enforceable(bus_request, req.constraint_param())
    return await state.generations.serve(request, bus_request, MessagesFormatter(bus_request), HANDLER)


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encode(payload) + b"\n\n"


class MessagesFormatter:
    """A Messages answer, whole (`message`) or as Anthropic's stream of events."""

    def __init__(self, request: wire.GenerateRequest) -> None:
        self.id = request.request_id
        self.model = request.model
        self._content = ContentBuilder()
        self._finish: FinishReason | None = None
        self._stop_sequence: str | None = None

    def _feed(self, delta: wire.Delta) -> list[dict[str, Any]]:
        self._finish = delta.finish_reason or self._finish
        self._stop_sequence = delta.stop_sequence or self._stop_sequence
        return self._content.feed(delta)

    def _stop_reason(self, final: wire.Final) -> str:
        return stop_reason(self._finish or final.finish_reason, self._content, self._stop_sequence)

    def whole(self, deltas: list[wire.Delta], final: wire.Final) -> an.MessageOut:
        for delta in deltas:
            self._feed(delta)
        self._content.close()
        return an.MessageOut(
            id=self.id,
            model=self.model,
            content=self._content.blocks,
            stop_reason=self._stop_reason(final),
            stop_sequence=self._stop_sequence,
            usage=an.UsageOut(input_tokens=final.usage.prompt_tokens, output_tokens=final.usage.completion_tokens),
        )

    def error_body(self, error: ServingError) -> dict[str, Any]:
        return an.error_body(error.status, error.message)

    def stream_start(self, accepted: wire.Accepted) -> list[bytes]:
        start = an.MessageOut(id=self.id, model=self.model, content=[], stop_reason=None,
                              usage=an.UsageOut(input_tokens=accepted.prompt_tokens, output_tokens=0))
        return [_event({"type": "message_start", "message": start}), _event({"type": "ping"})]

    def stream_delta(self, delta: wire.Delta) -> list[bytes]:
        return [_event(event) for event in self._feed(delta)]

    def stream_final(self, final: wire.Final) -> list[bytes]:
        events = self._content.close()
        events.append({
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(final), "stop_sequence": self._stop_sequence},
            "usage": {"input_tokens": final.usage.prompt_tokens, "output_tokens": final.usage.completion_tokens},
        })
        events.append({"type": "message_stop"})
        return [_event(event) for event in events]

    def stream_error(self, error: ServingError) -> bytes:
        return _event(self.error_body(error))

    def stream_end(self) -> list[bytes]:
        return []
