"""POST /v1/chat/completions: OpenAI chat, streaming (SSE) and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.gateway import openai_schema as oa
from apps.gateway.dispatch import Generation, GenerationFailed, new_request_id, resolve_model, start_generation
from apps.gateway.errors import error_body

HANDLER = "chat_completions"
_encode = msgspec.json.encode


def to_bus_request(req: oa.ChatCompletionRequest, request_id: str, reply_subject: str, deadline: float) -> wire.GenerateRequest:
    return wire.GenerateRequest(
        request_id=request_id,
        model=req.model,
        reply_subject=reply_subject,
        messages=[wire.ChatMessage(role=m.role, content=m.text()) for m in req.messages],
        sampling=wire.Sampling(
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            n=req.n,
        ),
        stream=req.stream,
        api="chat.completions",
        deadline=deadline,
    )


def usage_out(usage: wire.Usage) -> oa.UsageOut:
    return oa.UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details={"cached_tokens": usage.cached_tokens},
        helexa_timing={
            "queue_ms": usage.queue_ms,
            "prefill_ms": usage.prefill_ms,
            "decode_ms": usage.decode_ms,
            "prefill_tokens": usage.prompt_tokens - usage.cached_tokens,
        },
    )


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response | Stream:
    req = oa.decode_request(await request.body(), oa.ChatCompletionRequest)
    bus, settings = state.bus, state.settings
    await resolve_model(bus, req.model)
    request_id = new_request_id("chatcmpl")
    bus_request = to_bus_request(req, request_id, bus.new_inbox(), time.time() + settings.accept_timeout_s)
    generation = await start_generation(bus, settings, bus_request, HANDLER)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Stream(
            _sse(generation, created, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
        )
    return await _complete(generation, created)


async def _complete(generation: Generation, created: int) -> Response:
    n = generation.request.sampling.n
    texts: list[list[str]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    try:
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                texts[frame.index].append(frame.text)
                finish[frame.index] = frame.finish_reason or finish[frame.index]
                continue
            choices = [
                oa.ChoiceOut(
                    index=i,
                    message=oa.ChatMessageOut(content="".join(texts[i])),
                    finish_reason=finish[i] or frame.finish_reason,
                )
                for i in range(n)
            ]
            body = oa.ChatCompletion(
                id=generation.request.request_id,
                created=created,
                model=generation.request.model,
                choices=choices,
                usage=usage_out(frame.usage),
            )
            return Response(_encode(body), media_type="application/json",
                            headers={"X-Request-Id": generation.request.request_id})
    except GenerationFailed as exc:
        return Response(error_body(exc.status, exc.message, exc.code), status_code=exc.status)
    finally:
        await generation.close()
    raise AssertionError("frames() ended without a final frame")


def _chunk(generation: Generation, created: int, delta: oa.DeltaOut, index: int = 0,
           finish: str | None = None) -> bytes:
    chunk = oa.ChatCompletionChunk(
        id=generation.request.request_id,
        created=created,
        model=generation.request.model,
        choices=[oa.ChunkChoice(index=index, delta=delta, finish_reason=finish)],
    )
    return b"data: " + _encode(chunk) + b"\n\n"


async def _sse(generation: Generation, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        for index in range(generation.request.sampling.n):
            yield _chunk(generation, created, oa.DeltaOut(role="assistant", content=""), index)
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                if frame.text:
                    yield _chunk(generation, created, oa.DeltaOut(content=frame.text), frame.index)
                if frame.finish_reason:
                    yield _chunk(generation, created, oa.DeltaOut(), frame.index, finish=frame.finish_reason)
                continue
            if include_usage:
                usage_chunk = oa.ChatCompletionChunk(
                    id=generation.request.request_id,
                    created=created,
                    model=generation.request.model,
                    choices=[],
                    usage=usage_out(frame.usage),
                )
                yield b"data: " + _encode(usage_chunk) + b"\n\n"
    except GenerationFailed as exc:
        yield b"data: " + _encode(error_body(exc.status, exc.message, exc.code)) + b"\n\n"
    finally:
        await generation.close()
    yield b"data: [DONE]\n\n"
