"""The CPU decode stack (engine.cpu.cpu_decode_stack): a decode step in one C++ call gives the model's
forward bit for bit (hidden states and every K/V it stores), serves exactly the steps whose rows
all go through the decode kernel, and is built only where all of the model has its kernel."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

from engine.cpu import cpu_linear
from engine.cpu.cpu_decode_stack import CpuDecodeStack
from engine.cpu.cpu_support import dtype_supported
from engine.frontend.protocol import EngineRequest
from engine.loading.loader import Checkpoint, empty_model
from engine.loading.model_config import ModelConfig
from engine.runner import ops
from engine.runner.model_runner import allocate_kv_caches
from engine.runner.step_metadata import KVCaches, SequenceChunk, build_step_inputs
from helexa_kernels import cpu as cpu_kernels
from tests.engine.test_engine_core import greedy, make_core, run
from tests.kernels.helpers import AMX_FORMS, BF16, NEEDS_BF16_CPU

SIZES = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "hidden_act": "silu"}
MODELS = {
    "llama": {"model_type": "llama"},
    "llama-bias": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    # Qwen3: per-head q/k norms, attention wider than the residual stream.
    "qwen3-wide": {"model_type": "qwen3", "head_dim": 32},
}


# The dtype the stack's logic is checked in: bf16 where this CPU runs it, else fp32 (its kernels run
# everywhere).
KERNEL_DTYPE = torch.bfloat16 if dtype_supported("bfloat16") else torch.float32


def random_model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    config = ModelConfig.from_hf_config(SIZES | MODELS[kind])
    model = empty_model(config, dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    cpu_linear.prepack_model(model)
    return model


class TwoCaches:
    """The same sequences in two copies of the KV cache: one the stack runs on, one the model's
    forward runs on."""

    def __init__(self, model: torch.nn.Module, num_seqs: int, block_size: int) -> None:
        self.model, self.block_size = model, block_size
        blocks_per_seq = 160 // block_size + 1
        num_blocks = num_seqs * blocks_per_seq + 1
        weight = next(model.parameters())
        self.stack_caches = allocate_kv_caches(model.config, num_blocks, block_size, weight.dtype, "cpu")
        self.model_caches = allocate_kv_caches(model.config, num_blocks, block_size, weight.dtype, "cpu")
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)).add(1).tolist()
        self.tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(num_seqs)]
        self.lengths = [0] * num_seqs
        self.stack = CpuDecodeStack.build(model, self.stack_caches)

    def step(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Both forms of one step: (the stack's hidden states or None, the forward's)."""
        def inputs():
            return build_step_inputs([SequenceChunk(ids, self.lengths[i], self.tables[i])
                                      for i, ids in chunks.items()], self.block_size)
        with torch.inference_mode():
            assert self.stack is not None
            served = self.stack.run(inputs())
            if served is None:  # not the stack's step: the stack's caches advance by the forward
                step = inputs()
                self.model(step.input_ids, step.positions, self.stack_caches, step.meta)
            step = inputs()
            expected = self.model(step.input_ids, step.positions, self.model_caches, step.meta)
        for i, ids in chunks.items():
            self.lengths[i] += len(ids)
        return served, expected

    def assert_caches_equal(self) -> None:
        for (k1, v1), (k2, v2) in zip(self.stack_caches, self.model_caches, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=generator).tolist()


@pytest.fixture(autouse=True)
def _cpu_kernels() -> None:
    ops.use_backend("cpu", "cpu")
    assert cpu_kernels.load()


@pytest.mark.parametrize("amx_form", AMX_FORMS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [BF16, pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("kind", list(MODELS))
def test_decode_steps_match_the_forward_bit_for_bit(kind: str, dtype: torch.dtype, block_size: int,
                                                    amx_form: Callable[[], AbstractContextManager[None]]) -> None:
    generator = torch.Generator().manual_seed(2)
    model = random_model(kind, dtype)
    with amx_form():
        seqs = TwoCaches(model, num_seqs=5, block_size=block_size)
        # Prefills of different lengths: the forward's steps, the stack declines them.
        served, _ = seqs.step({i: tokens(generator, 3 + 17 * i) for i in range(5)})
        assert served is None
        for _ in range(3):  # decodes, each row at its own length
            served, expected = seqs.step({i: tokens(generator, 1) for i in range(5)})
            assert served is not None and torch.equal(served, expected)
        # Short chunk continuations beside decodes: their rows go through the decode kernel too.
        served, expected = seqs.step({0: tokens(generator, 6), 1: tokens(generator, 1), 3: tokens(generator, 2)})
        assert served is not None and torch.equal(served, expected)
        seqs.assert_caches_equal()


@NEEDS_BF16_CPU
def test_more_rows_than_the_bf16_kernel_takes_go_through_onednn_alike() -> None:
    """Past `bf16_kernel_rows` the linears run on oneDNN: the stack picks as PackedWeight does."""
    rows = cpu_linear.bf16_kernel_rows() + 3
    generator = torch.Generator().manual_seed(3)
    model = random_model("llama", torch.bfloat16)
    seqs = TwoCaches(model, num_seqs=rows, block_size=16)
    seqs.step({i: tokens(generator, 2 + i % 7) for i in range(rows)})
    served, expected = seqs.step({i: tokens(generator, 1) for i in range(rows)})
    assert served is not None and served.shape[0] == rows and torch.equal(served, expected)
    seqs.assert_caches_equal()


def test_a_step_with_a_prefill_is_left_to_the_forward() -> None:
    generator = torch.Generator().manual_seed(4)
    seqs = TwoCaches(random_model("llama", KERNEL_DTYPE), num_seqs=2, block_size=16)
    seqs.step({0: tokens(generator, 9)})
    served, expected = seqs.step({0: tokens(generator, 1), 1: tokens(generator, 40)})
    assert served is None
    served, expected = seqs.step({0: tokens(generator, 1), 1: tokens(generator, 1)})
    assert served is not None and torch.equal(served, expected)
    seqs.assert_caches_equal()


def test_built_only_where_every_part_has_its_kernel() -> None:
    model = random_model("llama", KERNEL_DTYPE)
    caches: KVCaches = allocate_kv_caches(model.config, 4, 16, KERNEL_DTYPE, "cpu")
    assert CpuDecodeStack.build(model, caches) is not None
    assert CpuDecodeStack.build(model, caches[:-1]) is None  # caches for other layers
    ops.use_backend("torch", "cpu")  # the PyTorch forms picked: nothing to call from C++
    assert CpuDecodeStack.build(model, caches) is None
    ops.use_backend("cpu", "cpu")
    unpacked = random_model("llama", KERNEL_DTYPE)
    unpacked.model.layers[1].mlp.down_proj.packed = None
    assert CpuDecodeStack.build(unpacked, caches) is None


def test_an_engine_serves_its_decode_steps_through_the_stack(smollm2: Checkpoint) -> None:
    """The engine tests' decode steps run the stack: a core with it and one without it agree."""
    prompts = [smollm2.tokenizer.encode(text) for text in ("The capital of France is", "1, 2, 3,")]

    def requests() -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", ids, greedy(12)) for i, ids in enumerate(prompts)]

    with_stack = make_core(smollm2)
    stack = with_stack.runner.cpu_decode_stack
    assert stack is not None
    calls = []
    original = stack.run
    stack.run = lambda inputs: calls.append(1) or original(inputs)  # type: ignore[method-assign]
    served = run(with_stack, requests())
    without = make_core(smollm2)
    without.runner.cpu_decode_stack = None
    assert served == run(without, requests())
    assert len(calls) >= 10

