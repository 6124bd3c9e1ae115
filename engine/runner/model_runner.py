"""The model's device side: its KV pool and state slots, its decode graphs, and one step's forward + sample.

The runner sizes and allocates the paged KV cache (one (k_cache, v_cache) pair per full-attention
layer), on CPU packs the linear weights for oneDNN (`engine.cpu.cpu_linear`) and keeps freed memory
for the next step (`engine.cpu.cpu_memory`) and measures how many threads its steps run fastest on
while serving (`engine.cpu.thread_governor`), decides whether the model is hybrid (linear-attention
layers keep a state slot per sequence, `engine.runner.state_cache`) and captures decode CUDA graphs
where they apply (`engine.runner.cuda_graphs`: CUDA, Triton ops), or on CPU the decode
steps' one-call layer stack (`engine.cpu.cpu_decode_stack`). Each step it lays the
scheduler's decision out with the one step builder (`engine.runner.step_metadata.build_step_inputs`),
runs the model and samples (a seeded request's draw is a function of its seed and the token's
position, `engine.runner.sampler.seeded_uniform`).

In a tensor-parallel group (`engine.runner.tensor_parallel`) the model is one rank's shard: rank 0's
runner sends each step's chunks to the followers before its own forward, and each follower's runner
runs the same forward (`follow`), taking part in the collectives; only rank 0 samples. Decode graphs
and the CPU decode stack run no collectives, so a rank runs layer by layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.scheduler import SchedulerOutput
from engine.cpu import cpu_linear, cpu_memory
from engine.cpu.cpu_decode_stack import CpuDecodeStack
from engine.cpu.thread_governor import ThreadGovernor
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import TokenLogprob
from engine.loading.model_config import ModelConfig
from engine.runner import gpu_linear
from engine.runner.cuda_graphs import DecodeGraphs, graphs_wanted
from engine.runner.sampler import Sampler, SamplingRow
from engine.runner.state_cache import HybridCaches, LinearStateCache
from engine.runner.step_metadata import KVCaches, SequenceChunk, StepInputs, build_step_inputs
from engine.runner.tensor_parallel import Followers, GroupLost, StepTally

log = logging.getLogger("helexa.engine")


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """K and V for every full-attention layer: 2 × layers × kv heads × head_dim × element size
    (one rank's KV heads in a tensor-parallel group).
    A hybrid model's linear-attention layers keep a per-sequence state instead, not per token
    (a model with no full-attention layer at all is sized as if it had one, to keep the pool small)."""
    element = torch.empty((), dtype=dtype).element_size()
    layers = max(config.num_attention_layers, 1)
    return 2 * layers * (config.num_key_value_heads // tensor_parallel) * config.head_dim * element


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str, num_kv_heads: int | None = None) -> KVCaches:
    """One zeroed (k_cache, v_cache) pair per full-attention layer, each
    [num_blocks, block_size, num_kv_heads, head_dim] (this rank's KV heads when given)."""
    shape = (num_blocks, block_size, num_kv_heads or config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_attention_layers)]


def allocate_caches(model: torch.nn.Module, num_blocks: int, block_size: int, num_slots: int,
                    dtype: torch.dtype, device: torch.device | str) -> KVCaches | HybridCaches:
    """What `model`'s forward takes as its caches: the paged KV of its full-attention layers, and
    for a hybrid model (`linear_state_shape`) `num_slots` linear-attention state slots beside it
    in a `HybridCaches`, whose `slot_indices` the caller sets before each forward."""
    kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype, device, model.num_kv_heads)
    state_shape = getattr(model, "linear_state_shape", None)
    if state_shape is None:
        return kv_caches
    return HybridCaches(kv=kv_caches, states=LinearStateCache(state_shape, num_slots, dtype, device))


def decode_rows(step: SchedulerOutput) -> int | None:
    """The step's rows when every one decodes a single token, else None."""
    if all(s.num_new_tokens == 1 and s.sample for s in step.scheduled):
        return len(step.scheduled) or None
    return None


