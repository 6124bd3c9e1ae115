"""Grammar-constrained decoding in the engine core, with llguidance.

Each constrained request gets one `llguidance.LLMatcher`, compiled when the request is added (the
core holds the tokenizer) and kept until the core forgets the request. A token reaches the matcher
only when it is sampled, so a preempted request, recomputed later over its prompt and outputs,
never feeds a token twice.

Each step `mask_logits` fills a token bitmask for the constrained rows only and sets the logits of
the tokens their grammars forbid to -inf before the sampler sees them: greedy and random rows
alike, penalties and logprobs computed over what is left. Rows without a grammar are not touched,
so batching constrained and free requests changes nothing for the free ones. `consume` feeds each
sampled token back and reports the requests whose grammar is complete (nothing may follow: the
core stops them) or has failed (the core ends only that request, with an error).

EOS is allowed exactly when the grammar accepts what was generated so far.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from engine.grammars import to_llguidance
from engine.protocol import StructuredOutput
from engine.tokenizer import Tokenizer

log = logging.getLogger("helexa.engine")


@dataclass(slots=True, frozen=True)
class GrammarEnd:
    """A constrained request that must end now: its grammar is complete, or `error` says why not."""

    request_id: str
    error: str | None = None


class StructuredOutputs:
    """The matchers of one core's constrained requests and the bitmask their rows share."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int], max_rows: int,
                 device: torch.device) -> None:
        self._tokenizer = tokenizer
        # At least the logits' width: a model may pad its vocabulary past the tokenizer's.
        self._vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos_token_ids = eos_token_ids
        self._max_rows = max(max_rows, 1)
        self._device = device
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._bitmask: torch.Tensor | None = None
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Failures noticed while masking; `consume` reports them after the step.
        self._failed: dict[str, str] = {}
        # Seconds spent in llguidance computing masks, all steps together (bench/structured_outputs.py).
        self.fill_s = 0.0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first constrained request (a fraction of a second per 50k tokens)."""
        if self._ll_tokenizer is None:
            start = time.perf_counter()
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.hf.to_str(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None)
            words = (self._ll_tokenizer.vocab_size + 31) // 32
            # Pinned on CUDA so the per-step copy to the device does not wait on the host.
            self._bitmask = torch.zeros((self._max_rows, words), dtype=torch.int32,
                                        pin_memory=self._device.type == "cuda")
            log.info("llguidance tokenizer ready: %d tokens in %.0f ms", self._ll_tokenizer.vocab_size,
                     (time.perf_counter() - start) * 1000.0)
        return self._ll_tokenizer

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, structured: StructuredOutput) -> str | None:
        """Compile the request's grammar; the reason when it does not compile."""
        try:
            grammar = to_llguidance(structured)
        except ValueError as exc:
            return str(exc)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return matcher.get_error()
        log.debug("grammar compiled", extra={"request_id": request_id, "kind": structured.kind.value,
                                             "ms": round((time.perf_counter() - start) * 1000.0, 3)})
        self._matchers[request_id] = matcher
        return None

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._failed.pop(request_id, None)

    def mask_logits(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """logits: [rows, vocab], row i sampled for request_ids[i]; masked in place."""
        rows = [(i, self._matchers[request_id]) for i, request_id in enumerate(request_ids)
                if request_id in self._matchers and request_id not in self._failed]
        if not rows:
            return
        bitmask = self._bitmask
        assert bitmask is not None  # allocated with the tokenizer, before any matcher exists
        if len(rows) > bitmask.shape[0]:  # more sampled rows than max_num_seqs: never in a core step
            bitmask = self._bitmask = torch.zeros((len(rows), bitmask.shape[1]), dtype=torch.int32,
                                                  pin_memory=bitmask.is_pinned())
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        base = bitmask.data_ptr()
        # On a GPU the forward is still running here: these masks are computed meanwhile.
        start = time.perf_counter()
        for k, (_, matcher) in enumerate(rows):
            matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        self.fill_s += time.perf_counter() - start
        masks = bitmask[:len(rows)]
        # A matcher in error (a lexer or parser limit hit at run time) or one that allows no
        # token ends its own request after this step; its row is left free meanwhile, so the
        # sampler still has a distribution to draw from.
        live = masks.numpy().any(axis=1).tolist()
        kept = []
        for k, ((i, matcher), has_token) in enumerate(zip(rows, live)):
            request_id = request_ids[i]
            if matcher.is_error() or not has_token:
                self._failed[request_id] = matcher.get_error() or "the grammar allows no further token"
            else:
                kept.append(k)
        if kept:
            apply_masks(logits, [rows[k][0] for k in kept], masks[kept] if len(kept) < len(rows) else masks,
                        self._bit_shifts)

    def consume(self, sampled: dict[str, int]) -> list[GrammarEnd]:
        """Feed each constrained request its sampled token; the requests that must end now."""
        ends = []
        for request_id, token_id in sampled.items():
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            failed = self._failed.pop(request_id, None)
            if failed is not None:
                ends.append(GrammarEnd(request_id, f"structured output failed: {failed}"))
            elif not matcher.consume_token(token_id):
                error = matcher.get_error() or f"token {token_id} is not allowed by the grammar"
                ends.append(GrammarEnd(request_id, f"structured output failed: {error}"))
            elif matcher.is_stopped():
                ends.append(GrammarEnd(request_id))
        return ends


def unpack_numpy(masks: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit j of word w: token 32w + j) → [rows, words * 32] bool.
    On a CPU numpy unpacks in one single-threaded pass: torch's parallel ops cost more on a busy
    machine than the work they split."""
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_torch(masks: torch.Tensor, bit_shifts: torch.Tensor) -> torch.Tensor:
    """The same unpacking with tensor ops, on the masks' device (a GPU: 4 bytes per 32 tokens cross)."""
    # [rows, words, 32] bits → [rows, words * 32]
    return ((masks.unsqueeze(-1) >> bit_shifts) & 1).view(masks.shape[0], -1).bool()


def apply_masks(logits: torch.Tensor, row_indices: list[int], masks: torch.Tensor, bit_shifts: torch.Tensor) -> None:
    """Set logits[row_indices[k], t] to -inf for every token t that masks[k] does not allow."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        allowed = unpack_numpy(masks)
    else:
        allowed = unpack_torch(masks.to(logits.device, non_blocking=True), bit_shifts.to(logits.device))
    if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbidden = ~allowed[:, :vocab]
    if logits.device.type == "cpu":
        for k, row in enumerate(row_indices):
            logits[row].masked_fill_(forbidden[k], -math.inf)
    else:
        index = torch.tensor(row_indices, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, -math.inf))
