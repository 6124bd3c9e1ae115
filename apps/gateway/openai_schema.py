"""OpenAI request and response shapes as msgspec Structs; validation errors name the parameter."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from apps.gateway.errors import ApiError


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"Content parts of type '{part.type}' are not supported.", param="messages")
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """The parameters we act on; unknown fields are accepted and ignored, as OpenAI clients expect."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "'stop' takes up to 4 non-empty strings.", param="stop")
        return stops


_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into `kind`, turning msgspec's errors into 400s that name the parameter."""
    if not body.strip():
        raise ApiError(400, "The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _MISSING.search(text) or _PATH.search(text)
        param = found.group(1) if found else None
        if _MISSING.search(text):
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {text.split(' - at ')[0]}." if param else f"Invalid request: {text}."
        raise ApiError(400, message, code="invalid_request", param=param) from None
    except msgspec.DecodeError:
        raise ApiError(400, "The request body is not valid JSON.", code="invalid_json") from None


class UsageOut(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    helexa_timing: dict[str, float] | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


class ChoiceOut(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChoiceOut]
    usage: UsageOut
    system_fingerprint: str | None = None


class DeltaOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaOut
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None
