"""The step builder lays every token where the paged cache says it lives, for any mix of prefills,
chunk continuations and decodes (checked against the definition, token by token)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.runner.step_metadata import AttentionMetadata, SequenceChunk, build_step_inputs, padded_tables


def by_definition(chunks: list[SequenceChunk], block_size: int) -> dict[str, list]:
    """What each field must hold, written one token at a time."""
    slots, input_ids, positions, starts, sample_indices = [], [], [], [0], []
    for chunk in chunks:
        end = chunk.start + len(chunk.token_ids)
        for position in range(chunk.start, end):
            slots.append(chunk.block_table[position // block_size] * block_size + position % block_size)
            positions.append(position)
        input_ids += chunk.token_ids
        starts.append(len(input_ids))
        if chunk.sample_id is not None:
            sample_indices.append(len(input_ids) - 1)
    widest = max(len(chunk.block_table) for chunk in chunks)
    return {
        "slot_mapping": slots, "input_ids": input_ids, "positions": positions, "query_start_loc": starts,
        "seq_lens": [chunk.start + len(chunk.token_ids) for chunk in chunks],
        "block_tables": [chunk.block_table + [0] * (widest - len(chunk.block_table)) for chunk in chunks],
        "sample_indices": sample_indices,
    }


def random_step(rng: random.Random, block_size: int, decode_only: bool) -> list[SequenceChunk]:
    chunks = []
    for i in range(rng.randint(1, 12)):
        start = rng.randint(0, 90)
        count = 1 if decode_only else rng.choice([1, rng.randint(1, 40)])
        blocks = -(-(start + count) // block_size) + rng.randint(0, 2)  # spare blocks past the end
        chunks.append(SequenceChunk(token_ids=[rng.randrange(1000) for _ in range(count)], start=start,
                                    block_table=rng.sample(range(4096), blocks),
                                    sample_id=f"r{i}" if rng.random() < 0.7 else None))
    return chunks


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_every_token_lands_where_its_block_table_says(block_size: int, decode_only: bool) -> None:
    rng = random.Random(block_size * 2 + decode_only)
    for _ in range(50):
        chunks = random_step(rng, block_size, decode_only)
        step = build_step_inputs(chunks, block_size)
        want = by_definition(chunks, block_size)
        meta = step.meta
        assert meta.slot_mapping.tolist() == want["slot_mapping"]
        assert step.input_ids.tolist() == want["input_ids"]
        assert step.positions.tolist() == want["positions"]
        assert meta.query_start_loc.tolist() == want["query_start_loc"]
        assert meta.seq_lens.tolist() == want["seq_lens"]
        assert meta.block_tables.tolist() == want["block_tables"]
        assert step.sample_indices == want["sample_indices"]
        assert step.sample_request_ids == [c.sample_id for c in chunks if c.sample_id is not None]
        assert meta.max_query_len == max(len(c.token_ids) for c in chunks)
        assert meta.max_seq_len == max(want["seq_lens"])
        assert meta.is_pure_decode == all(len(c.token_ids) == 1 for c in chunks)
        # The dtypes the kernels and the CUDA-graph buffers take.
        assert (meta.slot_mapping.dtype, step.input_ids.dtype, step.positions.dtype) == (torch.int64,) * 3
        assert (meta.query_start_loc.dtype, meta.seq_lens.dtype, meta.block_tables.dtype) == (torch.int32,) * 3


def test_a_sequence_longer_than_its_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="2 blocks of 4"):
        AttentionMetadata.build([1], [9], [[3, 7]], block_size=4)
    with pytest.raises(ValueError, match="query_len 0"):
        AttentionMetadata.build([0], [4], [[3]], block_size=4)


@pytest.mark.parametrize("lengths", [[3, 3, 3], [8192, 2, 5, 1], [1], [4, 1, 7]])
def test_block_tables_are_padded_with_zeros_to_the_longest(lengths: list[int]) -> None:
    tables = [[1000 * row + b + 1 for b in range(n)] for row, n in enumerate(lengths)]
    padded = padded_tables(tables)
    assert padded.shape == (len(lengths), max(lengths)) and padded.dtype.name == "int32"
    for row, table in enumerate(tables):
        assert padded[row, :len(table)].tolist() == table
        assert not padded[row, len(table):].any()
