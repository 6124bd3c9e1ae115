"""POST /tokenize, POST /detokenize (vLLM's shapes) and POST /v1/messages/count_tokens (Anthropic).

Only the server can count what the model is sent, so the gateway does not tokenize: it
translates the body exactly as the generation route would (chat, text completion or Anthropic
Messages into a bus `GenerateRequest`) and asks a worker serving the model, over its `tokenize`
micro-service endpoint, for the prompt token ids that request would get (`apps.worker.token_service`,
which uses the run's own `build_prompt`). A count therefore equals `usage.prompt_tokens`
(`usage.input_tokens`) of the same request. A count generates nothing, but it is admitted like
other work on its model, in a pool of its own kind (`app.AdmittedTokenCounter`); it never compiles
a grammar (a request's constraint is held to its bounds as it is translated, nothing more). A prompt
too long for the model's context is refused here before any worker tokenizes it
(`validate.check_prompt_size`), and a worker's reply too large for the bus is a 413 from the worker
(`apps.worker.token_service`).
"""

from __future__ import annotations

import random
import uuid

import msgspec
import nats.errors
from litestar import Request, post
from litestar.datastructures import State

from apps.bus import topology, wire
from apps.bus.codes import Api, ErrorCode, ModelState, ServingError, Unavailable, unavailable
from apps.gateway.api import anthropic, chat
from apps.gateway.api import token_schema as ts
from apps.gateway.api.anthropic import ANTHROPIC_ERRORS
from apps.gateway.api.openapi_docs import operation_for
from apps.gateway.api.validate import check_prompt_size, decode_body, decode_request
from apps.gateway.bus_client import GatewayBus
from apps.gateway.bus_failures import BUS_ERRORS, bus_unavailable
from apps.gateway.cold_start import ColdStarts
from apps.gateway.node_registry import NodeRegistry
from engine.frontend.protocol import SamplingParams

# How long one worker may take to answer (a template and a tokenizer pass, nothing more).
TOKENIZE_TIMEOUT_S = 30.0
# Workers asked before giving up, when one does not answer.
MAX_TRIES = 2


class _Shape(msgspec.Struct):
    """Just enough of a /tokenize body to tell a chat from a prompt."""

    messages: msgspec.Raw = msgspec.Raw()

    @property
    def is_chat(self) -> bool:
        return bytes(self.messages) not in (b"", b"null")


class TokenCounter:
    """Asks a worker serving the model for token ids (or text) and turns refusals into ServingErrors."""

    def __init__(self, bus: GatewayBus, registry: NodeRegistry, cold_starts: ColdStarts,
                 timeout_s: float = TOKENIZE_TIMEOUT_S) -> None:
        self._bus = bus
        self._registry = registry
        self._cold_starts = cold_starts
        self._timeout_s = timeout_s

    async def model_for(self, model: str | None) -> str:
        """The model asked for, or the one model served when none is named (as vLLM allows)."""
        if model is not None:
            return model
        served = sorted({m.model for n in await self._registry.live_nodes() for m in n.models
                         if m.state == ModelState.READY})
        if len(served) != 1:
            raise ServingError(400, ErrorCode.INVALID_REQUEST,
                               "Missing required parameter: 'model' (this server serves "
                               f"{len(served)} models).", param="model")
        return served[0]

    async def ask(self, question: wire.TokenizeRequest) -> wire.TokenizeReply:
        """`question` asked of the live nodes serving its model (`nodes_for`), a few at most."""
        nodes = await self._cold_starts.nodes_for(question.model)
        if question.request is not None:
            check_prompt_size(question.request, nodes)
        payload = wire.encode(question)
        ctx = {"model": question.model}
        for node in random.sample(nodes, min(len(nodes), MAX_TRIES)):
            try:
                msg = await self._bus.nc.request(topology.node_endpoint(node.node, "tokenize"), payload,
                                                 timeout=self._timeout_s)
            except nats.errors.MaxPayloadError:
                raise ServingError(413, ErrorCode.INVALID_REQUEST, "The request is too large to be counted.",
                                   context={**ctx, "detail": "over the bus max_payload"}) from None
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
                continue  # gone or busy: another node of the model may answer
            except BUS_ERRORS as exc:  # the connection closed, draining or backed up
                raise bus_unavailable(exc, "asking a worker to count tokens") from None
            try:
                reply = wire.tokenize_reply_decoder.decode(msg.data)
            except msgspec.DecodeError:  # a worker of another version: another node may answer
                continue
            if reply.error is not None:
                raise ServingError(reply.error.status, reply.error.code, reply.error.message,
                                   context={**ctx, "node": node.node})
            return reply
        raise unavailable(Unavailable.TOKENIZE_UNANSWERED, {**ctx, "detail": "tokenize unanswered"},
                          model=question.model)


