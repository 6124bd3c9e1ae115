"""The arithmetic every bench number goes through: nearest-rank percentiles, medians, the liveness
rule for streamed deltas, decode/prefill rates and the decode-flatness verdict (SPEC §10)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Decode flatness (decode tok/s at the largest context / at the smallest) at or above this "holds";
# at or above SOFTENS_AT it "softens"; below, it "drops".
HOLDS_AT = 0.9
SOFTENS_AT = 0.7


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it,
    so always a value that occurred (as PostgreSQL's `percentile_disc`)."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(p / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def median(values: Sequence[float]) -> float | None:
    """The middle value, or the mean of the two middle ones for an even count."""
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def is_generated(delta: dict[str, Any]) -> bool:
    """A streamed delta counts as generated output when it carries text in `content` or
    `reasoning_content`: a thinking model may stream only reasoning for its whole budget, and
    reading that as silence would call a live stream dead and time TTFT at the wrong chunk."""
    return bool(delta.get("content")) or bool(delta.get("reasoning_content"))


def decode_rate(
    completion_tokens: int,
    decode_ms: float | None,
    generated_chunks: int,
    first_s: float | None,
    last_s: float | None,
) -> tuple[float | None, str | None]:
    """Decode tok/s and where it came from. The server's `helexa_timing.decode_ms` is preferred: it
    covers every token after the first over the engine's own decode window. Otherwise the client's
    window between the first and last generated chunk, counting chunks (both in the same frame: a
    token count that includes hidden reasoning over a window of visible chunks would overstate it)."""
    if decode_ms is not None and decode_ms > 0 and completion_tokens > 1:
        return (completion_tokens - 1) / (decode_ms / 1000), "server"
    if first_s is not None and last_s is not None and last_s > first_s and generated_chunks > 1:
        return (generated_chunks - 1) / (last_s - first_s), "client"
    return None, None


def prefill_rate(
    prefill_tokens: int | None, prefill_ms: float | None, prompt_tokens: int | None, ttft_s: float | None
) -> tuple[float | None, str | None]:
    """Prefill tok/s: the server's uncached prompt tokens over its prefill time when reported, else the
    prompt tokens over the client's TTFT (which also holds queueing and the network)."""
    if prefill_tokens and prefill_ms is not None and prefill_ms > 0:
        return prefill_tokens / (prefill_ms / 1000), "server"
    if prompt_tokens and ttft_s is not None and ttft_s > 0:
        return prompt_tokens / ttft_s, "client"
    return None, None


def flatness(decode_small: float | None, decode_large: float | None) -> float | None:
    """Decode tok/s at the largest context over at the smallest; None without both rates."""
    if decode_small is None or decode_large is None or decode_small <= 0:
        return None
    return decode_large / decode_small


def flatness_verdict(value: float | None) -> str | None:
    if value is None:
        return None
    if value >= HOLDS_AT:
        return "holds"
    if value >= SOFTENS_AT:
        return "softens"
    return "drops"
