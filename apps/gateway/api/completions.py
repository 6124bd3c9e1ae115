"""POST /v1/completions: OpenAI text completions, the prompt as text or as token ids."""

from __future__ import annotations

from typing import Any

from litestar import Request, post
from litestar.datastructures import State
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import Api
from apps.gateway.api import openai_schema as oa
from apps.gateway.api.chat import OpenAIFormatting, sse_data, usage_out
from apps.gateway.api.openapi_docs import operation_for
from apps.gateway.api.request_ids import new_request_id
from apps.gateway.api.structured import check_enforceable

HANDLER = "completions"


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


def to_bus_request(req: oa.CompletionRequest, request_id: str, principal: str | None = None) -> wire.GenerateRequest:
    """The bus request for a text completion; the pipeline gives it its reply subject and deadline."""
    text, token_ids = req.prompt_text_or_ids()
    return wire.GenerateRequest(
        request_id=request_id,
        model=req.model,
        reply_subject="",
        sampling=req.sampling_params(),
        prompt=text,
        prompt_token_ids=token_ids,
        stream=req.stream,
        api=Api.COMPLETIONS,
        principal=principal,
        priority=req.priority,
    )


@post("/v1/completions", status_code=200, operation_class=operation_for("completions"))
async def completions(request: Request, state: State) -> Response | Stream:
    req = await state.bodies.read(request, oa.CompletionRequest)
    bus_request = to_bus_request(req, new_request_id("cmpl"), request.state.principal)
    await check_enforceable(bus_request, req.constraint_param())
    return await state.generations.serve(request, bus_request,
                                         CompletionFormatter(bus_request, req.include_usage()), HANDLER)


class CompletionFormatter(OpenAIFormatting):
    """A text completion, whole or as streamed `text_completion` chunks of one choice each."""

    def __init__(self, request: wire.GenerateRequest, include_usage: bool) -> None:
        super().__init__(request, include_usage)
        self._offsets = [0] * self.n

    def _body(self, choices: list[oa.CompletionChoiceOut], usage: wire.Usage | None = None) -> oa.TextCompletion:
        return oa.TextCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                                 usage=usage_out(usage) if usage is not None else None)

    def whole(self, deltas: list[wire.Delta], final: wire.Final) -> oa.TextCompletion:
        texts: list[list[str]] = [[] for _ in range(self.n)]
        logprobs: list[list[wire.TokenLogprobs]] = [[] for _ in range(self.n)]
        finish: list[str | None] = [None] * self.n
        for delta in deltas:
            texts[delta.index].append(delta.text)
            logprobs[delta.index] += delta.logprobs or []
            finish[delta.index] = delta.finish_reason or finish[delta.index]
        choices = [
            oa.CompletionChoiceOut(
                index=i,
                text="".join(texts[i]),
                finish_reason=finish[i] or final.finish_reason,
                logprobs=logprobs_legacy(logprobs[i], 0) if self.with_logprobs else None,
            )
            for i in range(self.n)
        ]
        return self._body(choices, final.usage)

    def stream_start(self, accepted: wire.Accepted) -> list[bytes]:
        return []

    def stream_delta(self, delta: wire.Delta) -> list[bytes]:
        if not (delta.text or delta.finish_reason or delta.logprobs):
            return []
        choice = oa.CompletionChoiceOut(
            index=delta.index,
            text=delta.text,
            finish_reason=delta.finish_reason,
            logprobs=logprobs_legacy(delta.logprobs, self._offsets[delta.index]) if delta.logprobs else None,
        )
        self._offsets[delta.index] += len(delta.text)
        return [sse_data(self._body([choice]))]

    def stream_final(self, final: wire.Final) -> list[bytes]:
        return [sse_data(self._body([], final.usage))] if self.include_usage else []
