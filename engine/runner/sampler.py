"""Turn one step's logits into tokens: penalties, min_tokens, logprobs, then a greedy or random pick.

Per row, in order: logit bias → repetition penalty → frequency/presence penalties → min_tokens mask
→ (logprobs are read here) → temperature → top-k → top-p → min-p → draw. Greedy rows (temperature 0) take the
argmax of the penalized logits; ties go to the lowest token id.

Logprobs are the log-softmax of the logits after the bias, penalties and the min_tokens mask, before temperature
and truncation: the model's distribution as this request's penalties shape it, the same whatever the
temperature or top-p, and finite for every token the request can be given.

A seeded request's draw is a function of (seed, token position) alone: the uniform that picks its
token at output position p is `seeded_uniform(seed, p)`, a hash, not the next value of a stream. So
its tokens are the same whichever other requests share the batch and at any row (no step mixes values
across rows), after a preemption, and when a migrated request resumes at position p on another worker.
Unseeded rows share one stream, drawn in row order. Truncation cut-offs are values, not positions
(tokens tied with the last kept one stay), so the kept set never depends on how a sort orders ties.

Penalties read what a request has seen through a state kept per request (`_PenaltyState`, by
`SamplingRow.request_id`): the distinct tokens of its prompt and output, and how often each output
token occurs, taken in as its output grows. A step touches only those tokens' logits and never
re-reads the prompt (it had turned prompt and output into tensors and deduplicated them every step:
36 ms a step for 16 rows of 8k-token prompts).

One row never hurts the others, and every token id is inside the vocabulary: a row whose logits are
NaN or infinite after the penalties (a degenerate penalty, a broken forward), or whose temperature
scaling overflows, is sampled greedily over its finite logits; a row with no finite logit at all
fails alone (`SamplerOutput.errors`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.frontend.protocol import SamplingParams, TokenLogprob

# Tokens per block of the two-level inverse CDF: block sums first, then one block's prefix sums.
_CDF_BLOCK = 256
# Candidate counts tried in turn for the top-k/top-p kept set before falling back to a full sort.
_TOP_K_TOP_P_CANDIDATES = (256, 4096)
# Requests whose penalty state is kept beyond those of the step at hand (least recently sampled
# dropped first): a state is its request's distinct token ids, and one dropped is only rebuilt.
_PENALTY_STATES = 64


@dataclass(slots=True)
class SamplingRow:
    """One request's row in this step's logits."""

    options: SamplingParams
    prompt_token_ids: list[int]
    # Everything generated so far (a resumed request's earlier tokens included): its length is the
    # position of the token drawn now.
    output_token_ids: list[int]
    # Masked (with options.stop_token_ids) until min_tokens tokens have been generated.
    eos_token_ids: list[int]
    # Whose row it is: its penalty state is kept under it between steps ("": none kept).
    request_id: str = ""


@dataclass(slots=True)
class _PenaltyState:
    """What one request has seen, as distinct token ids: those of its prompt and output together
    (`seen_ids`, for the repetition penalty) and those of its output with how often each occurs
    (`out_ids`, `out_counts`), counted over `outputs[:counted]`. Valid for the very prompt and output
    lists it was built from (a request's output list only grows; a new request under the same id
    has new lists)."""

    prompt: list[int]
    outputs: list[int]
    vocab: int
    seen: set[int]
    seen_ids: torch.Tensor  # [distinct] long
    out_index: dict[int, int]  # an output token's position in out_ids / out_counts
    out_ids: torch.Tensor  # [distinct outputs] long
    out_counts: torch.Tensor  # [distinct outputs] float32
    counted: int

    def serves(self, row: SamplingRow, vocab: int, device: torch.device) -> bool:
        return (self.prompt is row.prompt_token_ids and self.outputs is row.output_token_ids
                and self.counted <= len(row.output_token_ids) and self.vocab == vocab
                and self.seen_ids.device == device)

    def catch_up(self) -> None:
        """Take in the output tokens added since the last step (one, usually)."""
        new_seen: dict[int, None] = {}  # in order, once each
        new_out: dict[int, int] = {}  # output tokens not counted before, with their positions
        bumped: list[int] = []
        for token in self.outputs[self.counted:]:
            if not 0 <= token < self.vocab:
                continue  # no logit to adjust
            if token not in self.seen:
                new_seen[token] = None
            index = self.out_index.get(token)
            if index is None:
                index = new_out.get(token)
                if index is None:
                    index = new_out[token] = len(self.out_index) + len(new_out)
            bumped.append(index)
        # The tensors first: if building one fails (out of device memory), the state is as it was.
        device = self.seen_ids.device
        seen_ids, out_ids, out_counts = self.seen_ids, self.out_ids, self.out_counts
        if new_seen:
            seen_ids = torch.cat([seen_ids, torch.tensor(list(new_seen), dtype=torch.long, device=device)])
        if new_out:
            out_ids = torch.cat([out_ids, torch.tensor(list(new_out), dtype=torch.long, device=device)])
            out_counts = torch.cat([out_counts, torch.zeros(len(new_out), device=device)])
        if bumped:
            out_counts = out_counts.index_add(0, torch.tensor(bumped, dtype=torch.long, device=device),
                                              torch.ones(len(bumped), device=device))
        self.seen_ids, self.out_ids, self.out_counts = seen_ids, out_ids, out_counts
        self.seen.update(new_seen)
        self.out_index.update(new_out)
        self.counted = len(self.outputs)

    @classmethod
    def of(cls, row: SamplingRow, vocab: int, device: torch.device) -> _PenaltyState:
        seen = {token for token in row.prompt_token_ids if 0 <= token < vocab}
        empty = torch.zeros(0, dtype=torch.long, device=device)
        state = cls(row.prompt_token_ids, row.output_token_ids, vocab, seen,
                    torch.tensor(sorted(seen), dtype=torch.long, device=device), {}, empty,
                    torch.zeros(0, device=device), 0)
        state.catch_up()
        return state


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Per row: None, or why the row has no token (its token id is then a placeholder 0).
    errors: list[str | None]


NO_FINITE_LOGITS = "the model produced no finite logits for this request"


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # The stream unseeded rows share, one generator per device (None: fresh entropy).
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        # Penalized requests' states, by request id, least recently sampled first.
        self._penalty_states: OrderedDict[str, _PenaltyState] = OrderedDict()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [num_rows, vocab] in any float dtype; the work is done in fp32."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} sampling rows")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[], errors=[])
        # Penalties and the min_tokens mask write in place: never into the caller's tensor.
        adjusts = any(_adjusts_logits(row) for row in rows)
        if not adjusts:
            plain = _plain_greedy(logits, rows)
            if plain is not None:
                return plain
        logits = logits.to(torch.float32, copy=adjusts)
        _apply_logit_bias(logits, rows)
        self._apply_penalties(logits, rows)
        errors: list[str | None] = [None] * len(rows)
        # Rows forced greedy because their logits or probabilities are not usable.
        fallback: set[int] = set()
        # -inf is a token ruled out (a grammar's mask): fine. NaN or +inf is a broken row, and a
        # row with no finite logit at all has nothing to sample.
        broken_rows = (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | ~torch.isfinite(logits).any(-1)
        if bool(broken_rows.any()):
            if not adjusts:
                logits = logits.clone()
            broken = broken_rows.nonzero().squeeze(1).tolist()
            fallback.update(broken)
            # Only the finite logits take part; a row with none left cannot be sampled at all.
            logits[broken] = torch.where(torch.isfinite(logits[broken]), logits[broken], -math.inf)
            for i, usable in zip(broken, torch.isfinite(logits[broken]).any(-1).tolist(), strict=True):
                if not usable:
                    errors[i] = NO_FINITE_LOGITS
        _apply_min_tokens(logits, rows)

        logprob_rows = [i for i, row in enumerate(rows)
                        if row.options.logprobs is not None and errors[i] is None]
        log_probs = _take_rows(logits, logprob_rows).log_softmax(-1) if logprob_rows else None

        token_ids = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, row in enumerate(rows) if row.options.greedy or i in fallback]
        if greedy_rows:
            token_ids[greedy_rows] = _take_rows(logits, greedy_rows).argmax(-1)
        random_rows = [i for i, row in enumerate(rows) if not row.options.greedy and i not in fallback]
        if random_rows:
            options = [rows[i].options for i in random_rows]
            uniforms = self._uniforms([rows[i] for i in random_rows], logits.device)
            drawn, overflowed = _sample_random(_take_rows(logits, random_rows), options, uniforms)
            token_ids[random_rows] = drawn
            if overflowed:
                overflow_rows = [random_rows[j] for j in overflowed]
                token_ids[overflow_rows] = logits[overflow_rows].argmax(-1)
        ids = token_ids.tolist()
        # Last line of defence: an id outside the vocabulary would fail the next step for everyone.
        vocab = logits.shape[1]
        outside = [i for i, token in enumerate(ids) if not 0 <= token < vocab]
        if outside:
            token_ids[outside] = logits[outside].argmax(-1)
            ids = token_ids.tolist()

        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if log_probs is not None:
            ks = [rows[i].options.logprobs or 0 for i in logprob_rows]
            for i, entry in zip(logprob_rows, _gather_logprobs(log_probs, token_ids[logprob_rows], ks), strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=ids, logprobs=logprobs, errors=errors)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """In place, over each penalized row's vocabulary at once: HF-style repetition over prompt and
        output (positive logits shrink, negative ones go further down), then OpenAI-style frequency
        and presence over the output."""
        repeat = [i for i, row in enumerate(rows) if row.options.repetition_penalty != 1.0]
        additive = [i for i, row in enumerate(rows)
                    if row.options.frequency_penalty != 0.0 or row.options.presence_penalty != 0.0]
        if not repeat and not additive:
            return
        vocab, device = logits.shape[1], logits.device
        states = {i: self._penalty_state(rows[i], vocab, device) for i in sorted({*repeat, *additive})}
        # Dropped only now, and only states no row of this step uses: more penalized rows than the
        # cache keeps would otherwise rebuild each other's every step.
        while len(self._penalty_states) > max(_PENALTY_STATES, len(states)):
            self._penalty_states.popitem(last=False)
        if repeat:
            row_index, token_index = _pairs(repeat, [states[i].seen_ids for i in repeat], device)
            penalty = torch.tensor([row.options.repetition_penalty for row in rows], device=device)[row_index]
            seen = logits[row_index, token_index]
            logits[row_index, token_index] = torch.where(seen > 0, seen / penalty, seen * penalty)
        if additive:
            row_index, token_index = _pairs(additive, [states[i].out_ids for i in additive], device)
            counts = torch.cat([states[i].out_counts for i in additive])
            frequency = torch.tensor([row.options.frequency_penalty for row in rows], device=device)[row_index]
            presence = torch.tensor([row.options.presence_penalty for row in rows], device=device)[row_index]
            logits[row_index, token_index] -= frequency * counts + presence

    def _penalty_state(self, row: SamplingRow, vocab: int, device: torch.device) -> _PenaltyState:
        """The row's request's state, caught up with its output; built from its tokens when there is
        none (a new request, one dropped from the cache, or a row without a request id)."""
        cached = self._penalty_states.get(row.request_id) if row.request_id else None
        if cached is not None and cached.serves(row, vocab, device):
            cached.catch_up()
            self._penalty_states.move_to_end(row.request_id)
            return cached
        state = _PenaltyState.of(row, vocab, device)
        if row.request_id:
            self._penalty_states[row.request_id] = state
            self._penalty_states.move_to_end(row.request_id)
        return state

    def forget(self, request_id: str) -> None:
        """Drop a finished request's penalty state."""
        self._penalty_states.pop(request_id, None)

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """[rows] float64 in [0, 1): a seeded row's from its (seed, position); the unseeded rows take
        the next values of the shared stream, in row order."""
        unseeded = sum(row.options.seed is None for row in rows)
        shared = iter(torch.rand(unseeded, generator=self._shared_generator(device), device=device,
                                 dtype=torch.float64).tolist() if unseeded else [])
        values = [next(shared) if row.options.seed is None
                  else seeded_uniform(row.options.seed, len(row.output_token_ids)) for row in rows]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = self._shared_generators[device] = make_generator(self._seed, device)
        return generator


