"""The derived context limit (SPEC §6): ceilings, EMA, rounding, and the context=0 regression."""

from __future__ import annotations

import pytest

from apps.worker.context_limit import ContextLimit, Limits


def test_the_smallest_ceiling_wins_rounded_down_to_1024() -> None:
    limit = ContextLimit(max_position_embeddings=32768, kv_pool_tokens=20_000)
    assert limit.derive() == Limits(context=19456, input=19456 - 4864, output=4864)


def test_large_contexts_reserve_8192_for_output() -> None:
    limit = ContextLimit(max_position_embeddings=131072, kv_pool_tokens=None, prefill_tok_per_s=5000)
    assert limit.derive() == Limits(context=131072, input=131072 - 8192, output=8192)


def test_throughput_ceiling_from_the_bootstrap_rate() -> None:
    # 120 s × 800 tok/s = 96,000 tokens → 95,232 after rounding.
    limit = ContextLimit(max_position_embeddings=262144, kv_pool_tokens=None)
    assert limit.derive().context == 95232


def test_unknown_pool_and_hard_cap() -> None:
    assert ContextLimit(max_position_embeddings=8192, kv_pool_tokens=None, hard_cap=4000).derive().context == 3072


def test_a_tiny_first_request_does_not_drag_the_limit_down() -> None:
    limit = ContextLimit(max_position_embeddings=262144, kv_pool_tokens=None)
    before = limit.derive()
    # 3 prompt tokens in 50 ms "is" 60 tok/s: ignored, as are unmeasured prefills.
    assert not limit.observe_prefill(3, 50.0)
    assert not limit.observe_prefill(4096, 0.0)
    assert limit.derive() == before


def test_the_ema_follows_real_samples() -> None:
    limit = ContextLimit(max_position_embeddings=10**6, kv_pool_tokens=None)
    assert limit.observe_prefill(2000, 1000.0)  # 2000 tok/s
    assert limit.prefill_tok_per_s == pytest.approx(0.3 * 2000 + 0.7 * 800)
    limit.observe_prefill(4000, 1000.0)
    assert limit.prefill_tok_per_s == pytest.approx(0.3 * 4000 + 0.7 * (0.3 * 2000 + 0.7 * 800))


def test_small_models_never_advertise_zero() -> None:
    limits = ContextLimit(max_position_embeddings=600, kv_pool_tokens=10_000).derive()
    assert limits.context == 600 and limits.output == 150 and limits.input == 450
