"""POST /v1/chat/completions: OpenAI chat, streaming (SSE) and not, with n choices, reasoning,
tool calls and logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import Api, ServingError
from apps.gateway import openai_schema as oa
from apps.gateway.dispatch import Generation, new_request_id, resolve_model, start_generation
from apps.gateway.errors import error_body
from apps.gateway.openapi_docs import operation_for

HANDLER = "chat_completions"
_encode = msgspec.json.encode


def to_bus_request(req: oa.ChatCompletionRequest, request_id: str, reply_subject: str, deadline: float,
                   principal: str | None = None) -> wire.GenerateRequest:
    messages = [
        wire.ChatMessage(role=m.role, content=m.text(), tool_calls=m.template_tool_calls(),
                         tool_call_id=m.tool_call_id, name=m.name)
        for m in req.messages
    ]
    tool_required, tool_name = req.forced_tool()
    return wire.GenerateRequest(
        request_id=request_id,
        model=req.model,
        reply_subject=reply_subject,
        messages=messages,
        tool_required=tool_required,
        tool_name=tool_name,
        continue_final_message=req.continues_final_message(),
        sampling=req.sampling_params(),
        stream=req.stream,
        principal=principal,
        api=Api.CHAT_COMPLETIONS,
        deadline=deadline,
        tools=req.tool_dicts(),
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
    return {
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
    req = oa.decode_request(await request.body(), oa.ChatCompletionRequest)
    bus, settings = state.bus, state.settings
    bus_request = to_bus_request(req, new_request_id("chatcmpl"), bus.new_inbox(),
                                 time.time() + settings.accept_timeout_s, request.state.principal)
    await resolve_model(bus, req.model)
    generation = await start_generation(bus, settings, bus_request, HANDLER, request)
    created = int(time.time())
    if req.stream:
        return Stream(
            _sse(generation, created, req.include_usage()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": bus_request.request_id},
        )
    return await _complete(generation, created)


@dataclass(slots=True)
class ChoiceState:
    """One choice of a non-streamed answer, accumulated from its deltas."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[wire.ToolCallDelta] = field(default_factory=list)
    logprobs: list[wire.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: wire.Delta) -> None:
        self.content.append(delta.text)
        self.reasoning.append(delta.reasoning)
        self.tool_calls += delta.tool_calls
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason

    def choice(self, index: int, default_finish: str, with_logprobs: bool) -> oa.ChoiceOut:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        message = oa.ChatMessageOut(
            role="assistant",
            content=content if content or not self.tool_calls else None,
            reasoning_content=reasoning or None,
            tool_calls=tool_calls_out(self.tool_calls) or None,
        )
        return oa.ChoiceOut(
            index=index,
            message=message,
            finish_reason=self.finish_reason or default_finish,
            logprobs=logprobs_out(self.logprobs) if with_logprobs else None,
        )


async def _complete(generation: Generation, created: int) -> Response:
    sampling = generation.request.sampling
    choices = [ChoiceState() for _ in range(sampling.n)]
    try:
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                choices[frame.index].add(frame)
                continue
            body = oa.ChatCompletion(
                id=generation.request.request_id,
                created=created,
                model=generation.request.model,
                choices=[c.choice(i, frame.finish_reason, sampling.logprobs is not None) for i, c in enumerate(choices)],
                usage=usage_out(frame.usage),
            )
            return Response(_encode(body), media_type="application/json",
                            headers={"X-Request-Id": generation.request.request_id})
    except ServingError as exc:
        return Response(error_body(exc.status, exc.message, exc.code), status_code=exc.status)
    finally:
        await generation.close()
    raise AssertionError("frames() ended without a final frame")


def _sse_data(payload: msgspec.Struct | dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _chunk(generation: Generation, created: int, choice: oa.ChunkChoice) -> bytes:
    return _sse_data(oa.ChatCompletionChunk(
        id=generation.request.request_id, created=created, model=generation.request.model, choices=[choice]
    ))


def _delta_chunks(generation: Generation, created: int, frame: wire.Delta) -> list[bytes]:
    chunks = []
    tool_calls = [oa.ToolCallChunk(index=c.index, id=c.id, function=oa.FunctionCallOut(name=c.name, arguments=c.arguments))
                  for c in frame.tool_calls]
    if frame.text or frame.reasoning or tool_calls or frame.logprobs:
        delta = oa.DeltaOut(content=frame.text or None, reasoning_content=frame.reasoning or None,
                            tool_calls=tool_calls or None)
        logprobs = logprobs_out(frame.logprobs) if frame.logprobs else None
        chunks.append(_chunk(generation, created, oa.ChunkChoice(index=frame.index, delta=delta, logprobs=logprobs)))
    if frame.finish_reason:
        chunks.append(_chunk(generation, created,
                             oa.ChunkChoice(index=frame.index, delta=oa.DeltaOut(), finish_reason=frame.finish_reason)))
    return chunks


async def _sse(generation: Generation, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for index in range(generation.request.sampling.n):
            yield _chunk(generation, created, oa.ChunkChoice(index=index, delta=oa.DeltaOut(role="assistant", content="")))
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                for chunk in _delta_chunks(generation, created, frame):
                    yield chunk
            elif include_usage:
                yield _sse_data(oa.ChatCompletionChunk(
                    id=generation.request.request_id, created=created, model=generation.request.model,
                    choices=[], usage=usage_out(frame.usage),
                ))
    except ServingError as exc:
        yield _sse_data(error_body(exc.status, exc.message, exc.code))
    finally:
        await generation.close()
    yield b"data: [DONE]\n\n"