# torch.Generator seeds are 64-bit; any int (a request's int64 seed) maps onto that range.
_GENERATOR_SEEDS = 1 << 64


_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """One round of SplitMix64's finalizer: a bijection of 64-bit ints that scatters every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that picks a seeded request's token at output `position`: the same on
    any machine, in any batch, and after any interruption (any int64 seed; taken modulo 2**64)."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) * 2.0 ** -53  # the top 53 bits: every float64 of [0, 1) this fine is reachable


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # fresh entropy: unseeded requests must not share a stream
    else:
        generator.manual_seed(seed % _GENERATOR_SEEDS)
    return generator


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    # Row lists are ascending, so one covering every row is the identity: skip the copy.
    return x if len(rows) == x.shape[0] else x[rows]


def _pairs(rows: list[int], ids: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs: rows[i] with each of ids[i]."""
    lengths = torch.tensor([t.shape[0] for t in ids], device=device)
    return torch.repeat_interleave(torch.tensor(rows, device=device), lengths), torch.cat(ids)


def _plain_greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput | None:
    """Every row greedy, no logprobs, nothing adjusting the logits (the common decode step): one
    max over the logits as they are (a max is exact in any dtype), no fp32 copy. None when a row
    needs the full path, or has a NaN, a +inf or no finite logit (its row max is then not finite)."""
    if not all(row.options.greedy and row.options.logprobs is None for row in rows):
        return None
    values, token_ids = logits.max(-1)  # the first maximal id: ties go to the lowest
    # One read back from the device, not two: a row whose max is not finite comes back as -1.
    ids = torch.where(torch.isfinite(values), token_ids, -1).tolist()
    if min(ids) < 0:
        return None
    return SamplerOutput(token_ids=ids, logprobs=[None] * len(rows), errors=[None] * len(rows))