def _request_id() -> str:
    return f"tokenize-{uuid.uuid4().hex}"


def _response(reply: wire.TokenizeReply) -> ts.TokenizeResponse:
    return ts.TokenizeResponse(count=len(reply.token_ids), max_model_len=reply.max_model_len,
                               tokens=reply.token_ids, token_strs=reply.token_strs)


async def _tokenize_chat(counter: TokenCounter, body: bytes, principal: str | None) -> ts.TokenizeResponse:
    req = decode_body(body, ts.TokenizeChatRequest)
    if req.add_generation_prompt and req.continue_final_message:
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                           param="continue_final_message")
    req = msgspec.structs.replace(req, model=await counter.model_for(req.model))
    bus_request = chat.to_bus_request(req, _request_id(), principal)
    # Continuing the final message means no generation prompt, as generation does it.
    reply = await counter.ask(wire.TokenizeRequest(
        model=bus_request.model, request=bus_request, add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt or req.continue_final_message,
        return_token_strs=req.return_token_strs))
    return _response(reply)


async def _tokenize_prompt(counter: TokenCounter, body: bytes, principal: str | None) -> ts.TokenizeResponse:
    req = decode_body(body, ts.TokenizeCompletionRequest)
    model = await counter.model_for(req.model)
    bus_request = wire.GenerateRequest(request_id=_request_id(), model=model, reply_subject="",
                                       sampling=SamplingParams(), prompt=req.prompt, principal=principal,
                                       api=Api.COMPLETIONS)
    reply = await counter.ask(wire.TokenizeRequest(model=model, request=bus_request,
                                                   add_special_tokens=req.add_special_tokens,
                                                   return_token_strs=req.return_token_strs))
    return _response(reply)


@post("/tokenize", status_code=200, operation_class=operation_for("tokenize"))
async def tokenize(request: Request, state: State) -> ts.TokenizeResponse:
    shape = await decode_request(request, _Shape)
    body, principal = await request.body(), request.state.principal
    if shape.is_chat:
        return await _tokenize_chat(state.token_counter, body, principal)
    return await _tokenize_prompt(state.token_counter, body, principal)


@post("/detokenize", status_code=200, operation_class=operation_for("detokenize"))
async def detokenize(request: Request, state: State) -> ts.DetokenizeResponse:
    req = await decode_request(request, ts.DetokenizeRequest)
    counter: TokenCounter = state.token_counter
    model = await counter.model_for(req.model)
    reply = await counter.ask(wire.TokenizeRequest(model=model, token_ids=list(req.tokens)))
    return ts.DetokenizeResponse(prompt=reply.text)


@post("/v1/messages/count_tokens", status_code=200, operation_class=operation_for("count_tokens"),
      exception_handlers=ANTHROPIC_ERRORS)
async def count_tokens(request: Request, state: State) -> ts.CountTokensResponse:
    req = await decode_request(request, ts.CountTokensRequest)
    bus_request = anthropic.to_bus_request(req, _request_id(), request.state.principal)
    reply = await state.token_counter.ask(wire.TokenizeRequest(model=bus_request.model, request=bus_request,
                                                               count_only=True))
    return ts.CountTokensResponse(input_tokens=reply.count if reply.count is not None else len(reply.token_ids))
