"""Shared test helpers: drive a model through a paged KV cache (with the engine's own KV allocation
and step builder), save a tiny HF tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import nn

from engine.core.engine_core import EngineCore
from engine.frontend.protocol import EngineOutput, EngineRequest
from engine.runner.model_runner import allocate_kv_caches
from engine.runner.state_cache import HybridCaches, LinearStateCache
from engine.runner.step_metadata import KVCaches, SequenceChunk, StepInputs, build_step_inputs


class PagedSequences:
    """KV caches for a few sequences, each on shuffled (non-contiguous) blocks of its own; for a
    hybrid model also a linear-state slot per sequence (slot i for sequence i, reversed so slot
    order differs from batch order)."""

    def __init__(self, model: nn.Module, max_lens: list[int], block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        per_seq = [-(-n // block_size) for n in max_lens]
        num_blocks = sum(per_seq) + 1
        weight = next(model.parameters())
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, weight.dtype,
                                            weight.device)
        free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables = []
        for n in per_seq:
            self.block_tables.append(free[:n])
            free = free[n:]
        self.num_computed = [0] * len(max_lens)
        shape = getattr(model, "linear_state_shape", None)
        self.caches: KVCaches | HybridCaches = self.kv_caches
        if shape is not None:
            states = LinearStateCache(shape, len(max_lens), weight.dtype, weight.device)
            self.caches = HybridCaches(kv=self.kv_caches, states=states)
        self.slots = list(range(len(max_lens)))[::-1]

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed each listed sequence its next tokens in one batch; logits [len(chunk), vocab]."""
        seq_ids = list(chunks)
        inputs = build_step_inputs(
            [SequenceChunk(chunks[i], self.num_computed[i], self.block_tables[i]) for i in seq_ids],
            self.block_size, self.kv_caches[0][0].device)
        if isinstance(self.caches, HybridCaches):
            self.caches.slot_indices = torch.tensor([self.slots[i] for i in seq_ids], dtype=torch.int32,
                                                    device=inputs.input_ids.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.caches, inputs.meta)
        for i in seq_ids:
            self.num_computed[i] += len(chunks[i])
        return list(self.model.compute_logits(hidden).split([len(chunks[i]) for i in seq_ids]))


class RaisesAfterForward:
    """Stands in for a runner's forward (`ModelRunner.forward`, whichever form serves the step): a
    step holding `token` runs the whole forward (every row's KV and linear state advanced), then
    raises the way one bad row would."""

    def __init__(self, forward: Callable[[StepInputs, object], torch.Tensor], token: int) -> None:
        self.forward, self.token = forward, token

    def __call__(self, inputs: StepInputs, caches: object) -> torch.Tensor:
        hidden = self.forward(inputs, caches)
        if bool((inputs.input_ids == self.token).any()):
            raise IndexError("index out of range in self")
        return hidden


def chunked_logits(model: nn.Module, ids: list[int], chunk_lens: list[int] | None = None,
                   block_size: int = 4) -> torch.Tensor:
    """Logits at every position [len(ids), vocab], the prompt fed in chunks (default: one)."""
    chunk_lens = chunk_lens or [len(ids)]
    assert sum(chunk_lens) == len(ids)
    seqs = PagedSequences(model, [len(ids)], block_size)
    logits, start = [], 0
    for n in chunk_lens:
        logits += seqs.step({0: ids[start:start + n]})
        start += n
    return torch.cat(logits)


def batched_last_logits(model: nn.Module, prompts: list[list[int]],
                        block_size: int = 4) -> torch.Tensor:
    """All prompts prefilled in one paged batch: last-position logits [len(prompts), vocab]."""
    seqs = PagedSequences(model, [len(p) for p in prompts], block_size)
    logits = seqs.step(dict(enumerate(prompts)))
    return torch.stack([x[-1] for x in logits])


def assert_ragged_batch_matches_each_alone(model: nn.Module, prompt_ids: list[int]) -> None:
    """Three prompts of different lengths prefilled in one batch give each one's own last logits."""
    prompts = [prompt_ids, prompt_ids[3:7], prompt_ids[::-1][:11]]
    batched = batched_last_logits(model, prompts)
    alone = torch.stack([chunked_logits(model, p)[-1] for p in prompts])
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


def assert_mixed_steps_match_each_alone(model: nn.Module, prompt_ids: list[int]) -> None:
    """One step holding a prefill chunk continuation, a decode and a whole new prefill, then a
    pure-decode step for two of them: each sequence's logits are what it gets alone."""
    a, b, c = prompt_ids, prompt_ids[2:9], prompt_ids[::-1][:6]
    seqs = PagedSequences(model, [len(a), len(b) + 1, len(c) + 1])
    seqs.step({0: a[:4], 1: b[:-1]})
    mixed = seqs.step({0: a[4:], 1: b[-1:], 2: c})
    decode = seqs.step({1: [a[0]], 2: [a[1]]})
    expected = [chunked_logits(model, ids) for ids in (a, b + [a[0]], c + [a[1]])]
    torch.testing.assert_close(mixed[0], expected[0][4:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], expected[1][-2:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[2], expected[2][:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode[0], expected[1][-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode[1], expected[2][-1:], atol=1e-4, rtol=1e-4)


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs; 0123456789.",
    "def add(a, b):\n    return a + b\n",
] * 20


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a tiny corpus, plus a ChatML-style tokenizer_config.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
    }))


def perturb_norms_and_biases(model: nn.Module) -> None:
    """Random-init norms are all ones; perturb them (and biases) so a misloaded one would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                        generator: torch.Generator) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous) block ids per sequence."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        tables.append(free[:n])
        free = free[n:]
    return tables


def run_all(core: EngineCore, requests: list[EngineRequest]) -> dict[str, tuple[list[int], EngineOutput]]:
    """Every request's tokens and final output, stepping the real core until it is idle."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, EngineOutput] = {}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                final[out.request_id] = out
    assert set(final) == set(tokens)
    return {request_id: (tokens[request_id], final[request_id]) for request_id in tokens}
