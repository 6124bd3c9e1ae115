"""POST /v1/completions: OpenAI text completions, the prompt as text or as token ids."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import Api, ServingError
from apps.gateway import openai_schema as oa
from apps.gateway.chat import usage_out
from apps.gateway.dispatch import Generation, new_request_id, resolve_model, start_generation
from apps.gateway.errors import error_body
from apps.gateway.openapi_docs import operation_for

HANDLER = "completions"
_encode = msgspec.json.encode


def logprobs_legacy(entries: list[wire.TokenLogprobs], offset: int) -> dict[str, Any]:
    """The completions API's older logprobs shape: parallel lists and text offsets."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for t, lp, _ in e.top} for e in entries],
        "text_offset": offsets,
    }


def _body(generation: Generation, created: int, choices: list[oa.CompletionChoiceOut],
          usage: wire.Usage | None = None) -> oa.TextCompletion:
    return oa.TextCompletion(
        id=generation.request.request_id,
        created=created,
        model=generation.request.model,
        choices=choices,
        usage=usage_out(usage) if usage is not None else None,
    )


@post("/v1/completions", status_code=200, operation_class=operation_for("completions"))
async def completions(request: Request, state: State) -> Response | Stream:
    req = oa.decode_request(await request.body(), oa.CompletionRequest)
    text, token_ids = req.prompt_text_or_ids()
    bus, settings = state.bus, state.settings
    bus_request = wire.GenerateRequest(
        request_id=new_request_id("cmpl"),
        model=req.model,
        reply_subject=bus.new_inbox(),
        sampling=req.sampling_params(),
        prompt=text,
        prompt_token_ids=token_ids,
        stream=req.stream,
        api=Api.COMPLETIONS,
        principal=request.state.principal,
        deadline=time.time() + settings.accept_timeout_s,
    )
    await resolve_model(bus, req.model)
    generation = await start_generation(bus, settings, bus_request, HANDLER, request)
    created = int(time.time())
    if req.stream:
        return Stream(_sse(generation, created, req.include_usage()), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Request-Id": bus_request.request_id})
    return await _complete(generation, created)


async def _complete(generation: Generation, created: int) -> Response:
    n = generation.request.sampling.n
    with_logprobs = generation.request.sampling.logprobs is not None
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[wire.TokenLogprobs]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    try:
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                texts[frame.index].append(frame.text)
                logprobs[frame.index] += frame.logprobs or []
                finish[frame.index] = frame.finish_reason or finish[frame.index]
                continue
            choices = [
                oa.CompletionChoiceOut(
                    index=i,
                    text="".join(texts[i]),
                    finish_reason=finish[i] or frame.finish_reason,
                    logprobs=logprobs_legacy(logprobs[i], 0) if with_logprobs else None,
                )
                for i in range(n)
            ]
            return Response(_encode(_body(generation, created, choices, frame.usage)), media_type="application/json",
                            headers={"X-Request-Id": generation.request.request_id})
    except ServingError as exc:
        return Response(error_body(exc.status, exc.message, exc.code), status_code=exc.status)
    finally:
        await generation.close()
    raise AssertionError("frames() ended without a final frame")


async def _sse(generation: Generation, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    offsets = [0] * generation.request.sampling.n
    try:
        async for frame in generation.frames():
            if isinstance(frame, wire.Delta):
                if not (frame.text or frame.finish_reason or frame.logprobs):
                    continue
                choice = oa.CompletionChoiceOut(
                    index=frame.index,
                    text=frame.text,
                    finish_reason=frame.finish_reason,
                    logprobs=logprobs_legacy(frame.logprobs, offsets[frame.index]) if frame.logprobs else None,
                )
                offsets[frame.index] += len(frame.text)
                yield b"data: " + _encode(_body(generation, created, [choice])) + b"\n\n"
            elif include_usage:
                yield b"data: " + _encode(_body(generation, created, [], frame.usage)) + b"\n\n"
    except ServingError as exc:
        yield b"data: " + _encode(error_body(exc.status, exc.message, exc.code)) + b"\n\n"
    finally:
        await generation.close()
    yield b"data: [DONE]\n\n"
