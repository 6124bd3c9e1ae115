"""The input contract: what a generation request may hold, checked once, here, at the edge.

Beyond any bound the answer is a 400 naming the parameter (a 415 for a body that is not JSON), and
nothing is sent on the bus. The bounds:

- `Content-Type` is `application/json` (or `application/<x>+json`). What a web page may send
  cross-site without a CORS preflight (`text/plain`, forms, no type at all) is refused with 415.
- JSON shape: at most MAX_JSON_DEPTH (64) levels and MAX_JSON_CONTAINERS (262,144) arrays and
  objects, in the body and in each tool-call `arguments` string; tool schemas (`parameters`,
  `input_schema`) are bounded by the body's.
- `model`: 1–256 bytes of `A-Z a-z 0-9 . _ : / @ + -`.
- `messages`: 1–MAX_MESSAGES (2048); `tools`: at most MAX_TOOLS (128).
- Sampling: the bounds of `engine.frontend.protocol` (`SamplingParams`' field types), among them at most
  16 stop strings of at most 256 bytes each (`stop`, Anthropic's `stop_sequences`) and at most
  64 `stop_token_ids`.
- Token ids (`stop_token_ids`, `logit_bias`'s keys, a `/v1/completions` prompt given as ids) inside the model's
  vocabulary, once the workers serving it report its size (`ModelStatus.vocab_size`).
- The answer's length (`max_tokens`, `max_completion_tokens`, `max_output_tokens`): at most the
  output limit the workers serving the model advertise (`/v1/models` `max_output_tokens`), and
  that limit when the client gives none, so no answer is unbounded by default (`bound_output`).
- The prompt's length, before any worker tokenizes it (`check_prompt_size`): at most
  PROMPT_CHARS_PER_TOKEN (16) characters per token of the context the workers advertise, and, as
  token ids, at most the context. Tokenizing costs time in the length of the text, and a prompt
  past that many characters could never fit (tokens average about 4 characters).
- The logprobs of an answer built whole (`bound_whole_logprobs`: non-streamed, or any Responses
  answer, whose stream ends with every logprob again): at most MAX_WHOLE_LOGPROB_ENTRIES entries,
  `n` x the answer's length x (1 + `top_logprobs`); a length left out is shortened to fit, one
  asked for past it is a 400. A chat or completions stream goes a frame at a time.
- Grammars (structured outputs, enforced tool calls): `apps/gateway/api/structured.py`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
from litestar import Request
from msgspec import Meta

from apps.bus import wire
from apps.bus.codes import Api, ErrorCode, ServingError
from engine.frontend.protocol import MAX_STOP_STRING_BYTES

MAX_MODEL_ID_BYTES = 256
# ASCII only, so characters are bytes; no spaces, no control characters.
MODEL_ID_PATTERN = r"^[A-Za-z0-9._:/@+-]+$"
ModelId = Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_ID_BYTES, pattern=MODEL_ID_PATTERN,
                              description="The model id: 1-256 bytes of A-Z a-z 0-9 . _ : / @ + -")]
MAX_MESSAGES = 2048
# Characters a prompt may have per token of the model's context (tokens average ~4 characters).
PROMPT_CHARS_PER_TOKEN = 16
MAX_TOOLS = 128
MAX_JSON_DEPTH = 64
# Arrays and objects a body (or a tool call's `arguments`) may hold: room for an answer's logprobs
# echoed back (43 a token at 20 alternatives); msgspec builds them all in one call on the loop
# (tens of milliseconds for this many, half a second for the three million an 8 MiB body could
# hold).
MAX_JSON_CONTAINERS = 1 << 18

T = TypeVar("T")

# What each byte does to the nesting depth: an opening bracket +1, a closing one -1, the rest 0.
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SHAPE_SLICE_BYTES = 1 << 18
# OpenAI's bounds on the `metadata` of a stored response or batch.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# "... - at `$.field...`", or for an object's key "... - at `key` in `$.field...`".
_PATH = re.compile(r"at (?:`key` in )?`\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


def _refuse(message: str, param: str | None = None, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> ServingError:
    return ServingError(400, code, message, param=param)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """A stored object's `metadata` (a response's, a batch's) within OpenAI's bounds."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise _refuse(f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs, with keys of at most "
                      f"{MAX_METADATA_KEY_CHARS} characters and values of at most {MAX_METADATA_VALUE_CHARS}.",
                      "metadata")