def _adjusts_logits(row: SamplingRow) -> bool:
    options = row.options
    return (options.repetition_penalty != 1.0 or options.frequency_penalty != 0.0
            or options.presence_penalty != 0.0 or len(row.output_token_ids) < options.min_tokens
            or bool(options.logit_bias))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's biases added to their tokens' logits (ids past the logits' vocab have none)."""
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token, bias in row.options.logit_bias.items():
            if token < vocab:
                row_index.append(i)
                token_index.append(token)
                values.append(bias)
    if values:
        device = logits.device
        index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.options.min_tokens:
            continue
        banned = set(row.options.stop_token_ids)
        if not row.options.ignore_eos:
            banned.update(row.eos_token_ids)
        banned = {token for token in banned if 0 <= token < vocab}
        row_index.extend([i] * len(banned))
        token_index.extend(banned)
    if token_index:
        device = logits.device
        logits[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = -math.inf


def _sample_random(logits: torch.Tensor, options: list[SamplingParams],
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """logits: [rows, vocab] penalized, finite or -inf; uniforms: [rows] float64. Returns ([rows]
    token ids drawn after temperature and truncation, the rows whose scaled logits overflowed:
    their draw is void)."""
    device = logits.device
    overflowed: list[int] = []
    if any(o.temperature != 1.0 for o in options):
        temperature = torch.tensor([o.temperature for o in options], device=device)
        logits = logits / temperature.unsqueeze(1)
        # A huge logit over a small temperature reaches +inf, and softmax turns its row into NaN.
        bad = torch.isposinf(logits).any(-1)
        if bool(bad.any()):
            overflowed = bad.nonzero().squeeze(1).tolist()
            logits[overflowed] = 0.0  # any finite row: the draw is replaced by the caller
    probs = logits.softmax(-1)
    # Truncation as one probability cut-off per row (0: keep all), applied in a single pass.
    cutoff = top_k_top_p_cutoff(probs, [o.top_k for o in options], [o.top_p for o in options])
    min_p_rows = [i for i, o in enumerate(options) if o.min_p > 0.0]
    if min_p_rows:
        # The max-prob token survives top-k/top-p and ratios ignore renormalization, so order is moot.
        min_p = torch.tensor([options[i].min_p for i in min_p_rows], device=device)
        cutoff[min_p_rows] = torch.maximum(cutoff[min_p_rows], min_p * _take_rows(probs, min_p_rows).amax(-1))
    if min_p_rows or any(o.top_k or o.top_p < 1.0 for o in options):
        probs = torch.where(probs >= cutoff.unsqueeze(1), probs, torch.zeros((), device=device))
    return _inverse_cdf(probs, uniforms), overflowed


def top_k_top_p_cutoff(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """[rows] the smallest probability kept by top-k, then top-p over the top-k renormalized set.

    Works on the few hundred most likely tokens first and widens only the rows whose kept set may
    reach past them. Every decision reads a prefix of the row's sorted probabilities, so it is the
    same however many candidates were taken.
    """
    num_rows, vocab = probs.shape
    device = probs.device
    cutoff = torch.zeros(num_rows, device=device)
    top_ks = [k if 0 < k < vocab else 0 for k in top_ks]
    pending = [i for i in range(num_rows) if top_ks[i] or top_ps[i] < 1.0]
    for round_size in (*_TOP_K_TOP_P_CANDIDATES, vocab):
        # The rows whose top-k fits this round's candidates: a wider top-k waits for a wider round,
        # so one row's large k never widens (or sorts) the other rows' candidates.
        now = [i for i in pending if top_ks[i] <= round_size]
        if not now:
            continue
        # Top-k alone needs only its k-th largest probability.
        wanted = round_size if any(top_ps[i] < 1.0 for i in now) else 0
        num_candidates = min(vocab, max(wanted, *(top_ks[i] for i in now)))
        candidates = _take_rows(probs, now).topk(num_candidates, dim=-1).values  # descending
        top_k = torch.tensor([top_ks[i] for i in now], device=device)
        top_p = torch.tensor([top_ps[i] for i in now], dtype=torch.float64, device=device)
        has_top_k, has_top_p = top_k > 0, top_p < 1.0
        kth = candidates.gather(1, (top_k - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        top_k_cutoff = torch.where(has_top_k, kth, 0.0)
        in_top_k = candidates >= top_k_cutoff.unsqueeze(1)
        cum = torch.where(in_top_k, candidates, 0.0).double().cumsum(-1)
        # All positive-probability tokens are candidates, or one candidate already falls outside top-k.
        exhausted = (candidates[:, -1] == 0) | (num_candidates == vocab)
        complete = exhausted | ~in_top_k[:, -1]
        # Top-p is measured against the top-k set's mass, known once that set is complete.
        mass = torch.where(has_top_k, cum[:, -1], 1.0)
        covered = cum >= top_p.unsqueeze(1) * mass.unsqueeze(1)
        covered[:, -1] |= complete  # rounding fell short of top_p: keep the whole set
        first_covering = covered.int().argmax(-1, keepdim=True)
        top_p_cutoff = torch.where(has_top_p, candidates.gather(1, first_covering).squeeze(1), 0.0)
        done = ~has_top_p | (covered.any(-1) & (complete | ~has_top_k))
        rows = torch.tensor(now, device=device)
        cutoff[rows[done]] = torch.maximum(top_k_cutoff, top_p_cutoff)[done]
        unfinished = {i for i, finished in zip(now, done.tolist(), strict=True) if not finished}
        pending = [i for i in pending if i in unfinished or top_ks[i] > round_size]
    return cutoff


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights: [rows, vocab] ≥ 0, not necessarily normalized. Returns [rows] the token whose CDF
    interval holds uniforms[row] × total weight, found block first, then within the block."""
    num_rows, vocab = weights.shape
    pad = -vocab % _CDF_BLOCK
    if pad:
        weights = F.pad(weights, (0, pad))
    blocks = weights.view(num_rows, -1, _CDF_BLOCK)  # [rows, num_blocks, block]
    block_mass = blocks.sum(-1).double()
    block_cum = block_mass.cumsum(-1)
    target = uniforms * block_cum[:, -1]
    block = _first_above(block_cum, target, block_mass)
    previous = block_cum.gather(1, (block - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    before = torch.where(block > 0, previous, 0.0)
    inner = blocks[torch.arange(num_rows, device=weights.device), block].double()  # [rows, block]
    offset = _first_above(inner.cumsum(-1), (target - before).clamp_min(0.0), inner)
    return block * _CDF_BLOCK + offset


def _first_above(cum: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds target: always an entry with positive mass, since a
    zero entry repeats its predecessor's sum. Past the end (rounding) → the last positive entry."""
    index = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
    positions = torch.arange(mass.shape[1], device=mass.device)
    last_positive = torch.where(mass > 0, positions, -1).amax(-1)
    return torch.where(index >= mass.shape[1], last_positive, index)


def _gather_logprobs(log_probs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """log_probs: [rows, vocab]; the chosen token's logprob and each row's k most likely tokens."""
    chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = min(max(ks), log_probs.shape[1])
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if max_k > 0:
        values, ids = log_probs.topk(max_k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token_id=token_id, logprob=logprob, top=list(zip(ids_row[:k], values_row[:k], strict=True)))
        for token_id, logprob, ids_row, values_row, k
        in zip(token_ids.tolist(), chosen, top_ids, top_values, ks, strict=True)
    ]
