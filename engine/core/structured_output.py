"""Grammar-constrained decoding in the engine core, with llguidance.

Each constrained request gets one `llguidance.LLMatcher`, kept until the core forgets the request.
Grammars compile in a thread beside the step loop (llguidance drops the GIL while it compiles), so
the model keeps stepping for everyone else meanwhile: `add` starts (or joins) the compile of a
request's grammar and `ready` hands back the requests whose matcher is ready, or why not. A compile
is cached by the grammar's content hash (`engine.frontend.grammars.grammar_key`, a bounded LRU), so the `n`
choices of a request, and requests repeating a grammar, share one compile: each gets a copy of the
compiled matcher. A compile that runs past its budget fails the requests waiting on it, alone,
with a short error; its thread runs on to the end (llguidance cannot be interrupted), bounded by
the grammar bounds the gateway enforced and llguidance's own limits.

A token reaches the matcher only when it is sampled, so a preempted request, recomputed later over
its prompt and outputs, never feeds a token twice.

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
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

import llguidance
import numpy as np
import torch

from engine.frontend.grammars import (
    COMPILE_BUDGET_S,
    GrammarThreads,
    bounds_error,
    grammar_key,
    parser_limits,
    run_time_error,
    short_error,
    to_llguidance,
)
from engine.frontend.protocol import StructuredOutput
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.engine")

# Compiled grammars kept for reuse (each a matcher in its start state; copies serve requests).
GRAMMAR_CACHE_SIZE = 32
# Threads compiling at once, beside the step loop.
COMPILE_THREADS = 2


@dataclass(slots=True)
class _Waiting:
    """A request whose grammar is compiling: the grammar's key, the tokens a migrated request had
    generated already (fed once the matcher is there), and since when it waits."""

    key: str
    resumed_token_ids: list[int] = field(default_factory=list)
    since: float = 0.0


@dataclass(slots=True, frozen=True)
class GrammarEnd:
    """A constrained request that must end now: its grammar is complete, or `error` says why not."""

    request_id: str
    error: str | None = None


class StructuredOutputs:
    """The matchers of one core's constrained requests, their compiles, and the bitmask their rows
    share."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int], max_rows: int,
                 device: torch.device, compile_budget_s: float = COMPILE_BUDGET_S,
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        # At least the logits' width: a model may pad its vocabulary past the tokenizer's.
        self._vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos_token_ids = eos_token_ids
        self._max_rows = max(max_rows, 1)
        self._device = device
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Failures noticed while masking; `consume` reports them after the step.
        self._failed: dict[str, str] = {}
        self.compile_budget_s = compile_budget_s
        # Grammar key -> its compiled matcher (start state) or why it does not compile; LRU.
        self._compiled: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._cache_size = max(cache_size, 1)
        self._compiling: dict[str, Future[llguidance.LLMatcher | str]] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._pool = GrammarThreads(max_workers=COMPILE_THREADS, thread_name_prefix="helexa-grammar")
        # Compiles started, and requests served by one already done or under way (CoreStats).
        self.compiles = 0
        self.cache_hits = 0
        # Seconds spent in llguidance computing masks, all steps together (benchmarks/structured_outputs.py).
        self.fill_s = 0.0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first constrained request (a fraction of a second per 50k tokens), by
        whichever thread needs it first."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                start = time.perf_counter()
                ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.hf.to_str(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None)
                words = (ll_tokenizer.vocab_size + 31) // 32
                # Pinned on CUDA so the per-step copy to the device does not wait on the host.
                self._bitmask = torch.zeros((self._max_rows, words), dtype=torch.int32,
                                            pin_memory=self._device.type == "cuda")
                self._ll_tokenizer = ll_tokenizer
                log.info("llguidance tokenizer ready: %d tokens in %.0f ms", ll_tokenizer.vocab_size,
                         (time.perf_counter() - start) * 1000.0)
            return self._ll_tokenizer

    def __len__(self) -> int:
        return len(self._matchers)

    @property
    def num_waiting(self) -> int:
        """Requests whose grammar is still compiling."""
        return len(self._waiting)

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher | str:
        """The grammar's matcher in its start state, or why it has none (blocking: `add` runs it in a
        compile thread)."""
        start = time.perf_counter()
        past_bounds = bounds_error(structured)
        if past_bounds is not None:
            return past_bounds
        try:
            grammar = to_llguidance(structured)
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        except ValueError as exc:
            return short_error(str(exc))
        except Exception as exc:  # llguidance refusing the grammar at the API level: this grammar's fault
            return short_error(f"{type(exc).__name__}: {exc}")
        if matcher.is_error():
            return short_error(matcher.get_error())
        log.debug("grammar compiled", extra={"kind": structured.kind.value,
                                             "ms": round((time.perf_counter() - start) * 1000.0, 3)})
        return matcher

    def add(self, request_id: str, structured: StructuredOutput, resumed_token_ids: list[int] | None = None) -> None:
        """Start the compile of the request's grammar, or join one done or under way; `ready`
        says when its matcher is there."""
        key = grammar_key(structured)
        self._waiting[request_id] = _Waiting(key, list(resumed_token_ids or []), time.monotonic())
        if key in self._compiled or key in self._compiling:
            self.cache_hits += 1
            return
        self.compiles += 1
        self._compiling[key] = self._pool.submit(self.compile, structured)

    def ready(self) -> list[tuple[str, str | None]]:
        """The waiting requests that may go on now, each with None (its matcher is set) or why it
        cannot (its grammar does not compile, or not within the budget), in arrival order."""
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
                self._remember(key, future.result())
        if not self._waiting:
            return []
        now = time.monotonic()
        done: list[tuple[str, str | None]] = []
        for request_id, waiting in list(self._waiting.items()):
            compiled = self._compiled.get(waiting.key)
            if compiled is None:
                if now - waiting.since > self.compile_budget_s:
                    done.append((request_id, f"the grammar did not compile within {self.compile_budget_s:g} s"))
                    del self._waiting[request_id]
                continue
            del self._waiting[request_id]
            self._compiled.move_to_end(waiting.key)
            if isinstance(compiled, str):
                done.append((request_id, compiled))
                continue
            matcher = compiled.deep_copy()
            # A migrated request's grammar resumes where the client's text ends.
            if waiting.resumed_token_ids and not matcher.consume_tokens(waiting.resumed_token_ids):
                done.append((request_id, short_error(matcher.get_error() or "the resumed tokens do not match")))
                continue
            self._matchers[request_id] = matcher
            done.append((request_id, None))
        return done

    def _remember(self, key: str, compiled: llguidance.LLMatcher | str) -> None:
        self._compiled[key] = compiled
        while len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._failed.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        live = cast("list[bool]", masks.numpy().any(axis=1).tolist())
        kept = []
        for k, ((i, matcher), has_token) in enumerate(zip(rows, live, strict=True)):
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
                ends.append(GrammarEnd(request_id, f"structured output failed: {run_time_error(failed)}"))
            elif not matcher.consume_token(token_id):
                error = matcher.get_error() or f"token {token_id} is not allowed by the grammar"
                ends.append(GrammarEnd(request_id, f"structured output failed: {run_time_error(error)}"))
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
