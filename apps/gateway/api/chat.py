"""POST /v1/chat/completions: OpenAI chat, streaming (SSE) and not, with n choices, reasoning,
tool calls and logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import Api, FinishReason, ServingError
from apps.gateway.api import openai_schema as oa
from apps.gateway.api.openapi_docs import operation_for
from apps.gateway.api.request_ids import new_request_id
from apps.gateway.api.structured import check_enforceable
from apps.gateway.api.validate import JsonBudget
from apps.gateway.errors import error_body

HANDLER = "chat_completions"
_encode = msgspec.json.encode


def to_bus_request(req: oa.ChatCompletionRequest, request_id: str,
                   principal: str | None = None) -> wire.GenerateRequest:
    """The bus request for a chat completion; the pipeline gives it its reply subject and deadline.
    A developer message is the system prompt (OpenAI's newer name for it), as chat templates know it."""
    arguments = JsonBudget()
    messages = [
        wire.ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text(),
                         tool_calls=m.template_tool_calls(arguments), tool_call_id=m.tool_call_id, name=m.name)
        for m in req.messages
    ]
    tool_required, tool_name = req.forced_tool()
    return wire.GenerateRequest(
        request_id=request_id,
        model=req.model,
        reply_subject="",
        messages=messages,
        tool_required=tool_required,
        tool_name=tool_name,
        single_tool_call=not req.parallel_tool_calls,
        template_kwargs=req.template_kwargs(),
        continue_final_message=req.continues_final_message(),
        sampling=req.sampling_params(),
        stream=req.stream,
        principal=principal,
        api=Api.CHAT_COMPLETIONS,
        tools=req.tool_dicts(),
        priority=req.priority,
    )


def usage_out(usage: wire.Usage) -> oa.UsageOut:
    return oa.UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details={"cached_tokens": usage.cached_tokens},
        completion_tokens_details={"reasoning_tokens": usage.reasoning_tokens},
        helexa_timing={
            "queue_ms": usage.queue_ms,
            "prefill_ms": usage.prefill_ms,
            "decode_ms": usage.decode_ms,
            "prefill_tokens": usage.prompt_tokens - usage.cached_tokens,
        },
    )


def logprobs_out(entries: list[wire.TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""
    return {
        "refusal": None,
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e.top],
            }
            for e in entries
        ]
    }


