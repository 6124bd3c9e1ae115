"""The context window a worker can actually serve, derived from its KV pool and prefill speed.

    context = min(max_position_embeddings, kv_pool_tokens, target_prefill_s × prefill_tok_per_s, hard_cap)
    rounded down to a multiple of 1024 (never below what it was before rounding to 0);
    output = output_reserve (8192, or a quarter of the context for small ones); input = context − output

The prefill rate is an EMA (α = 0.3) over runs with at least 512 uncached prompt tokens, starting
from a bootstrap of 800 tok/s, so a tiny first request cannot drag the advertised limit to zero.
Every input and intermediate term is logged at debug level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("helexa.worker.context")

ROUND_TO = 1024


@dataclass(slots=True, frozen=True)
class Limits:
    context: int
    input: int
    output: int


@dataclass(slots=True)
class ContextLimit:
    max_position_embeddings: int
    # Tokens one sequence could hold if it had the whole KV pool (None: unknown, no ceiling).
    kv_pool_tokens: int | None
    hard_cap: int | None = None
    target_prefill_s: float = 120.0
    prefill_tok_per_s: float = 800.0
    ema_alpha: float = 0.3
    min_sample_tokens: int = 512
    max_output_reserve: int = 8192
    # False for an engine that does no prefill work (the scripted one): no throughput ceiling.
    prefill_bound: bool = True

    def __post_init__(self) -> None:
        if self.max_position_embeddings < 1:
            raise ValueError("max_position_embeddings must be positive")
        if self.prefill_tok_per_s <= 0 or self.target_prefill_s <= 0:
            raise ValueError("the prefill rate and target must be positive")

    def observe_prefill(self, prompt_tokens: int, prefill_ms: float) -> bool:
        """Fold one run's prefill into the rate; short or unmeasured prompts are ignored."""
        if prompt_tokens < self.min_sample_tokens or prefill_ms <= 0:
            return False
        sample = prompt_tokens / (prefill_ms / 1000.0)
        self.prefill_tok_per_s = self.ema_alpha * sample + (1 - self.ema_alpha) * self.prefill_tok_per_s
        return True

    def derive(self) -> Limits:
        throughput_ceiling = int(self.target_prefill_s * self.prefill_tok_per_s)
        ceilings = [self.max_position_embeddings]
        if self.prefill_bound:
            ceilings.append(throughput_ceiling)
        if self.kv_pool_tokens is not None:
            ceilings.append(self.kv_pool_tokens)
        if self.hard_cap:
            ceilings.append(self.hard_cap)
        raw = max(min(ceilings), 1)
        context = raw // ROUND_TO * ROUND_TO if raw >= ROUND_TO else raw
        output = min(self.max_output_reserve, max(context // 4, 1))
        limits = Limits(context=context, input=context - output, output=output)
        log.debug(
            "context limit derived",
            extra={
                "max_position_embeddings": self.max_position_embeddings,
                "kv_pool_tokens": self.kv_pool_tokens,
                "prefill_tok_per_s": round(self.prefill_tok_per_s, 1),
                "target_prefill_s": self.target_prefill_s,
                "throughput_ceiling": throughput_ceiling,
                "hard_cap": self.hard_cap,
                "raw": raw,
                "context": limits.context,
                "input": limits.input,
                "output": limits.output,
            },
        )
        return limits
