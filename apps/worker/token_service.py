"""The worker's `tokenize` endpoint: the prompt token ids a generation of a request would feed the
model, and token ids back to text.

A count is only worth having if it is the count the model is actually sent, so tokenizing goes
through the very function a run uses (`prompt.build_prompt`: the chat template, tools, a forced
tool call's opening, a continued assistant turn) on the model's own tokenizer. The gateway's
`/tokenize`, `/detokenize` and `/v1/messages/count_tokens` are answered from here, and a count
equals the `prompt_tokens` that a generation of the same request reports.

Long text is tokenized in the model's tokenizing processes (`tokenizing.Tokenizing`), never on the
worker's event loop; the worker measures the reply before it sends it (`apps.bus.publish.respond`):
one larger than the bus carries is a 413, never a publish the server refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.worker.prompt import build_prompt
from apps.worker.run import ServedModel
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")


def _refusal(model: str, status: int, code: ErrorCode, message: str) -> wire.TokenizeReply:
    return wire.TokenizeReply(model=model, error=wire.TokenizeError(status=status, code=code, message=message))


def tokenize(tokenizer: Tokenizer, ask: wire.TokenizeRequest, reasoning_parser: str,
             max_model_len: int) -> wire.TokenizeReply:
    """Answer one question about a model's tokens (in its tokenizing pool when the text is long);
    a request's own fault raises ServingError."""
    if ask.token_ids is not None:
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ask.token_ids):
            raise ServingError(400, ErrorCode.INVALID_PROMPT, f"Token ids must be in [0, {vocab}).")
        # Special tokens are kept: the text of a rendered prompt shows its template's markers.
        text = tokenizer.decode(ask.token_ids, skip_special_tokens=False)
        return wire.TokenizeReply(model=ask.model, text=text, max_model_len=max_model_len)  # the asker has the ids
    if ask.request is None:
        raise ServingError(400, ErrorCode.INVALID_REQUEST, "Nothing to tokenize: give a request or token ids.")
    prompt = build_prompt(tokenizer, ask.request, reasoning_parser,
                          add_generation_prompt=ask.add_generation_prompt,
                          add_special_tokens=ask.add_special_tokens)
    if ask.count_only:
        return wire.TokenizeReply(model=ask.model, count=len(prompt.token_ids), max_model_len=max_model_len)
    token_strs = [tokenizer.hf.id_to_token(i) or "" for i in prompt.token_ids] if ask.return_token_strs else None
    return wire.TokenizeReply(model=ask.model, token_ids=prompt.token_ids, token_strs=token_strs,
                              max_model_len=max_model_len)


def _text_chars(ask: wire.TokenizeRequest) -> int:
    """About how much text answering `ask` handles (a token is a few characters)."""
    if ask.token_ids is not None:
        return 4 * len(ask.token_ids)
    return ask.request.text_chars() if ask.request is not None else 0


async def answer(served: Callable[[str], ServedModel | None], data: bytes) -> bytes:
    """The endpoint's reply to one message: a `TokenizeReply`, carrying the error when refused."""
    try:
        ask = wire.tokenize_request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        return wire.encode(_refusal("", 400, ErrorCode.INVALID_REQUEST, f"The body is not a TokenizeRequest: {exc}"))
    model = served(ask.model)
    if model is None:
        return wire.encode(_refusal(ask.model, 404, ErrorCode.MODEL_NOT_FOUND,
                                    f"This worker does not serve the model '{ask.model}'."))
    try:
        # Long text goes to the model's tokenizing processes: the loop keeps every stream's frames going.
        reply = await model.tokenizing.run(_text_chars(ask), tokenize, ask, model.reasoning_parser,
                                           model.context.derive().context)
    except ServingError as exc:
        reply = _refusal(ask.model, exc.status, exc.code or ErrorCode.INVALID_REQUEST, exc.message)
    except Exception:  # a template or tokenizer that breaks on this request: its own failure
        log.exception("tokenizing failed", extra={"model": ask.model})
        reply = _refusal(ask.model, 500, ErrorCode.INTERNAL_ERROR, "The worker could not tokenize this request.")
    return wire.encode(reply)
