"""A Llama-family model's decode steps on CPU in one C++ call (helexa_kernels/decoder/cpu_decoder_stack.cpp).

On CPU a decode step of a small model is some 400 kernel calls of a few microseconds each, and
from Python every call also pays its module, its torch.ops dispatch and its output's allocation:
on SmolLM2-135M in bf16 at 16 rows that is ~3 ms of a ~22 ms step. The stack makes the same
calls from C++, to the same kernels and the same prepacked linears, in the same order: its
output is the Python forward's, bit for bit. It is the CPU's counterpart of the CUDA decode
graphs (`engine.runner.cuda_graphs`), and the runner uses it the same way: a step it serves skips the
model's forward.

It is built where every piece of the model has its kernel: the C++ CPU kernels picked
(`engine.runner.ops`), a Llama or Qwen3 dense model (`LlamaModel` with gated MLPs), every linear packed
(`engine.cpu.cpu_linear`). It serves a step whose every query row goes through the decode kernel
(`engine.runner.attention_plan.KernelRows`: decodes and short chunk continuations); a step with a
prefill runs the model's forward.
"""

from __future__ import annotations

import logging

import torch

from engine.cpu.cpu_linear import Linear, PackedWeight
from engine.models.layers import GatedMLP
from engine.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from engine.runner import ops
from engine.runner.attention import plan_for
from engine.runner.step_metadata import KVCaches, StepInputs

log = logging.getLogger("helexa.engine")


def _cpu_linear(linear: Linear) -> torch.ScriptObject:
    packed = linear.packed
    assert packed is not None
    return torch.classes.helexa_cpu.CpuLinear(packed.onednn, packed.bias, packed.kernel_weight,
                                              packed.kernel_bias, packed.kernel_elements,
                                              packed.out_features)


def _served(model: torch.nn.Module) -> LlamaModel | None:
    """The model's decoder when the stack can run all of it, else None."""
    decoder = getattr(model, "model", None)
    if type(decoder) is not LlamaModel or not ops.cpu_kernels_picked():
        return None
    shard = getattr(model, "shard", None)
    if shard is not None and shard.world > 1:  # the stack runs no collectives: a rank runs layer by layer
        return None
    weight = decoder.embed_tokens.weight
    if weight.device.type != "cpu":
        return None
    for layer in decoder.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) not in (GatedMLP, LlamaMLP):
            return None
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        if not all(isinstance(linear.packed, PackedWeight) for linear in linears):
            return None
    return decoder


class CpuDecodeStack:
    def __init__(self, stack: torch.ScriptObject, block_size: int) -> None:
        self.stack = stack
        self.block_size = block_size

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: KVCaches) -> CpuDecodeStack | None:
        """The stack over the model's weights and caches, or None where it does not apply."""
        decoder = _served(model)
        if decoder is None or len(kv_caches) != len(decoder.layers):
            return None
        first = decoder.layers[0].self_attn
        eps = decoder.norm.eps
        stack = torch.classes.helexa_cpu.DecoderStack(
            first.num_heads, first.num_kv_heads, first.head_dim, eps, first.scale,
            decoder.embed_tokens.weight, decoder.norm.weight,
            decoder.rotary_emb.cos_sin_cache(decoder.embed_tokens.weight.device))
        for layer, (k_cache, v_cache) in zip(decoder.layers, kv_caches, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
            if any(norm is not None and norm.eps != eps for norm in norms):
                return None
            stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                            attention.q_norm.weight if attention.q_norm is not None else None,
                            attention.k_norm.weight if attention.k_norm is not None else None,
                            _cpu_linear(attention.qkv_proj), _cpu_linear(attention.o_proj),
                            _cpu_linear(mlp.gate_up_proj), _cpu_linear(mlp.down_proj), k_cache, v_cache)
        log.info("decode steps run as one C++ call per step (%d layers)", stack.num_layers())
        return cls(stack, kv_caches[0][0].shape[1])

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's final hidden states [tokens, hidden], or None when a row needs the model's
        forward (a prefill)."""
        meta = inputs.meta
        plan = plan_for(meta, self.block_size, inputs.input_ids.device, decode_kernel=True)
        rows = plan.kernel_rows
        if plan.prefill or rows is None:
            return None
        return self.stack.forward(inputs.input_ids, inputs.positions, meta.slot_mapping, rows.block_tables,
                                  rows.key_lens, rows.token_rows, rows.seq_rows)
