"""The worker's tokenizing off its event loop: long prompts are templated and tokenized in the
model's process pool, with the same result as inline, refusals crossing back whole; short ones
stay inline."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.worker.prompt import build_prompt
from apps.worker.token_service import tokenize
from apps.worker.tokenizing import Tokenizing
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import SamplingParams
from engine.frontend.tokenizer import Tokenizer
from engine.loading.default_model import default_model_path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = load_tokenizer(default_model_path())[0]
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # its template compiled, as a worker's is
    return tokenizer


def chat(text: str) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams(),
                                messages=[wire.ChatMessage(role="user", content=text)])


def test_a_long_prompt_is_tokenized_in_the_pool_as_it_would_be_inline(tokenizer: Tokenizer) -> None:
    tokenizing = Tokenizing(tokenizer, inline_chars=1000)
    request = chat("The quick brown fox jumps over the lazy dog. " * 100)

    async def both() -> tuple[object, object]:
        short = await tokenizing.run(10, build_prompt, chat("hi"), "auto")
        long = await tokenizing.run(request.text_chars(), build_prompt, request, "auto")
        return short, long

    try:
        short, long = asyncio.run(both())
    finally:
        tokenizing.close()
    assert tokenizing.pooled == 1  # the short one stayed inline
    assert long == build_prompt(tokenizer, request, "auto")
    assert short == build_prompt(tokenizer, chat("hi"), "auto")


def test_a_refusal_in_the_pool_crosses_back_whole(tokenizer: Tokenizer) -> None:
    tokenizing = Tokenizing(tokenizer, inline_chars=0)
    empty = wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams(),
                                 prompt="")
    try:
        with pytest.raises(ServingError) as caught:
            asyncio.run(tokenizing.run(1, build_prompt, empty, "auto"))
    finally:
        tokenizing.close()
    assert (caught.value.status, caught.value.code) == (400, ErrorCode.INVALID_PROMPT)


def test_serving_errors_pickle_with_their_fields() -> None:
    error = ServingError(413, ErrorCode.REQUEST_TOO_LARGE, "too big", param="prompt", retry_after_s=3,
                         context={"model": "m"})
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.status, copy.code, copy.message, copy.param, copy.retry_after_s, copy.context) == \
        (413, ErrorCode.REQUEST_TOO_LARGE, "too big", "prompt", 3, {"model": "m"})



def test_a_count_goes_back_without_the_ids_and_detokenize_without_them_either(tokenizer: Tokenizer) -> None:
    """What the bus carries back is what the gateway needs: a count (`/v1/messages/count_tokens`)
    is a number, not ~6 bytes per token of a long context that may not fit one message; a text
    (`/detokenize`) comes without the ids it was asked about."""
    request = chat("How many tokens is this? " * 200)
    whole = tokenize(tokenizer, wire.TokenizeRequest(model="m", request=request), "", 8192)
    counted = tokenize(tokenizer, wire.TokenizeRequest(model="m", request=request, count_only=True), "", 8192)
    assert counted.count == len(whole.token_ids) > 1000 and counted.token_ids == []
    assert len(wire.encode(counted)) < 200 < len(wire.encode(whole)) // 20
    text = tokenize(tokenizer, wire.TokenizeRequest(model="m", token_ids=whole.token_ids[:5]), "", 8192)
    assert text.text and text.token_ids == []
