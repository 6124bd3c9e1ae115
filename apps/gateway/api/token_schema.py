"""Request and response shapes of the token endpoints: vLLM's `/tokenize` and `/detokenize`, and
Anthropic's `/v1/messages/count_tokens`, as msgspec Structs carrying the input contract's bounds.

A chat to tokenize is a chat completion request (the same fields, bounds and translation, so
its count is that request's `prompt_tokens`) with vLLM's tokenizing options; `model` may be left
out when the gateway serves one model, as vLLM allows.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from apps.gateway.api import anthropic_schema as an
from apps.gateway.api import openai_schema as oa
from apps.gateway.api.validate import ModelId
from engine.frontend.protocol import TokenCount, TokenId

# Token ids one /detokenize call may send (about a million: far beyond any context).
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """vLLM's `/tokenize` of a prompt: its tokens as `/v1/completions` would feed them."""

    model: ModelId | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(oa.ChatCompletionRequest, kw_only=True):
    """vLLM's `/tokenize` of messages: the chat template rendered as `/v1/chat/completions` does."""

    model: ModelId | None = None  # type: ignore[assignment]  # may name no model: the one served is meant
    add_generation_prompt: bool = True
    # The rendered template places the special tokens itself.
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: ModelId | None = None
    tokens: Annotated[list[TokenId], Meta(max_length=MAX_DETOKENIZE_IDS)]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class CountTokensRequest(an.MessagesRequest, kw_only=True):
    """Anthropic's `/v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: TokenCount = 1


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int
