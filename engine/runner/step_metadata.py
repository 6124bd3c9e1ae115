"""What one engine step hands the model: flat token inputs plus where each token lives in the paged KV cache.

The model runner lays a scheduler step out as `SequenceChunk`s (one per sequence: its next tokens, how many
of its tokens the cache holds already, its block table) and `build_step_inputs` turns them into the
tensors the model takes: `input_ids`, `positions` and the `AttentionMetadata` (`slot_mapping`,
`query_start_loc` (cu_seqlens), `seq_lens`, `block_tables`). That builder is the one every caller uses:
the runner, the CUDA-graph buffers' tests, the model tests that drive a paged cache by hand.

A cache is [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`, i.e. flat slot `block_id * block_size + offset`.
Tokens are flat: sequence i owns rows query_start_loc[i]:query_start_loc[i+1], and those rows are its
last query_len positions of seq_lens[i]. One batch mixes whole prefills, chunked-prefill continuations
and decodes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.runner.attention_plan import AttentionPlan, PrefillSeq

# One (k_cache, v_cache) pair per full-attention layer, each [num_blocks, block_size, num_kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]
KVCaches = list[KVCache]


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each of them may attend to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32, context per sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of the query and context lengths (`build` sets them; None where the metadata
    # lives on the device only, as in the CUDA-graph buffers): what picks the step's long chunk
    # continuations for SDPA on the Triton path without reading the device.
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # The torch path's split of the step (engine.runner.attention_plan), built on the first layer's
    # call and shared by the rest of the step (same for every layer).
    _plan: AttentionPlan | None = field(default=None, init=False, repr=False)
    # The Triton path's long chunk continuations, attended by SDPA (engine.runner.attention.sdpa_chunks).
    _sdpa_chunks: list[PrefillSeq] | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """From host lists: each sequence's new-token count, total length and block ids."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty, same length")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(f"bad sequence: query_len {q_len}, seq_len {s_len}, "
                                 f"{len(table)} blocks of {block_size}")
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(s_len - q_len, s_len)]
        tables = padded_tables(block_tables)
        cu_seqlens = [0]
        for q_len in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + q_len)
        return cls(
            slot_mapping=as_tensor(slots, np.int64, device),
            query_start_loc=as_tensor(cu_seqlens, np.int32, device),
            seq_lens=as_tensor(seq_lens, np.int32, device),
            block_tables=as_tensor(tables, np.int32, device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


def padded_tables(block_tables: list[list[int]]) -> np.ndarray:
    """[sequences, most blocks] int32, each table padded with zeros: the tables are read once, in
    one pass, and the padding is numpy's (one long sequence beside many short ones pads every row
    to its length: 256 rows beside one of 8,192 blocks took 53 ms as Python lists, 0.9 ms so)."""
    rows = len(block_tables)
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=rows)
    max_blocks = int(lengths.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    if flat.shape[0] == rows * max_blocks:  # no padding: every table as long
        return flat.reshape(rows, max_blocks)
    tables = np.zeros((rows, max_blocks), dtype=np.int32)
    tables[np.arange(max_blocks) < lengths[:, None]] = flat
    return tables


def as_tensor(values: list[int] | np.ndarray, dtype: type[np.integer], device: torch.device | str) -> torch.Tensor:
    """Host integers as a tensor on `device`, through numpy: it reads a Python list several times
    faster than torch.tensor does, and on a GPU the device waits for this host work each step."""
    tensor = torch.from_numpy(np.asarray(values, dtype=dtype))
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """One sequence's share of a step: `token_ids` at positions start.., over `block_table`."""

    token_ids: list[int]
    # Tokens of this sequence already in the cache (the first new token's position).
    start: int
    block_table: list[int]
    # The request whose next token is sampled from this chunk's last row; None: no sample.
    sample_id: str | None = None
    # A hybrid model's state slot for this sequence (engine.runner.state_cache); -1: none.
    state_slot: int = -1


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits are sampled (the last new token of a request).
    sample_indices: list[int]
    sample_request_ids: list[str]


def build_step_inputs(chunks: list[SequenceChunk], block_size: int,
                      device: torch.device | str = "cpu") -> StepInputs:
    """The step's flat inputs and metadata, sequences in the order given."""
    query_lens = [len(chunk.token_ids) for chunk in chunks]
    seq_lens = [chunk.start + n for chunk, n in zip(chunks, query_lens, strict=True)]
    meta = AttentionMetadata.build(query_lens, seq_lens, [chunk.block_table for chunk in chunks],
                                   block_size, device)
    input_ids: list[int] = []
    positions: list[int] = []
    sample_indices: list[int] = []
    sample_request_ids: list[str] = []
    for chunk, seq_len in zip(chunks, seq_lens, strict=True):
        input_ids += chunk.token_ids
        positions += range(chunk.start, seq_len)
        if chunk.sample_id is not None:
            sample_indices.append(len(input_ids) - 1)
            sample_request_ids.append(chunk.sample_id)
    return StepInputs(
        input_ids=as_tensor(input_ids, np.int64, device),
        positions=as_tensor(positions, np.int64, device),
        meta=meta,
        sample_indices=sample_indices,
        sample_request_ids=sample_request_ids,
    )
