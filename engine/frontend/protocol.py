"""The engine's protocol: what goes into an engine, what comes out, and the core pipe's messages.

Everything here is a msgspec Struct or an enum and imports no torch, so the worker's asyncio
process (and the bus, which carries `SamplingParams`) can speak to an engine whose core runs torch
in another process. `SamplingParams` is the one definition of the sampling parameters: the gateway
builds it once from an API request, the bus carries it, the worker resolves `max_tokens` against
the context window, the engine samples with it. Its bounds are its field types, so decoding a bus
message checks them again.
"""

from __future__ import annotations

import enum
from typing import Annotated, Protocol, cast

import msgspec
from msgspec import Meta


class FinishReason(enum.StrEnum):
    """Why a choice ended. Engines finish with stop, length, abort or error; `tool_calls` is a stop
    whose text held a tool call (the worker's output parser decides that)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"


# Largest number of choices (`n`) and of logprob alternatives per token a request may ask for.
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Temperatures below this sample greedily (as vLLM does): dividing logits by less overflows them.
GREEDY_BELOW_TEMPERATURE = 1e-5

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
AdditivePenalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[int, Meta(ge=1)]
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
# Longest grammar text (characters) a request may carry: a JSON schema, regex, Lark grammar, ...
MAX_GRAMMAR_CHARS = 1 << 20


class StructuredOutputKind(enum.StrEnum):
    """What `StructuredOutput.spec` holds; `engine.frontend.grammars` turns each into an llguidance grammar."""

    # A JSON schema as JSON text (`{"type": "object"}` for any JSON object).
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    # A JSON list of the strings the whole output may be.
    CHOICE = "choice"
    # A Lark grammar (llguidance's dialect) or a GBNF one.
    GRAMMAR = "grammar"
    # llguidance's own grammar JSON ({"grammars": [...]}): constraints composed by the worker.
    LLGUIDANCE = "llguidance"


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The constraint every token of the output must keep: the whole output matches it."""

    kind: StructuredOutputKind
    spec: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]

# Stop conditions are checked on every generated token (and a stop string holds back streamed
# text as long as itself), so a request may set only a few, and short ones.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
# Any vocabulary's ids fit int32 (and the core pipe's msgpack); the model's own size is checked where known.
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# The length here counts characters; the gateway also holds each one to MAX_STOP_STRING_BYTES of UTF-8.
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_BYTES)]
StopStrings = Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
# logit_bias (OpenAI's): token id -> a bias added to its logit before sampling, -100 (never, in
# effect) to 100 (always); at most MAX_LOGIT_BIAS tokens.
MAX_LOGIT_BIAS = 1024
LogitBias = Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)]


