"""The Triton paged attention (and its split-K decode) against the loop-per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention import paged_attention as engine_paged_attention
from engine.runner.step_metadata import AttentionMetadata
from helexa_kernels.kv_store import naive_kv_store
from helexa_kernels.paged_attention import naive_paged_attention, paged_attention
from tests.kernels.helpers import DEVICE, assert_close, tol_for

# (query_lens, seq_lens): what each sequence adds this step and its context after it.
BATCHES = [
    pytest.param([1, 1, 1], [1, 9, 30], id="decode"),
    pytest.param([7, 20, 3], [7, 20, 3], id="prefill-varlen"),
    pytest.param([5, 1, 12, 1], [21, 8, 12, 33], id="mixed-chunked-continuation"),
]
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(8, 2, id="gqa4"),
         pytest.param(6, 2, id="gqa3")]


def _case(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
          head_dim: int, block_size: int, dtype: torch.dtype):
    """Random caches holding every sequence's keys through shuffled block tables."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(ids[used:used + n])
        used += n
    meta = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size, DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros(shape, device=DEVICE, dtype=dtype)
    total = sum(seq_lens)
    naive_kv_store(torch.randn(total, num_kv_heads, head_dim, device=DEVICE),
                   torch.randn(total, num_kv_heads, head_dim, device=DEVICE),
                   k_cache, v_cache, meta.slot_mapping)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, meta


def _args(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    return meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("query_lens,seq_lens", BATCHES)
def test_paged_attention(query_lens: list[int], seq_lens: list[int], num_heads: int,
                         num_kv_heads: int, dtype: torch.dtype) -> None:
    q, k_cache, v_cache, meta = _case(query_lens, seq_lens, num_heads, num_kv_heads, 16, 4, dtype)
    scale = 16 ** -0.5
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), scale)
    # Small tiles so the tiny cases still cross several query and key tiles.
    out = paged_attention(q, k_cache, v_cache, *_args(meta), scale, block_m=16, block_n=16)
    assert_close(out, ref, tol_for(dtype))


@pytest.mark.parametrize("num_splits", [2, 3, 8], ids=lambda n: f"{n}-splits")
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("seq_lens", [pytest.param([1, 9, 30, 70], id="ragged"),
                                      pytest.param([1], id="one-key"),
                                      pytest.param([64, 64], id="whole-tiles")])
def test_split_decode(seq_lens: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                      num_splits: int) -> None:
    """Keys split into ranges and merged: with 16-key tiles, 8 splits leave the short sequences'
    last ranges empty (70 keys fill 5 tiles; 1 key fills one)."""
    q, k_cache, v_cache, meta = _case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 16,
                                      4, dtype)
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.25)
    out = paged_attention(q, k_cache, v_cache, *_args(meta), 0.25, block_n=16,
                          num_splits=num_splits)
    assert_close(out, ref, tol_for(dtype))


def test_split_decode_reads_strided_queries() -> None:
    """q as a packed qkv projection hands it over: a view whose rows are wider than its heads."""
    _, k_cache, v_cache, meta = _case([1, 1], [23, 5], 8, 2, 16, 4, torch.float32)
    q = torch.randn(2, 8 + 2 * 2, 16, device=DEVICE)[:, :8]
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.25)
    out = paged_attention(q, k_cache, v_cache, *_args(meta), 0.25, block_n=16, num_splits=4)
    assert_close(out, ref, 1e-5)


def test_long_chunks_are_left_to_the_caller() -> None:
    """skip_chunks_from=4: sequence 0 (5 queries after 16 cached keys) is left unwritten; the
    whole prefill of 12 and the decodes are attended."""
    q, k_cache, v_cache, meta = _case([5, 1, 12, 1], [21, 8, 12, 33], 8, 2, 16, 4, torch.float32)
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.25)
    out = paged_attention(q, k_cache, v_cache, *_args(meta), 0.25, block_m=16, block_n=16,
                          skip_chunks_from=4)
    assert_close(out[5:], ref[5:], 1e-5)


