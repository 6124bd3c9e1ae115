"""From a bus request to what the engine needs: prompt token ids, sampling options, and what
the output parser should expect (reasoning, tool calls). Refusals here happen before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from apps.bus import wire
from apps.worker.parsers import THINK_OPEN, TOOL_OPEN, OutputParser
from engine.api import SamplingOptions
from engine.tokenizer import Tokenizer


class RequestRejected(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    # The template opened <think> itself, so generation starts inside reasoning.
    opens_reasoning: bool = False
    parse_reasoning: bool = False
    parse_tools: bool = False

    def output_parser(self) -> OutputParser:
        return OutputParser(self.parse_reasoning, self.parse_tools, in_reasoning=self.opens_reasoning)


def _template_message(message: wire.ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.name:
        entry["name"] = message.name
    return entry


def build_prompt(tokenizer: Tokenizer, request: wire.GenerateRequest, reasoning_parser: str = "auto") -> Prompt:
    template = tokenizer.chat_template or ""
    parse_reasoning = THINK_OPEN in template if reasoning_parser == "auto" else reasoning_parser == "on"
    if request.messages is not None:
        messages = [_template_message(m) for m in request.messages]
        extra = {"tools": request.tools} if request.tools else {}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except TemplateError as exc:
            raise RequestRejected(400, "invalid_messages", f"The messages do not fit the model's chat template: {exc}")
        return Prompt(
            # The template already places any BOS the model expects.
            token_ids=tokenizer.encode(text, add_special_tokens=False),
            opens_reasoning=parse_reasoning and text.rstrip().endswith(THINK_OPEN),
            parse_reasoning=parse_reasoning,
            parse_tools=bool(request.tools) or TOOL_OPEN in template,
        )
    if request.prompt_token_ids is not None:
        vocab = tokenizer.vocab_size
        if not request.prompt_token_ids or any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise RequestRejected(400, "invalid_prompt", f"Prompt token ids must be in [0, {vocab}).")
        return Prompt(token_ids=list(request.prompt_token_ids), parse_reasoning=reasoning_parser == "on")
    if request.prompt is not None:
        ids = tokenizer.encode(request.prompt, add_special_tokens=True)
        if not ids:
            raise RequestRejected(400, "invalid_prompt", "The prompt is empty.")
        return Prompt(token_ids=ids, parse_reasoning=reasoning_parser == "on")
    raise RequestRejected(400, "invalid_request", "The request has neither messages nor a prompt.")


def sampling_options(request: wire.GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingOptions:
    """Refuse what cannot fit the context (OpenAI's wording); a missing max_tokens takes what fits."""
    room = max_model_len - num_prompt_tokens
    wanted = request.sampling.max_tokens
    if room <= 0 or (wanted is not None and wanted > room):
        requested = num_prompt_tokens + (wanted or 1)
        raise RequestRejected(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the messages, {wanted or 1} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    s = request.sampling
    return SamplingOptions(
        max_tokens=wanted if wanted is not None else room,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=min(s.min_tokens, wanted if wanted is not None else room),
        logprobs=s.logprobs,
    )
