"""The CPU paged attention does the batch's work, not its padding (counted FLOPs, no timing).

Unpadded work of a sequence with q new queries over s keys is the q × s rectangle of scores and
of weighted values: 4·heads·q·s·head_dim FLOPs, what one SDPA call over exactly its own keys
costs (the counter does not discount a causal mask, so a whole prefill counts its full square).
Both decode paths are counted: the CPU decode kernel (its loops run over each row's own
seq_len keys, read from its arguments) and the SDPA length buckets it replaces where it cannot
be built.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from engine.runner.attention import AttentionMetadata, paged_attention
from engine.runner.attention_plan import build_plan, decode_buckets

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
aten = torch.ops.aten


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _decode_kernel_flops(out, q, k_cache, v_cache, block_tables, seq_lens, token_rows, seq_rows,
                         scale, out_val=None) -> int:
    """What the kernel's loops do: each row scores and sums its own seq_len keys, every head."""
    keys = int(seq_lens.long()[seq_rows].sum())
    return 4 * q.shape[1] * keys * q.shape[2]


_decode_kernel_flops._get_raw = True  # FlopCounterMode hands it the tensors, not their shapes


def counted_ops() -> dict:
    """FlopCounterMode knows the CUDA SDPA kernels; the CPU flash kernel counts the same way, and
    the decode kernel (registered once it is loaded) by its loops."""
    ops = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops}
    if hasattr(torch.ops.helexa_cpu, "paged_decode_attention"):
        ops[torch.ops.helexa_cpu.paged_decode_attention] = _decode_kernel_flops
    return ops



def unpadded_flops(batch: list[tuple[int, int]]) -> int:
    return sum(4 * NUM_HEADS * q * s * HEAD_DIM for q, s in batch)


def causal_flops(batch: list[tuple[int, int]]) -> int:
    """Each query over exactly the keys up to its own position: what the CPU kernel does for the
    rows of a short continuation, the least any path can count."""
    keys = sum(q * s - q * (q - 1) // 2 for q, s in batch)
    return 4 * NUM_HEADS * keys * HEAD_DIM


def attention_flops(batch: list[tuple[int, int]], pass_new_keys: bool, decode_kernel: bool) -> int:
    query_lens, seq_lens = [q for q, _ in batch], [s for _, s in batch]
    tables, next_block = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = torch.randn(next_block, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM) if pass_new_keys else None
    with FlopCounterMode(display=False, custom_mapping=counted_ops()) as counter:
        out = paged_attention(q, cache, cache, meta, HEAD_DIM ** -0.5, k, v, decode_kernel)
    assert out.shape == q.shape and torch.isfinite(out).all()
    return counter.get_total_flops()


# 15 decodes, every context length different (40..600), beside one 512-token chunk.
DECODES = [(1, 40 + 40 * i) for i in range(15)]
MIXED = {
    "chunk-continuation": [(512, 812)] + DECODES,
    "whole-prefill": DECODES[:7] + [(512, 512)] + DECODES[7:],
    "two-chunks": [(256, 256), (128, 900)] + DECODES,
    # Prompts mostly held by the prefix cache: short continuations (the CPU kernel's rows).
    "cached-prompts": [(16, 128)] * 8 + DECODES,
}


@pytest.mark.parametrize("pass_new_keys", [True, False], ids=["new-keys", "cache-only"])
@pytest.mark.parametrize("batch", list(MIXED.values()), ids=list(MIXED))
def test_mixed_step_does_at_most_1_2x_the_unpadded_attention_flops(
        batch: list[tuple[int, int]], pass_new_keys: bool, decode_path: bool) -> None:
    counted, unpadded = attention_flops(batch, pass_new_keys, decode_path), unpadded_flops(batch)
    # The lower bound proves the counter saw the attention at all.
    assert causal_flops(batch) * 0.99 <= counted <= unpadded * 1.2, f"{counted / unpadded:.2f}x the unpadded FLOPs"


def test_decode_only_step_of_spread_lengths_pads_little(decode_path: bool) -> None:
    batch = [(1, 30 + 97 * i) for i in range(16)]
    counted, unpadded = attention_flops(batch, True, decode_path), unpadded_flops(batch)
    assert unpadded * 0.99 <= counted <= unpadded * 1.35


def test_decode_buckets_group_near_lengths_and_split_far_ones() -> None:
    # Equal lengths share one bucket, in any order; a fixed cost of 256 keys per bucket.
    assert decode_buckets([100, 100, 100]) == [[0, 1, 2]]
    # 4 rows of ~1000 and 4 of ~10: padding the short ones to 1000 would cost 4 × 990 keys.
    assert decode_buckets([1000, 10, 990, 12, 1001, 9, 995, 11]) == [[5, 1, 7, 3], [2, 6, 0, 4]]
    # Short rows padded to each other rather than paying another bucket.
    assert decode_buckets([5, 40, 17]) == [[0, 2, 1]]
    assert decode_buckets([7]) == [[0]]


def test_the_cpu_kernel_takes_decodes_and_short_continuations_and_sdpa_the_rest() -> None:
    """A prompt the prefix cache mostly held (16 new of 128), a decode, a long chunk and a whole
    prefill: the kernel's rows are the first two, each query over the keys up to its position."""
    batch = [(16, 128), (1, 40), (256, 1024), (8, 8)]
    tables, next_block = [], 0
    for _, s in batch:
        tables.append(list(range(next_block, next_block - (-s // BLOCK_SIZE))))
        next_block = tables[-1][-1] + 1
    meta = AttentionMetadata.build([q for q, _ in batch], [s for _, s in batch], tables, BLOCK_SIZE)
    plan = build_plan(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                      BLOCK_SIZE, torch.device("cpu"), decode_kernel=True)
    rows = plan.kernel_rows
    assert rows is not None
    assert rows.token_rows.tolist() == list(range(17))
    assert rows.key_lens.tolist() == list(range(113, 129)) + [40]
    assert rows.block_tables.tolist() == [meta.block_tables[0].tolist()] * 16 + [meta.block_tables[1].tolist()]
    assert [(seq.start, seq.end) for seq in plan.prefill] == [(17, 273), (273, 281)]
