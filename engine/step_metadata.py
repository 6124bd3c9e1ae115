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

from dataclasses import dataclass, field

import torch

from engine.attention_plan import AttentionPlan, PrefillSeq

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
    # The torch path's split of the step (engine.attention_plan), built on the first layer's
    # call and shared by the rest of the step (same for every layer).
    _plan: AttentionPlan | None = field(default=None, init=False, repr=False)
    # The Triton path's long chunk continuations, attended by SDPA (engine.attention.sdpa_chunks).
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
        fields = _metadata_fields(query_lens, seq_lens, block_tables, block_size)
        return cls.from_fields(query_lens, seq_lens, upload(fields, device))

    @classmethod
    def from_fields(cls, query_lens: list[int], seq_lens: list[int],
                    tensors: list[torch.Tensor]) -> AttentionMetadata:
        """From the host lengths and `_metadata_fields`' four tensors, on their device."""
        slot_mapping, query_start_loc, seq_lens_t, block_tables = tensors
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


# A host list, or a list of equal-length rows, and the dtype its tensor gets.
HostField = tuple[list[int] | list[list[int]], torch.dtype]


def _metadata_fields(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                     block_size: int) -> list[HostField]:
    """slot_mapping, query_start_loc, seq_lens and the padded block tables, as host lists."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
        raise ValueError("query_lens, seq_lens and block_tables must be non-empty, same length")
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 1 <= q_len <= s_len or len(table) * block_size < s_len:
            raise ValueError(f"bad sequence: query_len {q_len}, seq_len {s_len}, "
                             f"{len(table)} blocks of {block_size}")
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(s_len - q_len, s_len)]
    max_blocks = max(len(table) for table in block_tables)
    padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    cu_seqlens = [0]
    for q_len in query_lens:
        cu_seqlens.append(cu_seqlens[-1] + q_len)
    return [(slots, torch.int64), (cu_seqlens, torch.int32), (list(seq_lens), torch.int32),
            (padded_tables, torch.int32)]


def upload(fields: list[HostField], device: torch.device | str) -> list[torch.Tensor]:
    """The host lists as tensors on `device`, in order.

    On CUDA they travel together, in one copy from pinned memory that the host does not wait
    for: a tensor built on the device from a list is a synchronous copy of its own (a decode
    step made six, each a round trip while the device idled). Elsewhere, one tensor each."""
    if torch.device(device).type != "cuda":
        return [torch.tensor(values, dtype=dtype, device=device) for values, dtype in fields]
    packed, views = pack([torch.tensor(values, dtype=dtype) for values, dtype in fields],
                         pin_memory=True)
    # The copy is queued on the current stream, before any kernel that reads it; the pinned
    # block goes back to torch's host cache, which reuses it only once the copy is done.
    on_device = packed.to(device, non_blocking=True)
    return [on_device[start:end].view(dtype).view(shape) for start, end, dtype, shape in views]


def pack(tensors: list[torch.Tensor], pin_memory: bool = False) -> tuple[
        torch.Tensor, list[tuple[int, int, torch.dtype, torch.Size]]]:
    """Host tensors copied into one byte buffer (widest dtypes first, so every one starts at a
    multiple of its element size), and where each lies: (start, end, dtype, shape) per tensor,
    in the order given."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    starts, offset = {}, 0
    for i in order:
        starts[i] = offset
        offset += tensors[i].numel() * tensors[i].element_size()
    packed = torch.empty(offset, dtype=torch.uint8, pin_memory=pin_memory)
    spans = []
    for i, tensor in enumerate(tensors):
        start, end = starts[i], starts[i] + tensor.numel() * tensor.element_size()
        packed[start:end].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        spans.append((start, end, tensor.dtype, tensor.shape))
    return packed, spans


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """One sequence's share of a step: `token_ids` at positions start.., over `block_table`."""

    token_ids: list[int]
    # Tokens of this sequence already in the cache (the first new token's position).
    start: int
    block_table: list[int]
    # The request whose next token is sampled from this chunk's last row; None: no sample.
    sample_id: str | None = None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits are sampled (the last new token of a request).
    sample_indices: list[int]
    sample_request_ids: list[str]
    # A hybrid model's linear-attention state slot per sequence [num_seqs] int32, in batch order.
    state_slots: torch.Tensor | None = None


def build_step_inputs(chunks: list[SequenceChunk], block_size: int,
                      device: torch.device | str = "cpu",
                      state_slots: list[int] | None = None) -> StepInputs:
    """The step's flat inputs and metadata, sequences in the order given (and a hybrid model's
    state slots, one per chunk), all sent to `device` at once (`upload`)."""
    query_lens = [len(chunk.token_ids) for chunk in chunks]
    seq_lens = [chunk.start + n for chunk, n in zip(chunks, query_lens, strict=True)]
    fields = _metadata_fields(query_lens, seq_lens, [chunk.block_table for chunk in chunks],
                              block_size)
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
    fields += [(input_ids, torch.int64), (positions, torch.int64)]
    if state_slots is not None:
        if len(state_slots) != len(chunks):
            raise ValueError("one state slot per sequence")
        fields.append((state_slots, torch.int32))
    tensors = upload(fields, device)
    return StepInputs(
        input_ids=tensors[4],
        positions=tensors[5],
        meta=AttentionMetadata.from_fields(query_lens, seq_lens, tensors[:4]),
        sample_indices=sample_indices,
        sample_request_ids=sample_request_ids,
        state_slots=tensors[6] if state_slots is not None else None,
    )