@pytest.mark.parametrize("min_queries", [4, 10**6], ids=["routed", "kernel-only"])
def test_engine_triton_path_routes_long_chunks(min_queries: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.runner.ops on the Triton path: chunk continuations of at least SDPA_CHUNK_MIN_QUERIES
    queries through SDPA, the rest of the step through the kernel, one correct output."""
    from engine.runner import attention_plan, ops

    monkeypatch.setattr(attention_plan, "SDPA_CHUNK_MIN_QUERIES", min_queries)
    routed: list[tuple[int, int]] = []
    real = ops.attend_chunks
    monkeypatch.setattr(ops, "attend_chunks", lambda out, q, kc, vc, chunks, scale: (
        routed.extend((seq.start, seq.end) for seq in chunks), real(out, q, kc, vc, chunks, scale)))
    # Rows: seq 0 0:5 (a continuation), 1 a decode, 2 6:18 (a whole prefill), 3 a decode,
    # 4 19:25 (a continuation).
    q, k_cache, v_cache, meta = _case([5, 1, 12, 1, 6], [21, 8, 12, 33, 9], 8, 2, 16, 4,
                                      torch.float32)
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.25)
    ops.use_backend("triton")
    out = ops.paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert_close(out, ref, 1e-5)
    assert routed == ([(0, 5), (19, 25)] if min_queries == 4 else [])


def test_decode_splits() -> None:
    from helexa_kernels.paged_attention.triton import MAX_SPLITS, NOMINAL_SMS, decode_splits

    cpu = torch.device("cpu")  # counted as NOMINAL_SMS multiprocessors
    assert decode_splits(64, 8, 4096, cpu) == 1  # the batch fills the GPU alone
    assert decode_splits(1, 2, 4096, cpu) == NOMINAL_SMS  # two waves of programs
    assert decode_splits(1, 1, 10**6, cpu) == min(MAX_SPLITS, 2 * NOMINAL_SMS)
    assert decode_splits(1, 2, 100, cpu) == 2  # at least 64 keys a range
    assert decode_splits(1, 2, 1, cpu) == 1


@pytest.mark.parametrize("query_lens,seq_lens", BATCHES)
def test_naive_equals_the_engine_reference(query_lens: list[int], seq_lens: list[int]) -> None:
    q, k_cache, v_cache, meta = _case(query_lens, seq_lens, 8, 2, 16, 4, torch.float32)
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.25)
    assert_close(engine_paged_attention(q, k_cache, v_cache, meta, 0.25), ref, 1e-5)


def test_varlen_equals_one_sequence_at_a_time() -> None:
    q, k_cache, v_cache, meta = _case([5, 1, 12], [21, 8, 12], 8, 2, 16, 4, torch.float32)
    batched = paged_attention(q, k_cache, v_cache, *_args(meta), 0.25, block_m=16, block_n=16)
    starts = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        one = (torch.tensor([0, starts[i + 1] - starts[i]], dtype=torch.int32, device=DEVICE),
               meta.seq_lens[i:i + 1], meta.block_tables[i:i + 1], starts[i + 1] - starts[i])
        alone = paged_attention(q[starts[i]:starts[i + 1]], k_cache, v_cache, *one, 0.25,
                                block_m=16, block_n=16)
        assert_close(batched[starts[i]:starts[i + 1]], alone, 1e-6, f"seq {i}")


def test_nonpow2_head_dim_and_default_tiles() -> None:
    q, k_cache, v_cache, meta = _case([3, 1], [40, 70], 4, 2, 24, 8, torch.float32)
    ref = naive_paged_attention(q, k_cache, v_cache, *_args(meta), 0.2)
    assert_close(paged_attention(q, k_cache, v_cache, *_args(meta), 0.2), ref, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("query_lens,seq_lens", [
    pytest.param([1] * 64, [4096] * 64, id="decode-64x4096"),
    pytest.param([512] * 8, [512] * 8, id="prefill-8x512"),
    pytest.param([256, 1, 1, 700], [1024, 2000, 17, 700], id="mixed"),
    # Split-K decode: one sequence's 8 kv heads leave most multiprocessors idle otherwise.
    pytest.param([1], [4096], id="decode-1x4096-split"),
    pytest.param([1] * 4, [17, 600, 3000, 64], id="decode-4-ragged-split"),
])
def test_full_size(query_lens: list[int], seq_lens: list[int]) -> None:
    q, k_cache, v_cache, meta = _case(query_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16)
    ref = engine_paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5)
    assert_close(paged_attention(q, k_cache, v_cache, *_args(meta), 128 ** -0.5), ref, 1e-2)