class ServiceClass(enum.StrEnum):
    """Who waits for the answer. The scheduler takes interactive work first and preempts running
    batch sequences for it (engine.core.scheduler); only the batch feeder sends `batch`."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class PreemptionReason(enum.StrEnum):
    """Why the scheduler took a running sequence off the KV cache (engine.core.scheduler)."""

    # A running sequence needed a KV block and none was free.
    KV_CACHE_FULL = "kv_cache_full"
    # A batch sequence gave way to a waiting interactive request (a seat, a state slot or KV room).
    INTERACTIVE_WAITING = "interactive_waiting"


# A request's `priority` within its class: lower runs first (as vLLM's), 0 by default.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
Priority = Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each token of each of `n` choices; stop *strings* are matched on text by the
    worker, everything else here is token-level and the engine's."""

    n: Choices = 1
    # None until the worker resolves it: what fits the context after the prompt.
    max_tokens: TokenCount | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    # 0: no top-k.
    top_k: TopK = 0
    min_p: MinP = 0.0
    presence_penalty: AdditivePenalty = 0.0
    frequency_penalty: AdditivePenalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed | None = None
    stop: StopStrings = []
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    logit_bias: LogitBias = {}
    # None: no logprobs; k: the chosen token's logprob plus the k most likely alternatives.
    logprobs: TopLogprobs | None = None
    # None: free text; else the grammar the output must match (engine.core.structured_output).
    structured: StructuredOutput | None = None

    def param_with_id_past(self, vocab_size: int) -> str | None:
        """The parameter that names a token outside a vocabulary of `vocab_size` (None: none does);
        the gateway and the worker refuse such a request by this one rule."""
        for param, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            if any(token >= vocab_size for token in ids):
                return param
        return None

    @property
    def greedy(self) -> bool:
        """The one place that decides greedy (argmax) decoding for a request."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of n: its own seed, so choices differ yet each stays reproducible."""
        if self.seed is None or index == 0:
            return self
        seed = (self.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN  # wraps within int64
        return msgspec.structs.replace(self, seed=seed)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """The sampled token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class EngineRequest(msgspec.Struct, frozen=True, array_like=True):
    """One sequence to generate; `sampling.max_tokens` is resolved (never None) by now.

    `resumed_token_ids` are tokens of this answer generated before (a request migrated from a
    worker that died mid-stream): the engine computes them after the prompt and goes on from
    there, never emitting them again. They count as generated tokens, exactly as if this engine
    had sampled them: for max_tokens, min_tokens, the penalties and a seeded draw's position.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    resumed_token_ids: list[int] = []
    # More requests are right behind this one (its gateway was still reading them): an idle
    # engine's batch window waits for them (engine.core.batch_window).
    more_arriving: bool = False
    service_class: ServiceClass = ServiceClass.INTERACTIVE
    priority: Priority = 0
    # Who may share this request's prefix-cache blocks: requests with the same salt (the worker
    # gives its principal); "" is the shared cache.
    cache_salt: str = ""


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's worth of new tokens for one request; the last one has `finished` set."""

    request_id: str
    new_token_ids: list[int]
    # One entry per new token when logprobs were asked for.
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Wall-clock milliseconds spent computing the prompt, set on the first output.
    prefill_ms: float | None = None
    error: str | None = None
    # Set on a token-less output when the scheduler preempted the request this step: why
    # (engine.core.scheduler's reasons), and the generated tokens it keeps.
    preempted: PreemptionReason | None = None
    tokens_kept: int = 0

    def merged(self, later: EngineOutput) -> EngineOutput:
        """This output and the next one of the same request as one (a slow reader's backlog)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return EngineOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            logprobs=logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
            prefill_ms=self.prefill_ms if self.prefill_ms is not None else later.prefill_ms,
            error=later.error or self.error,
            preempted=later.preempted or self.preempted,
            tokens_kept=later.tokens_kept if later.preempted else self.tokens_kept,
        )


class CoreInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the core tells its client once the model is loaded."""

    model_id: str
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int] = []
    max_position_embeddings: int = 0
    # The weights' and activations' dtype, why in a sentence for operators ("measured: ...",
    # "configured", "bf16 unsupported here (oneDNN: no ...)"), and the measurement: dtype ->
    # scenario ("rows_1", "rows_16", ...) -> ms (engine.cpu.dtype_choice).
    dtype: str = ""
    dtype_reason: str = ""
    dtype_timings_ms: dict[str, dict[str, float]] = {}
    # Model-runner ranks the model is sharded across (engine.runner.tensor_parallel).
    tensor_parallel: int = 1


