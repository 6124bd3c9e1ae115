"""Which dtype the engine runs its weights and activations in: by measurement on this machine.

CPUs disagree about bf16: AVX2-only parts run a bf16 linear ~3× slower than fp32, AVX-512-BF16
and AMX parts 2–6× faster once a batch has a few rows, and fp16 is fast only where the CPU has
fp16 arithmetic. So on CPU `auto` times the model's own projection shapes (every linear layer of
the model as built, the LM head) for the three row counts the engine runs: one decoding
sequence, a full decode batch (`max_num_seqs` rows) and a prefill chunk; and takes the dtype with
the lowest geometric mean of time relative to fp32, if it beats fp32 by `MIN_GAIN`. fp32 wins
ties: it is the accurate one. On CUDA `auto` is bfloat16. An explicit dtype (`HELEXA_DTYPE`) is
taken as it is. A measurement is remembered per machine and model shapes (`engine.dtype_cache`),
so restarts do not repeat it.

Whatever the choice, the precision-sensitive parts stay in fp32 in the model code: norm
statistics, softmax, sampling (logits are upcast) and the hybrid models' recurrent state.

Weights are random: only their shapes and bytes matter to the clock. Memory-bound shapes are
timed over enough distinct weights to stream from memory as the real model does (a budget of
`STREAM_BUDGET` elements), compute-bound ones over fewer; each time is scaled up to the whole
model. Each figure is the fastest of `REPEATS` passes (see `measure`). Each linear is timed as the
engine runs it (`engine.cpu_linear.linear_op`: prepacked for oneDNN in fp32 and bf16, and
through the bf16 kernel for a few rows where it is faster).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine import cpu_linear, dtype_cache
from engine.config import ModelConfig
from engine.engine_config import EngineConfig

log = logging.getLogger("helexa.engine")

CANDIDATES = ("float32", "bfloat16", "float16")
# The chosen dtype must be at least this much faster than fp32 (geometric mean over the shapes).
MIN_GAIN = 1.1
# Weight elements streamed per timed pass: past any L3 cache, as the real model's decode step is.
STREAM_BUDGET = 32_000_000
# A prefill chunk is compute-bound: fewer weights suffice (and keep start-up short).
COMPUTE_BUDGET = 2_000_000
PREFILL_ROWS = 512
REPEATS = 4
# A candidate this many times slower than fp32 on a pass is not timed again for that scenario.
HOPELESS = 4.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    rows: int
    with_lm_head: bool  # a decode step computes logits for every row; a prefill chunk for ~none
    budget: int


@dataclass(slots=True)
class DtypeChoice:
    dtype: str
    reason: str  # "measured", "configured", "cuda"
    # dtype -> scenario -> estimated ms of the model's projections for that many rows
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    measure_s: float = 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def scenarios(config: EngineConfig) -> list[Scenario]:
    chunk = max(1, min(config.max_num_batched_tokens, PREFILL_ROWS))
    return [Scenario("rows_1", 1, True, STREAM_BUDGET),
            Scenario(f"rows_{config.max_num_seqs}", config.max_num_seqs, True, STREAM_BUDGET),
            Scenario(f"rows_{chunk}", chunk, False, COMPUTE_BUDGET)]


def linear_shapes(model_config: ModelConfig) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of every linear layer of the model as it runs (packed projections packed), in
    order, and the LM head's; built on the meta device, so nothing is allocated."""
    from engine.models import get_model_class

    with torch.device("meta"):
        model = get_model_class(model_config.model_type)(model_config)
    shapes = [(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and not name.endswith("lm_head")]
    return shapes, (model_config.hidden_size, model_config.vocab_size)


def choose_dtype(config: EngineConfig, model_config: ModelConfig, device: str,
                 cache: Path | None = None) -> DtypeChoice:
    """The configured dtype; bfloat16 on CUDA; on CPU the measured one (remembered in `cache`,
    see `engine.dtype_cache`, keyed by this CPU, torch, its threads and the measured shapes)."""
    if config.dtype != "auto":
        return DtypeChoice(config.dtype, "configured")
    if device != "cpu":
        return DtypeChoice("bfloat16", device)
    cases = scenarios(config)
    key = dtype_cache.cache_key(torch.__version__, torch.get_num_threads(), linear_shapes(model_config),
                                [(c.rows, c.with_lm_head, c.budget) for c in cases], CANDIDATES, MIN_GAIN,
                                cpu_linear.method())
    entry = dtype_cache.load(cache, key) if cache is not None else None
    if entry is not None:
        result = DtypeChoice(entry["dtype"], "measured", entry["timings_ms"], entry["measure_s"])
        log.info("dtype %s as measured on this machine at %s (%s): %s", result.dtype,
                 entry.get("measured_at"), cache, result.timings_ms)
        return result
    start = time.perf_counter()
    timings = measure(model_config, cases)
    result = DtypeChoice(pick(timings), "measured", timings, round(time.perf_counter() - start, 2))
    log.info("dtype %s by measurement (%.1f s): %s", result.dtype, result.measure_s, timings)
    if cache is not None:
        dtype_cache.store(cache, key, {"dtype": result.dtype, "timings_ms": timings,
                                       "measure_s": result.measure_s})
    return result


def pick(timings: dict[str, dict[str, float]]) -> str:
    """The dtype with the lowest geometric mean of time relative to fp32, if it gains MIN_GAIN."""
    base = timings["float32"]

    def relative(dtype: str) -> float:
        ratios = [timings[dtype][name] / base[name] for name in base]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    best = min(timings, key=relative)
    return best if relative(best) * MIN_GAIN <= 1.0 else "float32"


def measure(model_config: ModelConfig, cases: list[Scenario],
            candidates: tuple[str, ...] = CANDIDATES) -> dict[str, dict[str, float]]:
    """Estimated ms of the model's projections per scenario and dtype. A candidate slower than
    fp32 at a decode batch on one layer's shapes is not measured further (fp16 without fp16
    arithmetic takes seconds where fp32 takes milliseconds)."""
    shapes, lm_head = linear_shapes(model_config)
    candidates = tuple(d for d in candidates if d == "float32" or _worth_measuring(d, shapes, cases[1].rows))
    budget = max(case.budget for case in cases)
    stack, _ = _prefix(shapes, budget)
    head_rows = min(lm_head[1], max(budget // lm_head[0], 1))
    weights = {d: _Weights(stack, lm_head[0], head_rows, getattr(torch, d)) for d in candidates}
    timings: dict[str, dict[str, float]] = {d: {} for d in candidates}
    for case in cases:
        used, scale = _prefix(shapes, case.budget)
        passes: dict[str, list[float]] = {}
        for dtype, w in weights.items():
            w.time_ms(case, len(used), scale, 1.0)  # picks kernels, faults in pages
            passes[dtype] = []
        for _ in range(REPEATS):
            # Interleaved, so a busy moment on a shared machine hits every dtype alike.
            for dtype, w in weights.items():
                fp32 = min(passes["float32"], default=None) if dtype != "float32" else None
                if fp32 is not None and passes[dtype] and min(passes[dtype]) > HOPELESS * fp32:
                    continue
                passes[dtype].append(w.time_ms(case, len(used), scale, lm_head[1] / head_rows))
        for dtype in candidates:
            # The fastest pass: a descheduled OpenMP thread makes single passes 10-50x slower,
            # never faster, so the minimum is the machine's own speed.
            timings[dtype][case.name] = round(min(passes[dtype]), 3)
    return timings


class _Weights:
    """Random weights of the stack's shapes and an LM head slice, in one dtype."""

    def __init__(self, stack: list[tuple[int, int]], hidden: int, head_rows: int,
                 dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.stack = [_weight(o, i, dtype) for i, o in stack]
        self.head = _weight(head_rows, hidden, dtype)
        # Timed as the engine runs them: prepacked for oneDNN where they can be.
        self.stack_ops = [cpu_linear.linear_op(w) for w in self.stack]
        self.head_op = cpu_linear.linear_op(self.head)

    def time_ms(self, case: Scenario, num_used: int, stack_scale: float, head_scale: float) -> float:
        """One pass over the first `num_used` weights (and the head for decodes), scaled up."""
        inputs = {w.shape[1]: torch.randn(case.rows, w.shape[1]).to(self.dtype)
                  for w in self.stack[:num_used]}
        used = list(zip(self.stack[:num_used], self.stack_ops[:num_used], strict=True))
        stack = _clock(lambda: [op(inputs[w.shape[1]]) for w, op in used])
        head = 0.0
        if case.with_lm_head:
            x = torch.randn(case.rows, self.head.shape[1]).to(self.dtype)
            head = _clock(lambda: self.head_op(x))
        return (stack * stack_scale + head * head_scale) * 1000


def _worth_measuring(dtype: str, shapes: list[tuple[int, int]], rows: int) -> bool:
    """Whether `dtype` beats fp32 on one layer's shapes at `rows`: the fastest of `REPEATS`
    passes each, interleaved as in `measure` (the worker measures while the services beside it
    start: timed one dtype after the other, a busy moment can fall on one dtype's passes alone)."""
    layer, _ = _prefix(shapes, COMPUTE_BUDGET)
    runs = {}
    for name in ("float32", dtype):
        weights = [_weight(o, i, getattr(torch, name)) for i, o in layer]
        inputs = [torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights]
        ops = [cpu_linear.linear_op(w) for w in weights]
        _linears(inputs, ops)  # picks kernels, faults in pages
        runs[name] = (inputs, ops)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name, (inputs, ops) in runs.items():
            times[name].append(_clock(lambda: _linears(inputs, ops)))  # noqa: B023
    return min(times[dtype]) < min(times["float32"])


def _linears(inputs: list[torch.Tensor], ops: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    for x, op in zip(inputs, ops, strict=True):
        op(x)


def _prefix(shapes: list[tuple[int, int]], budget: int) -> tuple[list[tuple[int, int]], float]:
    """The leading shapes holding about `budget` weight elements, and total / their elements."""
    total = sum(i * o for i, o in shapes)
    taken, elements = [], 0
    for i, o in shapes:
        if taken and elements + i * o > budget:
            break
        taken.append((i, o))
        elements += i * o
    return taken, total / max(elements, 1)


def _weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(out_features, in_features, dtype=dtype).uniform_(-0.05, 0.05)


def _clock(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
