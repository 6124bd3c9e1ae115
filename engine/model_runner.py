"""Tensors for one scheduler step: flatten the batch, run the model over the paged KV cache, sample.

The scheduler decides which tokens of which requests run; this module turns that decision into
`input_ids`, `positions`, `slot_mapping`, `query_start_loc` (cu_seqlens), `seq_lens` and
`block_tables`, owns the per-layer KV cache tensors and the per-request sampling generators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.protocol import TokenLogprob
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.scheduler import SchedulerOutput
from engine.state_cache import HybridCaches, LinearStateCache

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V for every full-attention layer: 2 × layers × kv heads × head_dim × element size.
    A hybrid model's linear-attention layers keep a per-sequence state instead, not per token
    (a model with no full-attention layer at all is sized as if it had one, to keep the pool small)."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = max(config.num_attention_layers, 1)
    return 2 * layers * config.num_key_value_heads * config.head_dim * element


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits are sampled (the last new token of a request).
    sample_indices: list[int]
    sample_request_ids: list[str]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_state_slots: int = 0) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Set by EngineCore on CUDA (engine.cuda_graphs); pure decode steps replay from it.
        self.decode_graphs: DecodeGraphs | None = None
        # Set by EngineCore: masks the logits rows of grammar-constrained requests in place
        # (engine.structured_output), given each row's request id.
        self.mask_logits: Callable[[torch.Tensor, list[str]], None] | None = None
        self._generators: dict[str, torch.Generator] = {}
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # One (k_cache, v_cache) pair per full-attention layer:
        # [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_caches: KVCaches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_attention_layers)
        ]
        # --- hybrid models: linear-attention state slots beside the KV cache ---
        self.hybrid_caches: HybridCaches | None = None
        state_shape = getattr(model, "linear_state_shape", None)
        if state_shape is not None:
            states = LinearStateCache(state_shape, max(num_state_slots, 1), dtype, device)
            self.hybrid_caches = HybridCaches(kv=self.kv_caches, states=states)
        # --- end hybrid ---

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_indices: list[int] = []
        sample_request_ids: list[str] = []
        for scheduled in step.scheduled:
            request = scheduled.request
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slot_mapping.extend(blocks[pos // bs] * bs + pos % bs for pos in range(start, end))
            query_start_loc.append(query_start_loc[-1] + scheduled.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(blocks)
            if scheduled.sample:
                sample_indices.append(query_start_loc[-1] - 1)
                sample_request_ids.append(request.request_id)
        max_blocks = max(len(b) for b in block_tables)
        padded = [b + [0] * (max_blocks - len(b)) for b in block_tables]

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slot_mapping, torch.int64),
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded, torch.int32),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            meta=meta,
            sample_indices=sample_indices,
            sample_request_ids=sample_request_ids,
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Run one step; returns the sampled token (and logprobs) of each request that samples."""
        inputs = self.prepare(step)
        caches: KVCaches | HybridCaches = self.kv_caches
        if self.hybrid_caches is not None:  # hybrid: each sequence's state slot, in batch order
            slots = [s.request.state_slot for s in step.scheduled]
            self.hybrid_caches.slot_indices = torch.tensor(slots, dtype=torch.int32, device=self.device)
            caches = self.hybrid_caches
        # Decode graphs are captured for KV-only models (EngineCore never captures for hybrids).
        hidden = self.decode_graphs.replay(inputs) if self.decode_graphs is not None else None
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta)
        if not inputs.sample_indices:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        if self.mask_logits is not None:
            self.mask_logits(logits, inputs.sample_request_ids)
        by_id = {s.request.request_id: s.request for s in step.scheduled}
        rows = []
        for request_id in inputs.sample_request_ids:
            request = by_id[request_id]
            rows.append(
                SamplingRow(
                    options=request.sampling,
                    generator=self._generator(request_id, request.sampling.seed),
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    eos_token_ids=request.eos_token_ids,
                )
            )
        sampled = self.sampler(logits, rows)
        return {
            request_id: (token, logprob)
            for request_id, token, logprob in zip(inputs.sample_request_ids, sampled.token_ids, sampled.logprobs)
        }

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        # A seeded request draws only from its own generator, so its text never depends on
        # which other requests share the batch.
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = make_generator(seed, self.device)
            self._generators[request_id] = generator
        return generator

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