class CoreStats(msgspec.Struct, kw_only=True):
    """Cumulative counters and the pool's state, sent to the client after each step."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    # Preemptions by reason (engine.core.scheduler: kv_cache_full, interactive_waiting).
    preemptions_by_reason: dict[PreemptionReason, int] = {}
    # Batch-class sequences running and waiting (priority classes).
    num_batch_running: int = 0
    num_batch_waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Hybrid models: linear-attention state slots (0 and 0 for models without them).
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    steps: int = 0
    # Grammar compiles started, and constrained requests that shared one done or under way.
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    # Each model-runner rank's steps and the seconds they took, by rank (one entry a rank: bounded
    # by tensor_parallel); followers' figures are their last reports (engine.runner.tensor_parallel).
    rank_steps: list[int] = []
    rank_step_seconds: list[float] = []
    # Threads this core's CPU steps run on now (helexa_kernels.machine.cpu_budget, then engine.cpu.thread_governor);
    # 0 on a GPU.
    cpu_threads: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


# --- the core pipe: client → core, then core → client ----------------------------------------

class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request: EngineRequest


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    info: CoreInfo


class CoreFailed(msgspec.Struct, frozen=True, tag=True):
    """The core could not start (the model did not load); the text says why."""

    error: str
    # The core refused a configuration this machine cannot run (`EngineRefused`): not a crash.
    refused: bool = False


class StepOutputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[EngineOutput]
    stats: CoreStats


ToCore = AddRequest | AbortRequests | Shutdown
FromCore = CoreReady | CoreFailed | StepOutputs

_encoder = msgspec.msgpack.Encoder()
encode_message = _encoder.encode
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


# --- faults ----------------------------------------------------------------------------------

class EngineRefused(Exception):
    """A configuration the engine will not start with on this machine (a dtype its CPU cannot
    run): its message is one line for the operator, no traceback, and the core sends it as a
    `CoreFailed` with `refused` set, which the client raises again as this."""


class DeviceFault(RuntimeError):
    """The accelerator failed under the model (an illegal access, a lost device): its weights and
    KV cache can no longer be trusted, so the worker poisons the model until it is reloaded."""


DEVICE_FAULT_PREFIX = "device fault: "
ENGINE_STOPPED = "the engine process stopped"
# What a failing accelerator raises (torch.AcceleratorError, "CUDA error: an illegal memory access").
_DEVICE_FAULT_MARKERS = ("CUDA error", "AcceleratorError", "device-side assert", "HIP error")


def device_fault_message(exc: BaseException) -> str:
    """An engine error's text, marked as a device fault when the accelerator caused it. The
    accelerator's errors are RuntimeErrors (torch.AcceleratorError among them); any other kind
    (a ValueError, an IndexError from one request's row) is that request's, whatever its text."""
    text = f"{type(exc).__name__}: {exc}"
    faulty = isinstance(exc, DeviceFault) or (
        isinstance(exc, RuntimeError) and any(marker in text for marker in _DEVICE_FAULT_MARKERS))
    return DEVICE_FAULT_PREFIX + text if faulty else text


def is_device_fault(error: str | None) -> bool:
    """Whether an engine's error output means the model can no longer serve until reloaded. A core
    process that died (`ENGINE_STOPPED`) is not one: the worker starts it again."""
    return error is not None and error.startswith(DEVICE_FAULT_PREFIX)


class EngineOutputs(Protocol):
    """One request's outputs, the last one `finished`; `aclose` before that aborts the request."""

    def __aiter__(self) -> EngineOutputs: ...

    async def __anext__(self) -> EngineOutput: ...

    async def aclose(self) -> None: ...


class HoldableOutputs(EngineOutputs, Protocol):
    """Outputs whose reader may `hold` them: till `release`, outputs that do not finish the request
    queue without waking it, and come merged into one (`release` says whether any waited).
    `holdable` tells them apart from other outputs."""

    def hold(self) -> None: ...

    def release(self) -> bool: ...


def holdable(outputs: EngineOutputs) -> HoldableOutputs | None:
    """`outputs` if they can be held (a typing.Protocol isinstance check costs more than a
    request's other checks together)."""
    return cast(HoldableOutputs, outputs) if hasattr(outputs, "hold") and hasattr(outputs, "release") else None


class Engine(Protocol):
    """Submit a request, get an async stream of outputs; abort at any time (idempotent).

    `generate` may send the request before its stream is first awaited (the core process's client
    does: a burst's requests then reach the engine's batch together); whoever calls it closes
    the stream.

    `info` describes the model and its KV pool; `stats` is the latest step's counters.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def info(self) -> CoreInfo: ...

    @property
    def stats(self) -> CoreStats: ...

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        """Sequences a request of `service_class` may start now: batch-class work counts every
        running request; interactive work does not count batch-class ones, which the scheduler
        preempts for it."""
        ...

    def generate(self, request: EngineRequest) -> EngineOutputs: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
