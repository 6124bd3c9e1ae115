"""From a bus request to what the engine needs: prompt token ids, the sampling with its max_tokens
resolved, what the output parser should expect (reasoning, tool calls), and a migrated request's
resumed tokens checked. Refusals here happen before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from jinja2 import TemplateError

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.worker.parsers import THINK_CLOSE, THINK_OPEN, TOOL_OPEN, OutputParser
from apps.worker.tool_grammar import call_opening, reply_constraint
from engine.frontend.protocol import SamplingParams
from engine.frontend.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    # The template opened <think> itself, so generation starts inside reasoning.
    opens_reasoning: bool = False
    parse_reasoning: bool = False
    parse_tools: bool = False
    # Text placed after the template's prompt that the reply must start with (a forced tool call);
    # the parser reads it first, as if the model had written it.
    forced_start: str = ""
    # The reply ends with its first whole tool call (`wire.GenerateRequest.single_tool_call`).
    single_tool_call: bool = False

    def output_parser(self) -> OutputParser:
        parser = OutputParser(self.parse_reasoning, self.parse_tools, in_reasoning=self.opens_reasoning,
                              single_tool_call=self.single_tool_call)
        parser.feed(self.forced_start)
        return parser


def _template_message(message: wire.ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.name:
        entry["name"] = message.name
    return entry


def build_prompt(tokenizer: Tokenizer, request: wire.GenerateRequest, reasoning_parser: str = "auto", *,
                 add_generation_prompt: bool = True, add_special_tokens: bool | None = None) -> Prompt:
    """The prompt a generation of `request` feeds the model. The keyword arguments are for token
    counting (`/tokenize`), which may ask for other than what generation does: no generation
    prompt, or special tokens added (None: as generation adds them)."""
    template = tokenizer.chat_template or ""
    parse_reasoning = THINK_OPEN in template if reasoning_parser == "auto" else reasoning_parser == "on"
    if request.messages is not None:
        text = _render_chat(tokenizer, request, add_generation_prompt)
        opens_reasoning = parse_reasoning and text.rstrip().endswith(THINK_OPEN)
        forced = _forced_tool_start(request, opens_reasoning)
        return Prompt(
            # The template already places any BOS the model expects.
            token_ids=tokenizer.encode(text + forced, add_special_tokens=bool(add_special_tokens)),
            opens_reasoning=opens_reasoning,
            parse_reasoning=parse_reasoning,
            parse_tools=bool(request.tools) or TOOL_OPEN in template,
            forced_start=forced,
            single_tool_call=request.single_tool_call,
        )
    if request.prompt_token_ids is not None:
        vocab = tokenizer.vocab_size
        if not request.prompt_token_ids or any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ServingError(400, ErrorCode.INVALID_PROMPT, f"Prompt token ids must be in [0, {vocab}).")
        return Prompt(token_ids=list(request.prompt_token_ids), parse_reasoning=reasoning_parser == "on")
    if request.prompt is not None:
        ids = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens is not False)
        if not ids:
            raise ServingError(400, ErrorCode.INVALID_PROMPT, "The prompt is empty.")
        return Prompt(token_ids=ids, parse_reasoning=reasoning_parser == "on")
    raise ServingError(400, ErrorCode.INVALID_REQUEST, "The request has neither messages nor a prompt.")


def _render_chat(tokenizer: Tokenizer, request: wire.GenerateRequest, add_generation_prompt: bool = True) -> str:
    messages = [_template_message(m) for m in request.messages or []]
    extra: dict[str, Any] = {"tools": request.tools} if request.tools else {}
    if request.template_kwargs:
        problem = wire.template_kwargs_problem(request.template_kwargs)
        if problem is not None:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, f"'chat_template_kwargs': {problem}.")
        extra.update(request.template_kwargs)
    final = messages[-1] if request.continue_final_message else None
    prefill = (final or {}).get("content", "").strip()
    if final is not None:
        if final["role"] != "assistant" or final.get("tool_calls"):
            raise ServingError(
                400,
                ErrorCode.INVALID_MESSAGES,
                "Only a final assistant message of text can be continued.",
            )
        if request.tool_required:
            raise ServingError(
                400,
                ErrorCode.INVALID_MESSAGES,
                "A forced tool call cannot continue an assistant message.",
            )
        if not prefill:
            messages.pop()  # nothing to continue: an ordinary new turn
    try:
        if not prefill:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **extra)
    except TemplateError as exc:
        raise ServingError(400, ErrorCode.INVALID_MESSAGES,
                           f"The messages do not fit the model's chat template: {exc}") from exc
    except TypeError as exc:
        if not request.template_kwargs:
            raise
        # The template meeting an extra variable of another type than it expects.
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           f"'chat_template_kwargs' do not fit the model's chat template: {exc}") from exc
    # Cut the rendered conversation right after the prefill, before the template closes the turn.
    end = text.rfind(prefill)
    if end < 0:
        raise ServingError(
            400,
            ErrorCode.INVALID_MESSAGES,
            "This model's chat template cannot continue an assistant message.",
        )
    return text[: end + len(prefill)]


def _forced_tool_start(request: wire.GenerateRequest, in_reasoning: bool) -> str:
    """How the reply must begin so that it is a tool call (the named one, if any), Qwen style."""
    if not request.tool_required:
        return ""
    start = (THINK_CLOSE + "\n\n" if in_reasoning else "") + TOOL_OPEN + "\n"
    if request.tool_name:
        start += call_opening(request.tool_name)
    return start


def resolve_sampling(request: wire.GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The request's sampling with max_tokens resolved: refuse what cannot fit the context (OpenAI's
    wording); a missing max_tokens takes what fits."""
    room = max_model_len - num_prompt_tokens
    wanted = request.sampling.max_tokens
    if room <= 0 or (wanted is not None and wanted > room):
        requested = num_prompt_tokens + (wanted or 1)
        raise ServingError(
            400,
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the messages, {wanted or 1} in the completion). "
            "Please reduce the length of the messages or completion.",
        )
    max_tokens = wanted if wanted is not None else room
    return msgspec.structs.replace(request.sampling, max_tokens=max_tokens,
                                   min_tokens=min(request.sampling.min_tokens, max_tokens),
                                   structured=reply_constraint(request))


def check_sampling_ids(request: wire.GenerateRequest, vocab_size: int) -> None:
    """`stop_token_ids` and `logit_bias` name tokens of this model (the gateway checks them too, when
    the workers have reported the vocabulary; a bus client's request comes here unchecked)."""
    past = request.sampling.param_with_id_past(vocab_size) if vocab_size else None
    if past is not None:
        raise ServingError(400, ErrorCode.INVALID_REQUEST, f"'{past}' holds a token id outside the model's "
                           f"vocabulary (ids are 0 to {vocab_size - 1}).", param=past)


def check_resume(request: wire.GenerateRequest, vocab_size: int) -> None:
    """A migrated request names what each of its n choices was sent, in token ids of this model."""
    if request.resume is None:
        return
    if len(request.resume) != request.sampling.n:
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           f"resume has {len(request.resume)} choices; the request has n={request.sampling.n}.",
                           param="resume")
    if vocab_size and any(not 0 <= t < vocab_size for choice in request.resume for t in choice.token_ids):
        raise ServingError(400, ErrorCode.INVALID_REQUEST, f"Resumed token ids must be in [0, {vocab_size}).",
                           param="resume")
