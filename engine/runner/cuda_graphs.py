"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed.

A decode step launches a few kernels per layer on a handful of rows, so on a GPU its time is
mostly launch overhead; replaying a captured graph removes it. A graph fixes its tensors'
addresses and shapes, so:

- the step's inputs are copied into static buffers sized for the largest bucket;
- a batch of n sequences runs the smallest bucket >= n, its extra rows padding: token 0 at
  position 0, KV slot -1 (the KV store skips it), context length 1 over block 0 (read only,
  its result dropped);
- block tables are `max_blocks_per_seq` wide (max_model_len / block_size), zero-filled past
  each sequence's own blocks;
- only pure decode steps (one query per sequence) replay; prefills and mixed steps, and
  batches larger than the largest bucket, run eagerly;
- a hybrid model (linear-attention layers, `engine.runner.state_cache.HybridCaches`) reads each row's
  state slot from a static buffer too, and padding rows have slot -1, which the conv and
  delta-rule ops skip: no sequence's state moves (their output rows are left undefined, and
  every op is row by row, so they reach no real row).

Graphs need the Triton ops (the PyTorch references synchronise with the host), so they are
used only on CUDA with the Triton backend, and never on CPU. `EngineConfig.cuda_graphs`
turns them off; the model runner decides and captures.
"""

from __future__ import annotations

import logging

import torch

from engine.runner import ops
from engine.runner.state_cache import HybridCaches
from engine.runner.step_metadata import AttentionMetadata, KVCaches, StepInputs

log = logging.getLogger("helexa.engine")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


def pick_bucket(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None when none does."""
    return next((b for b in buckets if b >= num_seqs), None)


def graphs_wanted(enabled: bool, device: torch.device) -> bool:
    """Whether an engine on `device` should capture decode graphs."""
    return enabled and device.type == "cuda" and ops.backend_for(device) == "triton"


class DecodeBuffers:
    """Static decode inputs for up to `max_num_seqs` sequences, and their padding."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_num_seqs, self.max_blocks_per_seq = max_num_seqs, max_blocks_per_seq
        self.block_size = block_size
        self.input_ids = zeros(max_num_seqs, dtype=torch.int64)
        self.positions = zeros(max_num_seqs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, device=device)
        # One query per sequence, padding included: the cu_seqlens never change.
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32)
        # A hybrid model's state slot per row; -1 (padding) is skipped by its ops.
        self.slot_indices = torch.full((max_num_seqs,), -1, dtype=torch.int32, device=device)

    def fits(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        return (meta.is_pure_decode and meta.num_seqs <= self.max_num_seqs
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq)

    def fill(self, inputs: StepInputs, bucket: int, slot_indices: torch.Tensor | None = None) -> None:
        """Copy a pure decode step's n rows in (and a hybrid model's state slots, [n] int32) and
        pad rows n..bucket (see the module doc)."""
        meta = inputs.meta
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        if slot_indices is not None:
            self.slot_indices[:n].copy_(slot_indices)
            self.slot_indices[n:bucket].fill_(-1)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:n].copy_(inputs.positions)
        self.positions[n:bucket].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bucket].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:bucket].zero_()

    def pad(self, bucket: int) -> None:
        """All rows padding: what warm-up and capture run on (writes no KV)."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].fill_(1)
        self.block_tables[:bucket].zero_()
        self.slot_indices[:bucket].fill_(-1)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Views of the first `bucket` rows. max_seq_len is the table's capacity: a host int
        must not change between replays (the Triton attention reads seq_lens instead)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
        )


class DecodeGraphs:
    """One captured decode forward per bucket, sharing one memory pool and one set of buffers."""

    def __init__(self, model: torch.nn.Module, caches: KVCaches | HybridCaches,
                 buffers: DecodeBuffers, buckets: list[int]) -> None:
        self.model, self.caches, self.buffers = model, caches, buffers
        self.buckets = buckets
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def capture(cls, model: torch.nn.Module, caches: KVCaches | HybridCaches, max_num_seqs: int,
                max_model_len: int, block_size: int, device: torch.device) -> DecodeGraphs:
        buffers = DecodeBuffers(max_num_seqs, -(-max_model_len // block_size), block_size, device)
        graphs = cls(model, caches, buffers, bucket_sizes(max_num_seqs))
        graphs._capture_all()
        return graphs

    def bucket_caches(self, bucket: int) -> KVCaches | HybridCaches:
        """What the bucket's forward reads: the KV caches, or for a hybrid model the same caches
        and states with the static buffer's first `bucket` slots."""
        if isinstance(self.caches, HybridCaches):
            return HybridCaches(kv=self.caches.kv, states=self.caches.states,
                                slot_indices=self.buffers.slot_indices[:bucket])
        return self.caches

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:bucket], b.positions[:bucket], self.bucket_caches(bucket),
                          b.metadata(bucket))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Largest first: smaller graphs then fit in the memory the larger one left in the pool.
        for bucket in sorted(self.buckets, reverse=True):
            self.buffers.pad(bucket)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and build lazy tables outside capture
                    self._forward(bucket)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._outputs[bucket] = self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def replay(self, inputs: StepInputs, slot_indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states [bucket, hidden] whose first rows are the step's, or None when this
        step must run eagerly (not a pure decode, or larger than every bucket). A hybrid
        model's step gives its rows' state slots."""
        if not self.buffers.fits(inputs):
            return None
        bucket = pick_bucket(inputs.meta.num_seqs, self.buckets)
        if bucket is None:
            return None
        if isinstance(self.caches, HybridCaches) and slot_indices is None:
            raise ValueError("a hybrid model's decode graph needs the rows' state slots")
        self.buffers.fill(inputs, bucket, slot_indices)
        self._graphs[bucket].replay()
        return self._outputs[bucket]