def json_too_deep(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text nests arrays and objects deeper than `limit` (brackets inside strings
    do not count). Decoders recurse per level, so this is checked before any of them runs."""
    return _json_shape(data, limit)[0] > limit


def _json_shape(data: bytes | str, limit: int) -> tuple[int, int]:
    """JSON text's deepest nesting and its count of arrays and objects (brackets inside strings
    do not count); both at most `limit` may be told by a count of the brackets alone."""
    raw = data.encode() if isinstance(data, str) else data
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= limit:
        return brackets, brackets  # too few to be past it: the common case, at C speed
    # The running depth over the bytes outside strings, at C speed throughout (an 8 MiB body of
    # brackets or of short strings in tens of milliseconds, not a Python step per bracket), a
    # slice at a time so its arrays stay small (a few MiB, whatever the body's size).
    depth = deepest = containers = 0
    in_string = False
    backslashes = 0  # the run of them that ended the slice before
    for start in range(0, len(raw), _SHAPE_SLICE_BYTES):
        text = np.frombuffer(raw, dtype=np.uint8, count=min(_SHAPE_SLICE_BYTES, len(raw) - start), offset=start)
        delimiter = text == ord('"')
        backslash = text == ord("\\")
        if backslashes or backslash.any():  # a quote after an odd run of backslashes is inside its string
            positions = np.arange(text.size, dtype=np.int32)
            last_other = np.maximum.accumulate(np.where(backslash, -1, positions))
            run = np.empty(text.size, dtype=np.int32)  # backslashes right before each byte
            run[0] = backslashes
            run[1:] = positions[:-1] - last_other[:-1]
            run[1:] += np.where(last_other[:-1] < 0, backslashes, 0)
            delimiter &= run % 2 == 0
            backslashes = int(run[-1] + 1) if backslash[-1] else 0
        quotes = np.cumsum(delimiter, dtype=np.int32)
        outside = (quotes & 1) == int(in_string)
        steps = np.where(outside, _DEPTH_STEP[text], 0).astype(np.int32)
        running = np.cumsum(steps)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
        containers += int(np.count_nonzero(steps == 1))
        in_string ^= bool(quotes[-1] & 1)
    return deepest, containers


def check_json_shape(data: bytes | str, param: str | None) -> int:
    """At most MAX_JSON_DEPTH levels and MAX_JSON_CONTAINERS arrays and objects (returned): decoding
    builds each (an untyped field, a tool's `parameters`, holds whatever it is sent) on the event
    loop, in one call that holds the interpreter."""
    depth, containers = _json_shape(data, min(MAX_JSON_DEPTH, MAX_JSON_CONTAINERS))
    where = f"'{param}'" if param else "The request body"
    if depth > MAX_JSON_DEPTH:
        raise _refuse(f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels.", param)
    if containers > MAX_JSON_CONTAINERS:
        raise _refuse(f"{where} holds {containers} JSON arrays and objects; at most {MAX_JSON_CONTAINERS}.", param)
    return containers


class JsonBudget:
    """The arrays and objects that the JSON strings of one request (its tool calls' `arguments`,
    parsed for the chat template) may hold together: MAX_JSON_CONTAINERS, as the body may, each
    string also within MAX_JSON_DEPTH."""

    def __init__(self) -> None:
        self.left = MAX_JSON_CONTAINERS

    def parse(self, text: str, param: str) -> Any:
        """`text` decoded (ValueError if it is not JSON), once its shape is within the budget."""
        self.left -= check_json_shape(text, param)
        if self.left < 0:
            raise _refuse(f"The tool calls in '{param}' hold more than {MAX_JSON_CONTAINERS} JSON arrays and "
                          "objects in their arguments together.", param)
        return json.loads(text)


def _check_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    raise ServingError(415, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                       "The request body must be JSON, sent with 'Content-Type: application/json'.",
                       context={"detail": f"content type {media_type or 'missing'}"})


async def decode_request(request: Request, kind: type[T]) -> T:
    """The request's JSON body as `kind`, after the media type and nesting checks."""
    _check_content_type(request)
    return decode_body(await request.body(), kind)


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind`, turning msgspec's errors into 400s that name the parameter."""
    if not body.strip():
        raise _refuse("The request body is empty; expected a JSON object.")
    check_json_shape(body, None)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        if (without := _null_flags_dropped(body, kind, str(exc))) is not None:
            return decode_body(without, kind)
        text = str(exc)
        found = _MISSING.search(text) or _PATH.search(text)
        param = found.group(1) if found else None
        if _MISSING.search(text):
            message = f"Missing required parameter: '{param}'."
        else:
            key = " (a key)" if " - at `key` in " in text else ""
            message = (f"Invalid value for '{param}'{key}: {text.split(' - at ')[0]}." if param
                       else f"Invalid request: {text}.")
        raise _refuse(message, param) from None
    except msgspec.DecodeError:
        raise _refuse("The request body is not valid JSON.", code=ErrorCode.INVALID_JSON) from None


def _null_flags_dropped(body: bytes, kind: type, error: str) -> bytes | None:
    """`body` without the top-level nulls of `kind`'s boolean fields that have a default, when a
    null there is what failed: the SDKs type them Optional (`logprobs=None` is sent as null), and
    null means the default, as OpenAI takes it. None when that is not the error."""
    if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
        return None
    flags = {f.encode_name for f in msgspec.structs.fields(kind) if f.type is bool
             and f.default is not msgspec.NODEFAULT}
    found = _PATH.search(error)
    if "got `null`" not in error or found is None or found.group(1) not in flags:
        return None
    fields = msgspec.json.decode(body)
    if not isinstance(fields, dict):
        return None
    return msgspec.json.encode({k: v for k, v in fields.items() if not (k in flags and v is None)})


def thinking_for_effort(effort: str | None) -> bool | None:
    """A thinking template's switch from OpenAI's reasoning effort: "none" turns reasoning off;
    other levels leave the template's default (they are not enforced)."""
    return False if effort == "none" else None


def template_kwargs(given: dict[str, Any] | None, param: str, thinking: bool | None = None) -> dict[str, Any] | None:
    """Extra chat template variables from a request: `given` checked (a 400 naming `param`), with
    `enable_thinking` set from the API's own reasoning switch (`thinking`) unless given."""
    kwargs = dict(given or {})
    added = thinking is not None and "enable_thinking" not in kwargs
    if added:
        kwargs["enable_thinking"] = thinking
    problem = wire.template_kwargs_problem(kwargs)
    if problem is not None:
        also = " (counting enable_thinking, which the request's reasoning setting adds)" if added else ""
        raise _refuse(f"'{param}': {problem}{also}.", param)
    return kwargs or None


def check_stop_strings(stops: list[str], param: str) -> list[str]:
    """Stop strings are bounded in bytes too (the schema counts characters)."""
    if any(len(stop.encode()) > MAX_STOP_STRING_BYTES for stop in stops):
        raise _refuse(f"Each entry of '{param}' may be at most {MAX_STOP_STRING_BYTES} bytes long.", param)
    return stops


def vocabulary_size(nodes: list[wire.NodeStatus], model: str) -> int:
    """The smallest vocabulary the nodes serving `model` report (0: none of them says)."""
    sizes = [m.vocab_size for n in nodes for m in n.models if m.model == model and m.vocab_size]
    return min(sizes) if sizes else 0


def check_token_ids(request: wire.GenerateRequest, nodes: list[wire.NodeStatus]) -> None:
    """Token ids must name tokens of the model: an id past its vocabulary would index past the
    embedding table (or the logits) of every sequence in the worker's batch."""
    vocab = vocabulary_size(nodes, request.model)
    if not vocab:
        return
    past = request.sampling.param_with_id_past(vocab)
    if past is not None:
        raise _refuse(f"'{past}' holds a token id outside the model's vocabulary (ids are 0 to {vocab - 1}).", past)
    if any(i >= vocab for i in request.prompt_token_ids or []):
        raise _refuse(f"'prompt' holds a token id outside the model's vocabulary (ids are 0 to {vocab - 1}).",
                      "prompt", ErrorCode.INVALID_PROMPT)



# The field a prompt is in, per API, for the 400 that names it.
_PROMPT_PARAM = {Api.CHAT_COMPLETIONS: "messages", Api.COMPLETIONS: "prompt", Api.MESSAGES: "messages",
                 Api.RESPONSES: "input"}


def check_prompt_size(request: wire.GenerateRequest, nodes: list[wire.NodeStatus]) -> None:
    """A prompt that could never fit the context of the workers serving its model is refused before
    any of them tokenizes it: tokenizing costs time in its length, and its ids the bus's room."""
    context = _smallest([m.max_model_len for n in nodes for m in n.models if m.model == request.model])
    if context is None:
        return
    param = _PROMPT_PARAM.get(request.api, "prompt")
    if request.prompt_token_ids is not None and len(request.prompt_token_ids) > context:
        raise _refuse(f"This model's maximum context length is {context} tokens. However, the prompt has "
                      f"{len(request.prompt_token_ids)} tokens. Please shorten '{param}'.", param,
                      ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    limit = context * PROMPT_CHARS_PER_TOKEN
    chars = request.text_chars()
    if chars > limit:
        raise _refuse(f"This model's maximum context length is {context} tokens, and a prompt may have at most "
                      f"{limit} characters ({PROMPT_CHARS_PER_TOKEN} per token) before it is tokenized. However, "
                      f"the prompt has {chars} characters. Please shorten '{param}'.", param,
                      ErrorCode.CONTEXT_LENGTH_EXCEEDED)


def _smallest(values: list[int | None]) -> int | None:
    known = [v for v in values if v]
    return min(known) if known else None


# Logprob entries (a token's own, and each alternative) one answer built whole may carry: about 60
# bytes each once encoded, so the bound is ~16 MB of body built in the gateway at once.
MAX_WHOLE_LOGPROB_ENTRIES = 1 << 18
# What each API calls the number of alternatives per token.
_LOGPROBS_PARAM = {Api.COMPLETIONS: "logprobs"}


def bound_whole_logprobs(request: wire.GenerateRequest, length_defaulted: bool) -> wire.GenerateRequest:
    """An answer built whole holds its logprobs within MAX_WHOLE_LOGPROB_ENTRIES: `n` x its length
    x (1 + alternatives), counted once the length is bound (`bound_output`). A non-streamed answer
    is built whole, and so is a Responses stream's last events (each repeats every logprob). A
    length the client left out is shortened to fit; one it asked for past the bound is a 400."""
    sampling = request.sampling
    whole = not request.stream or request.api == Api.RESPONSES
    if not whole or sampling.logprobs is None or sampling.max_tokens is None:
        return request
    per_token = sampling.n * (1 + sampling.logprobs)
    if sampling.max_tokens * per_token <= MAX_WHOLE_LOGPROB_ENTRIES:
        return request
    if length_defaulted:
        shorter = msgspec.structs.replace(sampling, max_tokens=MAX_WHOLE_LOGPROB_ENTRIES // per_token)
        return msgspec.structs.replace(request, sampling=shorter)
    param = _LOGPROBS_PARAM.get(request.api, "top_logprobs")
    raise _refuse(f"This answer could hold {sampling.max_tokens * per_token} logprob entries (n {sampling.n} x "
                  f"{sampling.max_tokens} tokens x (1 + {sampling.logprobs} alternatives)); an answer built whole "
                  f"holds at most {MAX_WHOLE_LOGPROB_ENTRIES}. Lower '{param}', 'n' or the answer's length"
                  f"{'' if request.api == Api.RESPONSES else ', or stream it'}.", param, ErrorCode.INVALID_REQUEST)


def output_limit(nodes: list[wire.NodeStatus], model: str) -> int | None:
    """The longest answer every node serving `model` advertises (None: none of them says)."""
    return _smallest([m.max_output_tokens for n in nodes for m in n.models if m.model == model])


def bound_output(request: wire.GenerateRequest, nodes: list[wire.NodeStatus],
                 param: str = "max_tokens") -> wire.GenerateRequest:
    """The one rule for how long an answer may be, the same on every API (`param` is what the
    client's API calls the field): a missing value becomes the output limit the model advertises,
    a larger one is a 400 `context_length_exceeded`. Where no node advertises a limit the request
    goes as it is, and the worker refuses what cannot fit its context."""
    limit = output_limit(nodes, request.model)
    wanted = request.sampling.max_tokens
    if limit is None or (wanted is not None and wanted <= limit):
        return request
    if wanted is None:
        return msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, max_tokens=limit))
    context = _smallest([m.max_model_len for n in nodes for m in n.models if m.model == request.model])
    window = (f"This model's maximum context length is {context} tokens, of which" if context
              else "Of this model's context,")
    raise _refuse(f"{window} at most {limit} are for the completion. However, you requested {wanted} completion "
                  f"tokens ('{param}'). Please reduce '{param}'.", param, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