@dataclass(slots=True)
class StepResult:
    # The sampled token (and its logprobs when asked for) of each request whose chunk samples.
    sampled: dict[str, tuple[int, TokenLogprob | None]] = field(default_factory=dict)
    # Requests whose row could not be sampled (the model gave no finite logit): why.
    failed: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, engine: EngineConfig,
                 model_id: str = "") -> None:
        self.model = model
        self.config = config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cpu":
            cpu_linear.prepack_model(model)  # weights are final: pack once for oneDNN
            cpu_memory.keep_freed_memory()  # no page faults for each step's activations
        shard = getattr(model, "shard", None)
        self.tensor_parallel = shard.world if shard is not None else 1
        # Set by the core on rank 0 of a group: the ranks each step's chunks go to.
        self.followers: Followers | None = None
        # This rank's steps and their seconds (engine.runner.tensor_parallel's per-rank step time).
        self.step_tally = StepTally(0)
        self.block_size = engine.block_size
        self.num_blocks = engine.num_kv_blocks or max(engine.kv_cache_bytes // (
            kv_bytes_per_token(config, self.dtype, self.tensor_parallel) * self.block_size), 1)
        positions = config.max_position_embeddings
        # One sequence can never hold more than the whole pool.
        self.max_model_len = min(engine.max_model_len or positions, positions,
                                 self.num_blocks * self.block_size)
        # Hybrid: linear-attention layers keep one state slot per sequence that may run at once.
        caches = allocate_caches(model, self.num_blocks, self.block_size, engine.max_num_seqs,
                                 self.dtype, self.device)
        self.hybrid_caches = caches if isinstance(caches, HybridCaches) else None
        self.kv_caches: KVCaches = caches.kv if isinstance(caches, HybridCaches) else caches
        self.is_hybrid = self.hybrid_caches is not None
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        self.state_bytes = 0 if self.hybrid_caches is None else self.hybrid_caches.states.nbytes
        if self.hybrid_caches is not None:
            log.info("%s: %d linear-attention state slots, %.1f MiB beside the KV cache", model_id,
                     engine.max_num_seqs, engine.max_num_seqs
                     * self.hybrid_caches.states.shape.bytes_per_slot(self.dtype) / (1 << 20))
        # Pure decode steps replay from these when set; batch-1 projections take the Triton
        # one-row product where it measures faster than cuBLAS (engine.runner.gpu_linear), inside them.
        self.decode_graphs: DecodeGraphs | None = None
        self.gemv_choices: dict[str, object] = {}
        if self.device.type == "cuda":
            gpu_linear.clear_gemv(model)
        if graphs_wanted(engine.cuda_graphs, self.device) and self.tensor_parallel == 1:
            self.gemv_choices = gpu_linear.use_gemv_where_faster(model, self.device)
            self.decode_graphs = DecodeGraphs.capture(model, caches,
                                                      engine.max_num_seqs, self.max_model_len,
                                                      self.block_size, self.device)
        # On CPU, decode steps run the whole layer stack in one C++ call where it applies.
        self.cpu_decode_stack = (CpuDecodeStack.build(model, self.kv_caches) if self.device.type == "cpu"
                                 and not self.is_hybrid and self.tensor_parallel == 1 else None)
        # On CPU, how many threads each step runs on, measured while serving (a rank of a group
        # keeps the count its group gave it).
        self.thread_governor = (ThreadGovernor.for_this_process() if self.device.type == "cpu"
                                and self.tensor_parallel == 1 else None)
        self.sampler = Sampler()
        # Set by EngineCore: masks the logits rows of grammar-constrained requests in place
        # (engine.core.structured_output), given each row's request id.
        self.mask_logits: Callable[[torch.Tensor, list[str]], None] | None = None

    def chunks(self, step: SchedulerOutput) -> list[SequenceChunk]:
        """What every rank needs of the step to lay out the same inputs."""
        chunks = []
        for scheduled in step.scheduled:
            request = scheduled.request
            start = request.num_computed_tokens
            chunks.append(SequenceChunk(
                token_ids=request.all_token_ids[start:start + scheduled.num_new_tokens],
                start=start,
                block_table=request.block_ids,
                sample_id=request.request_id if scheduled.sample else None,
                state_slot=-1 if request.state_slot is None else request.state_slot,
            ))
        return chunks

    def forward(self, inputs: StepInputs, caches: KVCaches | HybridCaches) -> torch.Tensor:
        """The step's final hidden states: replayed from a decode graph, run by the CPU decode
        stack, or else the model's forward."""
        hidden = None
        if self.decode_graphs is not None:
            slots = caches.slot_indices if isinstance(caches, HybridCaches) else None
            hidden = self.decode_graphs.replay(inputs, slots)
        elif self.cpu_decode_stack is not None:
            hidden = self.cpu_decode_stack.run(inputs)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta)
        return hidden

    @torch.inference_mode()
    def follow(self, chunks: list[SequenceChunk]) -> None:
        """A follower rank's step: the same forward and LM-head gather as rank 0, nothing sampled."""
        inputs = build_step_inputs(chunks, self.block_size, self.device)
        hidden = self.forward(inputs, self.caches(chunks))
        if inputs.sample_indices:
            self._logits(inputs, hidden)

    def caches(self, chunks: list[SequenceChunk]) -> KVCaches | HybridCaches:
        """What the model's forward takes for these chunks: a hybrid model's caches with each
        sequence's state slot, in batch order."""
        if self.hybrid_caches is None:
            return self.kv_caches
        slots = [chunk.state_slot for chunk in chunks]
        self.hybrid_caches.slot_indices = torch.tensor(slots, dtype=torch.int32, device=self.device)
        return self.hybrid_caches

    def _logits(self, inputs: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        rows = inputs.sample_indices
        # A decode step samples every row in order: a slice, where indexing by a list would copy
        # the list to the device and wait for it (and a graph's output has padding rows after).
        picked = hidden[:len(rows)] if rows == list(range(len(rows))) else hidden[rows]
        return self.model.compute_logits(picked)

    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run one step: the sampled token of each request that samples, or why its row failed. In
        a tensor-parallel group any error is the group's (`GroupLost`): the followers are left
        inside a collective."""
        if self.thread_governor is not None:
            self.thread_governor.begin(decode_rows(step))
        started = time.perf_counter()
        if self.followers is None:
            result = self._execute(step)
        else:
            try:
                chunks = self.chunks(step)
                self.followers.send_step(chunks)
                result = self._execute(step, chunks)
            except GroupLost:
                raise
            except Exception as exc:
                raise GroupLost(f"tensor-parallel step failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - started
        self.step_tally.add(seconds)
        if self.thread_governor is not None:
            self.thread_governor.end(seconds)
        return result

    @property
    def cpu_threads(self) -> int:
        """Threads this rank's steps run on now (the governor moves them); 0 on a GPU."""
        if self.device.type != "cpu":
            return 0
        return self.thread_governor.current if self.thread_governor is not None else torch.get_num_threads()

    def rank_tallies(self) -> list[StepTally]:
        """Every rank's step timings, by rank: this one's, then the followers' last reports."""
        return [self.step_tally, *(self.followers.tallies() if self.followers is not None else [])]

    @torch.inference_mode()
    def _execute(self, step: SchedulerOutput, chunks: list[SequenceChunk] | None = None) -> StepResult:
        chunks = chunks if chunks is not None else self.chunks(step)
        inputs = build_step_inputs(chunks, self.block_size, self.device)
        hidden = self.forward(inputs, self.caches(chunks))
        result = StepResult()
        if not inputs.sample_indices:
            return result
        logits = self._logits(inputs, hidden)
        if self.mask_logits is not None:
            self.mask_logits(logits, inputs.sample_request_ids)
        by_id = {s.request.request_id: s.request for s in step.scheduled}
        rows: list[SamplingRow] = []
        for request_id in inputs.sample_request_ids:
            request = by_id[request_id]
            rows.append(SamplingRow(
                options=request.sampling,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                eos_token_ids=request.eos_token_ids,
                request_id=request_id,
            ))
        sampled = self.sampler(logits, rows)
        for request_id, token, logprob, error in zip(inputs.sample_request_ids, sampled.token_ids,
                                                     sampled.logprobs, sampled.errors, strict=True):
            if error is None:
                result.sampled[request_id] = (token, logprob)
            else:
                result.failed[request_id] = error
        return result
