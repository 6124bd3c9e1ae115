"""The boundary between the worker and an engine: what goes in, what comes out.

The worker's asyncio side speaks only these types; any engine (the simple one today, the
continuous-batching one later) implements `Engine`. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


class DeviceFault(RuntimeError):
    """The accelerator failed under the model (an illegal access, a lost device): its weights and
    KV cache can no longer be trusted, so the worker poisons the model until it is reloaded."""


DEVICE_FAULT_PREFIX = "device fault: "
# What a failing accelerator raises (torch.AcceleratorError, "CUDA error: an illegal memory access").
_DEVICE_FAULT_MARKERS = ("CUDA error", "AcceleratorError", "device-side assert", "HIP error")


def device_fault_message(exc: BaseException) -> str:
    """An engine error's text, marked as a device fault when the accelerator caused it."""
    text = f"{type(exc).__name__}: {exc}"
    faulty = isinstance(exc, DeviceFault) or any(marker in text for marker in _DEVICE_FAULT_MARKERS)
    return DEVICE_FAULT_PREFIX + text if faulty else text


def is_device_fault(error: str | None) -> bool:
    """Whether an engine's error output means the model can no longer serve until reloaded."""
    return bool(error) and (error.startswith(DEVICE_FAULT_PREFIX) or error == ENGINE_STOPPED)


ENGINE_STOPPED = "the engine process stopped"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class SamplingOptions:
    """Token-level sampling; stop *strings* are the detokenizer's job, not the engine's."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely alternatives.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be non-negative")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence and frequency penalties must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions


@dataclass(slots=True)
class EngineOutput:
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


class Engine(Protocol):
    """Submit a request, get an async stream of outputs; abort at any time (idempotent)."""

    model_id: str
    max_model_len: int
    max_num_seqs: int

    def free_slots(self) -> int: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
