"""OpenAI request and response shapes as msgspec Structs, carrying the bounds of the input
contract (`apps.gateway.api.validate`), so decoding checks them and the OpenAPI schema shows them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from apps.bus.codes import ErrorCode, ServingError
from apps.gateway.api.structured import StructuredOutputFields
from apps.gateway.api.validate import (
    MAX_MESSAGES,
    MAX_TOOLS,
    JsonBudget,
    ModelId,
    check_stop_strings,
    template_kwargs,
    thinking_for_effort,
)
from engine.frontend import protocol as p


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCallIn
    type: str = "function"


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def template_tool_calls(self, budget: JsonBudget) -> list[dict[str, Any]] | None:
        """Tool calls as chat templates expect them: arguments as an object, not a JSON string."""
        if not self.tool_calls:
            return None
        calls = []
        for call in self.tool_calls:
            try:
                arguments = budget.parse(call.function.arguments or "{}", "messages")
            except ValueError:
                raise ServingError(400, ErrorCode.INVALID_REQUEST, "Tool call arguments must be a JSON object.",
                                   param="messages") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        return calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ServingError(
                    400,
                    ErrorCode.INVALID_REQUEST,
                    f"Content parts of type '{part.type}' are not supported.",
                    param="messages",
                )
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Calls of a strict tool are constrained to `parameters` (apps/gateway/api/structured.py).
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: dict[str, str]


class GenerationParams(StructuredOutputFields, kw_only=True):
    """What chat and text completions share; unknown fields are accepted and ignored, as OpenAI
    clients expect. vLLM's extensions (top_k, min_p, repetition_penalty, ...) are honoured too.

    Sampling fields carry the bounds of `engine.frontend.protocol` and are spelled as `SamplingParams`
    spells them, so `sampling_params` copies them over by name; null means the default."""

    model: ModelId
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: p.TokenCount | None = None
    temperature: p.Temperature | None = None
    top_p: p.TopP | None = None
    # vLLM spells "no top-k" as -1 as well as 0.
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: p.MinP | None = None
    presence_penalty: p.AdditivePenalty | None = None
    frequency_penalty: p.AdditivePenalty | None = None
    repetition_penalty: p.RepetitionPenalty | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    seed: p.Seed | None = None
    stop: p.StopString | p.StopStrings | None = None
    stop_token_ids: p.StopTokenIds | None = None
    ignore_eos: bool | None = None
    logit_bias: p.LogitBias | None = None
    n: p.Choices | None = None
    user: str | None = None
    # Order among this server's interactive requests, lower first (vLLM's `priority`).
    priority: p.Priority = 0

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return check_stop_strings([self.stop] if isinstance(self.stop, str) else self.stop, "stop")

    def logprobs_count(self) -> int | None:
        return None

    def completion_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> p.SamplingParams:
        """The request's sampling, built once; a missing max_tokens becomes the model's output
        limit on the way out (`validate.bound_output`)."""
        given = {name: getattr(self, name) for name in p.SamplingParams.__struct_fields__
                 if getattr(self, name, None) is not None}
        given.update(max_tokens=self.completion_limit(), stop=self.stop_strings(), logprobs=self.logprobs_count(),
                     structured=self.structured_output())
        if given.get("top_k") == -1:
            del given["top_k"]
        return p.SamplingParams(**given)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationParams, kw_only=True):
    messages: Annotated[list[MessageIn], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: p.TokenCount | None = None
    tools: Annotated[list[ToolDef], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: the reply holds at most one tool call.
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: p.TopLogprobs | None = None
    # vLLM's extension: the final assistant message is a prefix the model continues.
    continue_final_message: bool = False
    # vLLM's extension: extra chat template variables (Qwen3's `enable_thinking`), bounded by
    # `wire.template_kwargs_problem`.
    chat_template_kwargs: dict[str, Any] | None = None
    # "none" turns a thinking template's reasoning off (enable_thinking: false); other levels are
    # accepted and not acted on.
    reasoning_effort: Annotated[str, Meta(max_length=32)] | None = None

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def completion_limit_param(self) -> str:
        """The field the limit came from, for a 400 that names what the client sent."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, "'top_logprobs' requires 'logprobs' to be true.",
                               param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """Tools for the chat template; none when the client said tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = [{"type": "function", "function": msgspec.to_builtins(t.function)} for t in self.tools]
        for tool in tools:  # the template sees `strict` only when the client set it
            if tool["function"].get("strict") is None:
                tool["function"].pop("strict", None)
        return tools

    def forced_tool(self) -> tuple[bool, str | None]:
        """(a tool call is required, the name it must have): what `tool_choice` demands of the reply."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return False, None
        if not self.tools:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, "'tool_choice' requires 'tools'.", param="tool_choice")
        if choice == "required":
            return True, None
        name = choice.function.get("name") if isinstance(choice, NamedToolChoice) else None
        if name not in {t.function.name for t in self.tools}:
            raise ServingError(
                400,
                ErrorCode.INVALID_REQUEST,
                f"'tool_choice' names the function '{name}', which is not in 'tools'.",
                param="tool_choice",
            )
        return True, name

    def template_kwargs(self) -> dict[str, Any] | None:
        return template_kwargs(self.chat_template_kwargs, "chat_template_kwargs",
                               thinking=thinking_for_effort(self.reasoning_effort))

    def continues_final_message(self) -> bool:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ServingError(
                400,
                ErrorCode.INVALID_REQUEST,
                "'continue_final_message' needs the last message to be from the assistant.",
                param="continue_final_message",
            )
        return self.continue_final_message


class CompletionRequest(GenerationParams, kw_only=True):
    # Text, or token ids (a list of one text is accepted too).
    prompt: str | Annotated[list[p.TokenId | str], Meta(min_length=1)]
    logprobs: p.TopLogprobs | None = None
    echo: bool = False

    def logprobs_count(self) -> int | None:
        return self.logprobs


    def prompt_text_or_ids(self) -> tuple[str | None, list[int] | None]:
        if self.echo:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, "'echo' is not supported.", param="echo")
        if isinstance(self.prompt, str):
            return self.prompt, None
        if len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            return self.prompt[0], None
        if all(isinstance(p, int) for p in self.prompt):
            return None, list(self.prompt)  # type: ignore[arg-type]  # all ints, checked above
        raise ServingError(
            400,
            ErrorCode.INVALID_REQUEST,
            "'prompt' must be a string, a list of token ids, or a list of one string.",
            param="prompt",
        )


class UsageOut(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None
    helexa_timing: dict[str, float] | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCallOut
    type: str = "function"


class FunctionCallChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    arguments: str
    name: str | None = None


class ToolCallChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed tool call: its first chunk has `id`, `type` and the name, the next ones only
    `index` and a fragment of `arguments` (always a string, as OpenAI streams it)."""

    index: int
    function: FunctionCallChunk
    id: str | None = None
    type: str | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Required fields are always encoded; the optional ones only when present.
    role: str
    content: str | None
    # The same text under both names clients read: vLLM's `reasoning_content`, and `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChoiceOut(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


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
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaOut
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None


class CompletionChoiceOut(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    """A `/v1/completions` body; streamed chunks have the same shape with one choice and no usage."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoiceOut]
    usage: UsageOut | None = None


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct, kw_only=True):
    """What every failed OpenAI-style request answers (documented in the OpenAPI schema)."""

    error: ErrorDetail
