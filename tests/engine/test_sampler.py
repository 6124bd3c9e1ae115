"""The batched sampler on CPU: greedy, truncation, penalties, min_tokens, logprobs, seeded replay."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from engine.frontend.protocol import INT64_MAX, INT64_MIN, SamplingParams
from engine.runner.sampler import (
    NO_FINITE_LOGITS,
    Sampler,
    SamplingRow,
    make_generator,
    seeded_uniform,
    top_k_top_p_cutoff,
)

VOCAB = 1000  # not a multiple of the CDF block: exercises the padding


def options(**kwargs: object) -> SamplingParams:
    kwargs.setdefault("max_tokens", 64)
    return SamplingParams(**kwargs)


def row(opts: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        eos: list[int] | None = None) -> SamplingRow:
    return SamplingRow(options=opts, prompt_token_ids=prompt or [0], output_token_ids=output or [],
                       eos_token_ids=eos or [])


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def history_logits(history: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """A stand-in model: logits that depend only on the request's own tokens."""
    seed = sum((i + 1) * token for i, token in enumerate(history)) % (2**31)
    return random_logits(1, vocab, seed=seed)[0]


def allowed_mask(logits: torch.Tensor, opts: SamplingParams) -> torch.Tensor:
    """Naive reference for temperature → top-k → top-p → min-p, by sorting the whole row."""
    probs = (logits / opts.temperature).softmax(-1).double()
    order = probs.argsort(descending=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < opts.top_k < probs.numel():
        keep &= probs >= sorted_probs[opts.top_k - 1]
    if opts.top_p < 1.0:
        kept_sorted = torch.where(keep[order], sorted_probs, 0.0)
        cum = kept_sorted.cumsum(0) / kept_sorted.sum()
        last = int((cum < opts.top_p).sum())  # the first position whose running mass reaches top_p
        keep &= probs >= sorted_probs[last]
    if opts.min_p > 0:
        keep &= probs >= opts.min_p * probs.max()
    return keep


SEEDED_CONFIGS = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=0.8, top_k=20),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.2, min_p=0.05),
    "penalties": dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    "everything": dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                       frequency_penalty=0.2, presence_penalty=0.2, min_tokens=5, logprobs=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(8).to(dtype)
    out = Sampler()(logits, [row(options(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.zeros(2, 10)
    logits[0, [7, 3, 9]] = 5.0
    logits[1, [4, 2]] = 1.0
    out = Sampler()(logits, [row(options(temperature=0.0)), row(options(temperature=0.0))])
    assert out.token_ids == [3, 2]


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(16)
    rows = [row(options(temperature=1.0, top_k=1, seed=i)) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("config", list(SEEDED_CONFIGS.values()), ids=list(SEEDED_CONFIGS))
def test_seeded_request_replays_alone_and_batched(config: dict[str, object]) -> None:
    opts = options(seed=1234, **config)
    prompt = [5, 17, 17, 301]
    eos = [2]

    def run(batched: bool) -> tuple[list[int], list[object]]:
        sampler = Sampler()
        output: list[int] = []
        logprobs: list[object] = []
        for step in range(20):
            own = history_logits(prompt + output)
            if not batched:
                result = sampler(own.unsqueeze(0), [row(opts, prompt, output, eos)])
                output.append(result.token_ids[0])
                logprobs.append(result.logprobs[0])
                continue
            # Neighbours with every kind of sampling, their own seeds or the shared generator.
            num_rows = 1 + (step % 5) * 3
            position = (step * 7) % num_rows
            logits = random_logits(num_rows, seed=100 + step)
            logits[position] = own
            neighbour_opts = [options(temperature=0.0), options(top_p=0.5, seed=9), options(top_k=3),
                              options(temperature=2.0, repetition_penalty=1.5), options(min_p=0.1)]
            rows = []
            for i in range(num_rows):
                if i == position:
                    rows.append(row(opts, prompt, output, eos))
                else:
                    other = neighbour_opts[i % len(neighbour_opts)]
                    rows.append(row(other, [1, 2, 3], [i, i + 1], eos))
            result = sampler(logits, rows)
            output.append(result.token_ids[position])
            logprobs.append(result.logprobs[position])
        return output, logprobs

    alone, alone_logprobs = run(batched=False)
    assert run(batched=True) == (alone, alone_logprobs)
    assert len(set(alone)) > 1


def seeded_run(sampler: Sampler, logits: torch.Tensor, opts: SamplingParams, num_tokens: int,
               output: list[int] | None = None) -> list[int]:
    """`num_tokens` draws of one seeded row over fixed logits, each at the next output position."""
    output = list(output or [])
    drawn = []
    for _ in range(num_tokens):
        drawn.append(sampler(logits, [row(opts, output=output)]).token_ids[0])
        output.append(drawn[-1])
    return drawn


def test_different_seeds_give_different_tokens() -> None:
    logits = random_logits(1, scale=1.0)
    sequences = [seeded_run(Sampler(), logits, options(seed=seed), 50) for seed in (1, 2, 3)]
    assert len({tuple(s) for s in sequences}) == 3


def test_tokens_masked_to_minus_inf_are_ruled_out_not_a_broken_row() -> None:
    """A grammar's mask: the row still samples (seeds differ), and only among the allowed tokens."""
    logits = random_logits(1, scale=1.0)
    allowed = torch.arange(logits.shape[1]) % 3 == 0
    masked = torch.where(allowed, logits, torch.tensor(-math.inf))
    sequences = [seeded_run(Sampler(), masked, options(seed=seed), 30) for seed in (1, 2, 3)]
    assert len({tuple(s) for s in sequences}) == 3
    assert all(token % 3 == 0 for s in sequences for token in s)


def test_a_seeded_draw_is_a_function_of_seed_and_position() -> None:
    """Replayed by another sampler, and resumed at position k after k tokens drawn elsewhere:
    the same tokens, so a seeded answer survives a migration. Only the position counts, not
    which tokens came before (the logits carry those)."""
    logits = random_logits(1, scale=1.0)
    opts = options(seed=77)
    whole = seeded_run(Sampler(), logits, opts, 30)
    assert seeded_run(Sampler(), logits, opts, 30) == whole
    assert whole[:12] + seeded_run(Sampler(), logits, opts, 18, output=whole[:12]) == whole
    assert seeded_run(Sampler(), logits, opts, 18, output=[0] * 12) == whole[12:]
    assert len(set(whole)) > 1


def test_seeded_uniforms_are_uniform_over_positions_and_seeds() -> None:
    by_position = torch.tensor([seeded_uniform(5, p) for p in range(20_000)], dtype=torch.float64)
    by_seed = torch.tensor([seeded_uniform(s, 3) for s in range(-10_000, 10_000)], dtype=torch.float64)
    for values in (by_position, by_seed):
        assert 0.0 <= float(values.min()) and float(values.max()) < 1.0
        counts = torch.histc(values, bins=10, min=0.0, max=1.0)
        assert (counts - 2000).abs().max() < 200  # about 4.7 standard deviations
        assert len(set(values.tolist())) == values.numel()
    # Every int64 seed is taken modulo 2**64, like a generator seed.
    assert seeded_uniform(-1, 9) == seeded_uniform(2**64 - 1, 9)
    assert seeded_uniform(INT64_MAX, 0) != seeded_uniform(INT64_MIN, 0)


def test_samples_follow_the_distribution() -> None:
    # 600 tokens span three CDF blocks; put mass in each of them.
    logits = torch.full((600,), -30.0)
    logits[[3, 255, 256, 300, 511, 512, 599]] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.7, 0.2])
    expected = logits.softmax(-1)
    num_draws = 4000
    rows = [row(options(seed=i)) for i in range(num_draws)]
    tokens = Sampler()(logits.expand(num_draws, -1), rows).token_ids
    frequency = torch.bincount(torch.tensor(tokens), minlength=600).double() / num_draws
    assert set(tokens) <= {3, 255, 256, 300, 511, 512, 599}
    assert (frequency - expected).abs().max() < 0.025


TRUNCATION_CONFIGS = {
    "top_k=5": dict(top_k=5),
    "top_p=0.6": dict(top_p=0.6),
    "top_p=0.95-hot": dict(top_p=0.95, temperature=1.5),
    "min_p=0.2": dict(min_p=0.2),
    "top_k=40,top_p=0.7": dict(top_k=40, top_p=0.7),
    "top_p=0.9,min_p=0.1": dict(top_p=0.9, min_p=0.1),
    "cold-top_p=0.99": dict(top_p=0.99, temperature=0.3),
}


@pytest.mark.parametrize("config", list(TRUNCATION_CONFIGS.values()), ids=list(TRUNCATION_CONFIGS))
def test_truncation_never_samples_excluded_tokens(config: dict[str, object]) -> None:
    opts = options(**config)
    logits = random_logits(1, scale=1.5, seed=5)[0]
    allowed = allowed_mask(logits, opts)
    num_draws = 2000
    rows = [row(msgspec.structs.replace(opts, seed=i)) for i in range(num_draws)]
    tokens = torch.tensor(Sampler()(logits.expand(num_draws, -1), rows).token_ids)
    assert allowed[tokens].all()
    # Not a degenerate pick: most of a small kept set shows up, and the kept set has several tokens.
    assert len(set(tokens.tolist())) >= min(int(allowed.sum()), 5)


@pytest.mark.parametrize("vocab", [300, 6000], ids=["vocab300", "vocab6000"])
@pytest.mark.parametrize("config", [
    dict(top_k=7), dict(top_p=0.5), dict(top_p=0.97), dict(top_k=300, top_p=0.9),
    dict(top_k=4500, top_p=0.99),
], ids=["top_k=7", "top_p=0.5", "top_p=0.97", "top_k=300,top_p=0.9", "top_k=4500,top_p=0.99"])
def test_cutoff_matches_naive_sort(vocab: int, config: dict[str, object]) -> None:
    # A flat distribution makes the nucleus wider than the first candidate rounds.
    logits = random_logits(4, vocab, seed=11, scale=0.3)
    logits[1] = random_logits(1, vocab, seed=12, scale=4.0)[0]
    logits[2, :50] = 2.0  # ties straddling the top-k boundary are kept together
    opts = options(**config)
    probs = logits.softmax(-1)
    cutoff = top_k_top_p_cutoff(probs, [opts.top_k] * 4, [opts.top_p] * 4)
    for i in range(4):
        assert torch.equal(probs[i] >= cutoff[i], allowed_mask(logits[i], opts)), f"row {i}"


def test_repetition_penalty_scales_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    opts = options(temperature=0.0, repetition_penalty=2.0, logprobs=5)
    out = Sampler()(logits, [row(opts, prompt=[0, 4], output=[1, 1])])
    penalized = torch.tensor([1.0, -2.0, 0.5, 3.0, -4.0])  # seen: 0, 1, 4; positive halved, negative doubled
    assert_logprobs_equal(out.logprobs[0].top, penalized)
    assert out.token_ids == [3]


def test_frequency_and_presence_penalties_use_output_counts() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    opts = options(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=5)
    # The prompt does not count; token 3 twice, token 1 once.
    out = Sampler()(logits, [row(opts, prompt=[0, 2, 4], output=[3, 1, 3])])
    penalized = torch.tensor([2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, 1.0])
    assert_logprobs_equal(out.logprobs[0].top, penalized)
    assert out.token_ids == [0]


def test_penalties_leave_other_rows_and_the_input_alone() -> None:
    logits = random_logits(3)
    original = logits.clone()
    rows = [row(options(temperature=0.0, logprobs=0)),
            row(options(temperature=0.0, repetition_penalty=1e3, logprobs=0),
                output=[int(logits[1].argmax())]),
            row(options(temperature=0.0, logprobs=0), output=[int(logits[2].argmax())])]
    out = Sampler()(logits, rows)
    assert torch.equal(logits, original)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] != int(logits[1].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.logprobs[2].logprob == pytest.approx(float(logits[2].log_softmax(-1).max()), abs=1e-5)


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "ignore-eos"])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0  # eos
    logits[0, 5] = 9.0  # a stop token id
    logits[0, 6] = 1.0
    opts = options(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=ignore_eos, logprobs=2)
    sampler = Sampler()
    picks = [sampler(logits, [row(opts, output=[7] * n, eos=[2])]) for n in range(4)]
    before_min = 2 if ignore_eos else 6  # with ignore_eos the eos id is an ordinary token
    assert [p.token_ids[0] for p in picks] == [before_min] * 3 + [2]
    if not ignore_eos:
        top = picks[0].logprobs[0].top
        assert top[0][0] == 6
        assert all(math.isfinite(lp) for _, lp in top)


@pytest.mark.parametrize("config", [
    dict(temperature=0.0), dict(temperature=0.5, top_p=0.7), dict(temperature=1.5),
], ids=["greedy", "cold-top_p", "hot"])
def test_logprobs_are_the_models_log_softmax(config: dict[str, object]) -> None:
    logits = random_logits(6, seed=3)
    ks = [0, 1, 5, 20, 20, None]
    rows = [row(options(logprobs=k, seed=i, **config)) for i, k in enumerate(ks)]
    out = Sampler()(logits, rows)
    reference = logits.log_softmax(-1)  # before temperature and truncation
    for i, k in enumerate(ks):
        entry = out.logprobs[i]
        if k is None:
            assert entry is None
            continue
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(float(reference[i, entry.token_id]), abs=1e-5)
        assert len(entry.top) == k
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        for token_id, lp in entry.top:
            assert lp == pytest.approx(float(reference[i, token_id]), abs=1e-5)
        if k:
            assert entry.top[0][0] == int(logits[i].argmax())


def test_logprobs_over_the_whole_vocab_normalize() -> None:
    logits = random_logits(2, vocab=16, seed=4)
    out = Sampler()(logits, [row(options(logprobs=16, seed=i)) for i in range(2)])
    for entry in out.logprobs:
        assert {t for t, _ in entry.top} == set(range(16))
        assert torch.tensor([lp for _, lp in entry.top]).logsumexp(0).item() == pytest.approx(0.0, abs=1e-5)


def test_unseeded_rows_share_one_stream_in_row_order() -> None:
    """Four unseeded rows in one step draw the next four values of one shared stream, in row
    order: exactly what one unseeded row draws over four steps from a sampler of that stream.
    A generator per row (seeded alike) would give four equal tokens; fresh ones, other tokens."""
    logits = random_logits(1, scale=0.5)
    shared = Sampler(seed=99)(logits.expand(4, -1), [row(options()) for _ in range(4)]).token_ids
    sampler = Sampler(seed=99)
    one_by_one = [sampler(logits, [row(options())]).token_ids[0] for _ in range(4)]
    assert shared == one_by_one
    assert len(set(shared)) > 1


def assert_logprobs_equal(top: list[tuple[int, float]], expected_logits: torch.Tensor) -> None:
    expected = expected_logits.log_softmax(-1)
    assert len(top) == expected.numel()
    for token_id, logprob in top:
        assert logprob == pytest.approx(float(expected[token_id]), abs=1e-5)


def test_token_ids_past_the_vocab_are_ignored() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    opts = options(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0, min_tokens=2,
                   stop_token_ids=[7], logprobs=3)
    out = Sampler()(logits, [row(opts, prompt=[1, 9], output=[12], eos=[5])])
    assert out.token_ids == [0]  # token 1 halved to tie with token 0: the lower id wins
    assert_logprobs_equal(out.logprobs[0].top, torch.tensor([1.0, 1.0, 0.5]))


@pytest.mark.gpu
def test_cuda_matches_cpu_greedy_and_replays_seeds() -> None:
    logits = random_logits(32, vocab=49152, seed=21).cuda()
    greedy = [row(options(temperature=0.0, logprobs=2)) for _ in range(32)]
    assert Sampler()(logits, greedy).token_ids == logits.cpu().argmax(-1).tolist()
    opts = options(top_p=0.9, top_k=100, min_p=0.01, repetition_penalty=1.2, seed=5)
    alone = Sampler()(logits[7:8], [row(opts, output=[3, 4])]).token_ids[0]
    rows = [row(options(seed=i)) for i in range(32)]
    rows[7] = row(opts, output=[3, 4])
    assert Sampler()(logits, rows).token_ids[7] == alone


def test_a_row_with_non_finite_logits_never_hurts_the_others() -> None:
    """NaN/inf in one row: that row is greedy over its finite logits (or fails alone when it has
    none); every other row gets what it gets without it."""
    logits = random_logits(4, seed=30)
    opts = [options(seed=1), options(seed=2, logprobs=2), options(seed=3), options(temperature=0.0)]
    clean = Sampler()(logits, [row(o) for o in opts])
    poisoned = logits.clone()
    poisoned[1, :500] = float("nan")
    poisoned[1, 500:510] = float("inf")
    poisoned[2] = float("nan")
    out = Sampler()(poisoned, [row(o) for o in opts])
    assert out.token_ids[1] == 510 + int(logits[1, 510:].argmax())
    assert out.logprobs[1].token_id == out.token_ids[1] and math.isfinite(out.logprobs[1].logprob)
    assert out.errors == [None, None, NO_FINITE_LOGITS, None]
    assert [out.token_ids[i] for i in (0, 3)] == [clean.token_ids[i] for i in (0, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_all_greedy_batch_with_broken_rows_leaves_its_fast_path(dtype: torch.dtype) -> None:
    """A plain greedy batch skips the fp32 copy, but a NaN, a +inf or a row with no finite logit
    still takes the full path: greedy over the finite logits, or an error for that row alone."""
    logits = random_logits(5, seed=31)
    poisoned = logits.clone()
    poisoned[1, :300] = float("nan")
    poisoned[2, 40] = float("inf")
    poisoned[3] = -math.inf
    poisoned = poisoned.to(dtype)
    out = Sampler()(poisoned, [row(options(temperature=0.0)) for _ in range(5)])
    expected = logits.to(dtype).float()
    assert out.token_ids[1] == 300 + int(expected[1, 300:].argmax())
    expected[2, 40] = -math.inf  # the +inf is not a token to pick: the rest of the row is
    assert out.token_ids[2] == int(expected[2].argmax())
    assert out.errors == [None, None, None, NO_FINITE_LOGITS, None]
    assert [out.token_ids[i] for i in (0, 4)] == [int(expected[i].argmax()) for i in (0, 4)]


@pytest.mark.parametrize("config", [
    dict(repetition_penalty=1e-300), dict(repetition_penalty=1e-300, temperature=0.0),
    dict(temperature=1e-38), dict(temperature=1e-5, top_p=0.5), dict(repetition_penalty=1e-36, temperature=1e-4),
], ids=["tiny-penalty", "tiny-penalty-greedy", "tiny-temperature", "floor-temperature", "overflow"])
def test_degenerate_parameters_give_valid_tokens(config: dict[str, object]) -> None:
    logits = random_logits(3, seed=31)
    logits[:, 7] = 50.0  # a seen token with a large logit: the penalty pushes it to inf
    rows = [row(options(seed=4, **config), prompt=[7, 9], output=[11]),
            row(options(temperature=0.0)), row(options(seed=5))]
    out = Sampler()(logits, rows)
    assert out.errors == [None] * 3
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert out.token_ids[1] == int(logits[1].argmax())


def test_tiny_temperatures_are_greedy() -> None:
    assert options(temperature=0.0).greedy and options(temperature=1e-38).greedy
    assert options(temperature=9.9e-6).greedy and not options(temperature=1e-5).greedy
    logits = random_logits(2, seed=32)
    out = Sampler()(logits, [row(options(temperature=1e-38, seed=1)) for _ in range(2)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_every_int64_seed_makes_a_shared_stream_generator() -> None:
    for seed in (INT64_MAX, INT64_MIN, -1, 0):
        make_generator(seed)
    # Seeds are taken modulo 2**64: the same stream, not an error.
    assert torch.equal(torch.rand(4, generator=make_generator(2**64 + 3)), torch.rand(4, generator=make_generator(3)))
    assert torch.equal(torch.rand(4, generator=make_generator(-1)), torch.rand(4, generator=make_generator(2**64 - 1)))


def test_one_rows_wide_top_k_neither_widens_nor_changes_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row asking for top_k near the vocabulary sorts only itself: the rows beside it take their
    candidates as they would alone, and every cut-off is the one the row gets alone."""
    torch.manual_seed(3)
    vocab = 20_000
    probs = torch.randn(5, vocab).mul(3).softmax(-1)
    top_ks, top_ps = [40, 0, vocab - 1, 40, 0], [1.0, 0.9, 1.0, 0.95, 1.0]
    alone = [top_k_top_p_cutoff(probs[i:i + 1], [top_ks[i]], [top_ps[i]]) for i in range(5)]
    calls: list[tuple[int, int]] = []
    real_topk = torch.Tensor.topk

    def recorded(self: torch.Tensor, k: int, *args: object, **kwargs: object) -> object:
        calls.append((self.shape[0], k))
        return real_topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", recorded)
    together = top_k_top_p_cutoff(probs, top_ks, top_ps)
    assert torch.equal(together, torch.cat(alone))
    assert all(k < 5000 for rows, k in calls if rows > 1), calls  # only the wide row sorts wide


def _penalized_logprobs(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The chosen tokens' logprobs, after penalties: what the penalty state decides."""
    out = sampler(logits, rows)
    return torch.tensor([entry.logprob for entry in out.logprobs])  # type: ignore[union-attr]


def test_a_kept_penalty_state_gives_what_a_fresh_one_does_step_after_step() -> None:
    """Penalized requests decoding over many steps (the output growing one token a step, sometimes
    several, as after a preemption), a request replaced by a new one under the same id, and a
    request without an id: each step's penalized logits are those computed from the tokens alone."""
    opts = [options(temperature=0.0, repetition_penalty=1.4, logprobs=0),
            options(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2, logprobs=0),
            options(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3, logprobs=0)]
    prompts = [[5, 9, 9, 13, VOCAB + 3], [1, 2, 3], list(range(100, 400))]
    outputs: list[list[int]] = [[], [7], []]
    kept, fresh = Sampler(), Sampler()
    for step in range(12):
        if step == 6:  # request "r1" ends; a new one takes its id, with a new output list
            outputs[1] = [7, 7, 8]
        logits = random_logits(3, seed=step)
        each = list(zip(opts, prompts, outputs, strict=True))
        with_state = [SamplingRow(o, p, out, [], request_id=f"r{i}") for i, (o, p, out) in enumerate(each)]
        stateless = [row(o, p, list(out)) for o, p, out in each]
        assert torch.equal(_penalized_logprobs(kept, logits, with_state),
                           _penalized_logprobs(fresh, logits, stateless)), step
        for i, out in enumerate(outputs):
            out.extend([(step * 31 + i * 7) % VOCAB] * (3 if step == 4 else 1))


def test_logit_bias_adds_to_its_tokens_in_its_row_only() -> None:
    logits = random_logits(3)
    top = logits.argmax(-1).tolist()
    rows = [row(options(temperature=0.0, logit_bias={7: 100.0}, logprobs=0)),
            row(options(temperature=0.0, logit_bias={top[1]: -100.0, VOCAB + 5: 50.0})),
            row(options(temperature=0.0))]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == 7 and out.token_ids[2] == top[2]
    assert out.token_ids[1] == logits[1].topk(2).indices[1].item()  # the best one banned: the next best
    # Logprobs are read after the bias.
    assert out.logprobs[0] is not None and out.logprobs[0].logprob > math.log(0.99)


def test_more_penalized_rows_than_the_cache_keeps_keep_their_states_between_steps() -> None:
    """A step's own rows are never dropped from the penalty cache, however many there are: each
    row's state is taken in, not rebuilt from its prompt, at the next step."""
    rows_n = 80  # more than the states kept beyond a step's own
    opts = options(temperature=0.0, repetition_penalty=1.2)
    prompts = [[i, i + 1, i + 2] for i in range(rows_n)]
    outputs: list[list[int]] = [[] for _ in range(rows_n)]
    sampler = Sampler()
    kept: dict[str, object] = {}
    for step in range(3):
        rows = [SamplingRow(opts, p, out, [], request_id=f"r{i}")
                for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))]
        for i, token in enumerate(sampler(random_logits(rows_n, seed=step), rows).token_ids):
            outputs[i].append(token)
        states = {rid: sampler._penalty_states[rid] for rid in (f"r{i}" for i in range(rows_n))}
        if kept:
            assert all(states[rid] is kept[rid] for rid in kept), "a row's state was rebuilt"
        kept = states  # type: ignore[assignment]


def test_a_penalty_state_whose_update_fails_is_left_as_it_was_and_catches_up_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose penalty update fails (a device out of memory while the new tokens' tensors are
    built) leaves the request's state as it was, not half moved: the next step takes in every
    token since, and the penalties equal a fresh computation's."""
    opts = options(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=0)
    prompt, output = [3, 4, 5], [6]
    kept, fresh = Sampler(), Sampler()
    kept(random_logits(1, seed=0), [SamplingRow(opts, prompt, output, [], request_id="r")])
    state = kept._penalty_states["r"]
    before = (state.seen_ids.clone(), state.out_ids.clone(), state.out_counts.clone(), set(state.seen),
              dict(state.out_index), state.counted)
    output.extend([7, 6, 8])
    real_cat = torch.cat

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("no room for the new tokens")

    monkeypatch.setattr(torch, "cat", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        state.catch_up()
    monkeypatch.setattr(torch, "cat", real_cat)
    after = (state.seen_ids, state.out_ids, state.out_counts, state.seen, state.out_index, state.counted)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3], strict=True)) and before[3:] == after[3:]
    logits = random_logits(1, seed=1)
    assert torch.equal(_penalized_logprobs(kept, logits, [SamplingRow(opts, prompt, output, [], request_id="r")]),
                       _penalized_logprobs(fresh, logits, [row(opts, prompt, list(output))]))