def tool_calls_out(calls: list[wire.ToolCallDelta]) -> list[oa.ToolCallOut]:
    return [oa.ToolCallOut(id=c.id, function=oa.FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


@post("/v1/chat/completions", status_code=200, operation_class=operation_for("chat"))
async def chat_completions(request: Request, state: State) -> Response | Stream:
    req = await state.bodies.read(request, oa.ChatCompletionRequest)
    bus_request = to_bus_request(req, new_request_id("chatcmpl"), request.state.principal)
    await check_enforceable(bus_request, req.constraint_param())
    return await state.generations.serve(request, bus_request, ChatFormatter(bus_request, req.include_usage()),
                                         HANDLER, output_param=req.completion_limit_param())


@dataclass(slots=True)
class ChoiceState:
    """One choice of a non-streamed answer, accumulated from its deltas."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[wire.ToolCallDelta] = field(default_factory=list)
    logprobs: list[wire.TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def add(self, delta: wire.Delta) -> None:
        self.content.append(delta.text)
        self.reasoning.append(delta.reasoning)
        self.tool_calls += delta.tool_calls
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason

    def choice(self, index: int, default_finish: FinishReason, with_logprobs: bool) -> oa.ChoiceOut:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        message = oa.ChatMessageOut(
            role="assistant",
            content=content if content or not self.tool_calls else None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=tool_calls_out(self.tool_calls) or None,
        )
        return oa.ChoiceOut(
            index=index,
            message=message,
            finish_reason=finish_reason(self.finish_reason or default_finish, bool(self.tool_calls)),
            logprobs=logprobs_out(self.logprobs) if with_logprobs else None,
        )


def finish_reason(reason: FinishReason, called_tools: bool) -> FinishReason:
    """`tool_calls` for a choice that made a tool call and ended normally; a choice cut short
    (`length`) keeps saying so, as it must never read as a normal finish."""
    return FinishReason.TOOL_CALLS if called_tools and reason == FinishReason.STOP else reason


def tool_call_chunks(call: wire.ToolCallDelta) -> list[oa.ToolCallChunk]:
    """A tool call as OpenAI streams one: opened with its index, id, type and name (arguments
    empty), then its arguments as a string fragment."""
    return [
        oa.ToolCallChunk(index=call.index, id=call.id, type="function",
                         function=oa.FunctionCallChunk(name=call.name, arguments="")),
        oa.ToolCallChunk(index=call.index, function=oa.FunctionCallChunk(arguments=call.arguments)),
    ]


def sse_data(payload: msgspec.Struct | dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class OpenAIFormatting:
    """What OpenAI's APIs share: the answer's id, model, choice count and creation time, the error
    envelope, `data:` chunks and the `[DONE]` marker."""

    def __init__(self, request: wire.GenerateRequest, include_usage: bool) -> None:
        self.id = request.request_id
        self.model = request.model
        self.n = request.sampling.n
        self.with_logprobs = request.sampling.logprobs is not None
        self.include_usage = include_usage
        self.created = int(time.time())

    def error_body(self, error: ServingError) -> dict[str, Any]:
        return error_body(error.status, error.message, error.code)

    def stream_error(self, error: ServingError) -> bytes:
        return sse_data(self.error_body(error))

    def stream_end(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"]


class ChatFormatter(OpenAIFormatting):
    """A chat completion, whole (`chat.completion`) or as `chat.completion.chunk` events."""

    def __init__(self, request: wire.GenerateRequest, include_usage: bool) -> None:
        super().__init__(request, include_usage)
        self._called_tools = [False] * self.n

    def whole(self, deltas: list[wire.Delta], final: wire.Final) -> oa.ChatCompletion:
        choices = [ChoiceState() for _ in range(self.n)]
        for delta in deltas:
            choices[delta.index].add(delta)
        return oa.ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[c.choice(i, final.finish_reason, self.with_logprobs) for i, c in enumerate(choices)],
            usage=usage_out(final.usage),
        )

    def _chunk(self, choice: oa.ChunkChoice) -> bytes:
        return sse_data(oa.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def stream_start(self, accepted: wire.Accepted) -> list[bytes]:
        return [self._chunk(oa.ChunkChoice(index=index, delta=oa.DeltaOut(role="assistant", content="")))
                for index in range(self.n)]

    def stream_delta(self, delta: wire.Delta) -> list[bytes]:
        chunks = []
        if delta.text or delta.reasoning or delta.logprobs:
            shown = oa.DeltaOut(content=delta.text or None, reasoning_content=delta.reasoning or None,
                                reasoning=delta.reasoning or None)
            logprobs = logprobs_out(delta.logprobs) if delta.logprobs else None
            chunks.append(self._chunk(oa.ChunkChoice(index=delta.index, delta=shown, logprobs=logprobs)))
        for call in delta.tool_calls:
            self._called_tools[delta.index] = True
            chunks += [self._chunk(oa.ChunkChoice(index=delta.index, delta=oa.DeltaOut(tool_calls=[part])))
                       for part in tool_call_chunks(call)]
        if delta.finish_reason:
            reason = finish_reason(delta.finish_reason, self._called_tools[delta.index])
            chunks.append(self._chunk(oa.ChunkChoice(index=delta.index, delta=oa.DeltaOut(), finish_reason=reason)))
        return chunks

    def stream_final(self, final: wire.Final) -> list[bytes]:
        if not self.include_usage:
            return []
        return [sse_data(oa.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                                usage=usage_out(final.usage)))]
