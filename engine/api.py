"""The boundary between the worker and an engine: what goes in, what comes out.

The worker's asyncio side speaks only these types; any engine (the simple one today, the
continuous-batching one later) implements `Engine`. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


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
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be non-negative")


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
