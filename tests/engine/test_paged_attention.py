"""Paged attention against a per-sequence loop of plain causal attention over full K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.ops import attention, paged_attention
from engine.runner.ops import kv_store as store_kv
from engine.runner.step_metadata import AttentionMetadata
from tests.engine.helpers import random_block_tables

# (query_len, seq_len) per sequence: whole prefills, chunked continuations, decodes.
BATCHES = {
    "mixed": [(7, 7), (5, 13), (1, 9), (1, 1), (3, 20), (1, 33)],
    "decode-only": [(1, 5), (1, 17), (1, 1), (1, 40)],
    "prefill-only": [(9, 9), (2, 2), (16, 16)],
    "one-chunk": [(6, 30)],
    # Decode contexts far apart: more than one length bucket (engine.runner.attention_plan).
    "spread-decodes": [(1, 3), (1, 300), (4, 9), (1, 5), (1, 290), (1, 1), (1, 310)],
    # Prompts whose first blocks the prefix cache held (the CPU kernel takes their rows), beside a
    # continuation too long for it (engine.runner.attention_plan.KERNEL_CHUNK_KEYS).
    "cached-prompts": [(16, 128), (1, 40), (9, 128), (70, 100), (64, 65)],
}
pytestmark = pytest.mark.usefixtures("decode_path")

HEADS = {"gqa-4-2": (4, 2), "mha-3-3": (3, 3), "mqa-4-1": (4, 1)}
HEAD_DIM = 8


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q: [q_len, heads, d] at the last q_len positions of k/v [seq_len, kv_heads, d]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("new_keys", [True, False], ids=["new-keys", "cache-only"])
@pytest.mark.parametrize("block_size", [4, 16], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("batch", list(BATCHES.values()), ids=list(BATCHES))
def test_paged_attention_matches_per_sequence_loop(batch: list[tuple[int, int]],
                                                   heads: tuple[int, int],
                                                   block_size: int, new_keys: bool) -> None:
    _check_against_loop(batch, heads, block_size, new_keys)


def _sdpa_in_cuda_layout(*args: object, **kwargs: object) -> torch.Tensor:
    """SDPA whose output [B, H, M, K] lies in memory as [B, M, H, K]: what CUDA's flash and
    memory-efficient kernels return (CPU's kernels return it contiguous)."""
    out = _SDPA(*args, **kwargs)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


_SDPA = F.scaled_dot_product_attention


@pytest.mark.parametrize("heads", [HEADS["gqa-4-2"], HEADS["mha-3-3"]], ids=["gqa-4-2", "mha-3-3"])
@pytest.mark.parametrize("batch", [BATCHES["decode-only"], BATCHES["spread-decodes"],
                                   BATCHES["mixed"]], ids=["decode-only", "spread-decodes", "mixed"])
def test_paged_attention_with_cuda_sdpa_layout(batch: list[tuple[int, int]], heads: tuple[int, int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode rows' SDPA output is strided on CUDA, not contiguous: the step's output must
    still come back [num_tokens, num_heads, head_dim] with each head in its place (a `.view`
    of it raised on the GPU)."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_in_cuda_layout)
    _check_against_loop(batch, heads, block_size=4, new_keys=True)


def _check_against_loop(batch: list[tuple[int, int]], heads: tuple[int, int], block_size: int,
                        new_keys: bool) -> None:
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [q for q, _ in batch], [s for _, s in batch]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    tables = random_block_tables(seq_lens, block_size, num_blocks, generator)
    cache_shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)  # stale garbage
    scale = HEAD_DIM ** -0.5

    full_q, full_k, full_v = [], [], []
    for seq_len, _table in zip(seq_lens, tables, strict=True):
        full_q.append(torch.randn(seq_len, num_heads, HEAD_DIM, generator=generator))
        full_k.append(torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=generator))
        full_v.append(torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=generator))
    # Earlier steps already cached each sequence's context before its new tokens.
    for q_len, seq_len, table, k, v in zip(query_lens, seq_lens, tables, full_k, full_v,
                                           strict=True):
        if seq_len > q_len:
            past = AttentionMetadata.build([seq_len - q_len], [seq_len - q_len], [table],
                                           block_size)
            store_kv(k[:-q_len], v[:-q_len], k_cache, v_cache, past.slot_mapping)

    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.cat([x[-n:] for x, n in zip(full_q, query_lens, strict=True)])
    k = torch.cat([x[-n:] for x, n in zip(full_k, query_lens, strict=True)])
    v = torch.cat([x[-n:] for x, n in zip(full_v, query_lens, strict=True)])
    if new_keys:  # what model layers call: store, then attend with the step's keys at hand
        out = attention(q, k, v, k_cache, v_cache, meta, scale)
    else:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, scale)

    assert out.shape == (sum(query_lens), num_heads, HEAD_DIM)
    outputs = out.split(query_lens)
    for i, (q_len, sq, sk, sv) in enumerate(zip(query_lens, full_q, full_k, full_v,
                                                strict=True)):
        expected = reference_attention(sq[-q_len:], sk, sv, scale)
        assert rel_error(outputs[i], expected) < 1e-5, f"sequence {i}"


def test_store_kv_writes_exactly_the_slots() -> None:
    num_blocks, block_size, num_kv_heads = 5, 4, 2
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 2, 9, 3, 12])
    k = torch.randn(len(slots), num_kv_heads, HEAD_DIM)
    v = torch.randn(len(slots), num_kv_heads, HEAD_DIM)
    store_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // block_size, slot % block_size], k[i])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], v[i])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    assert not k_cache.view(-1, num_kv_heads, HEAD_DIM)[~written].any()
    assert not v_cache.view(-1, num_kv_heads, HEAD_DIM)[~written].any()


def test_build_metadata() -> None:
    # A 6-token sequence in blocks [3, 1] computed 4 tokens before; a decode at position 2.
    meta = AttentionMetadata.build([2, 1], [6, 3], [[3, 1], [0]], block_size=4)
    assert meta.slot_mapping.tolist() == [4 * 1 + 0, 4 * 1 + 1, 0 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.seq_lens.tolist() == [6, 3]
    assert meta.block_tables.tolist() == [[3, 1], [0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (2, 6)
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="bad sequence"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)
