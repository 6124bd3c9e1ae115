"""Which dtype the engine runs its weights and activations in: among those this CPU can run, by
measurement on this machine.

CPUs disagree about bf16: AVX2-only parts cannot run oneDNN's bf16 path at all (nor its fp16
one without AVX512-FP16 or AVX-NE-CONVERT), AVX-512-BF16 and AMX parts run it 2–6× faster once a
batch has a few rows. So on CPU `auto` first keeps the candidates oneDNN says this CPU supports
(`engine.cpu.cpu_support`; the others are never tried, not even timed). Where only fp32 is left it is
the choice, with no measurement. Otherwise it times the model's own projection shapes (every
linear layer of the model as built, the LM head) for the three row counts the engine runs: one
decoding sequence, a full decode batch (`max_num_seqs` rows) and a prefill chunk; and takes the
dtype with the lowest geometric mean of time relative to fp32, if it beats fp32 by `MIN_GAIN`.
fp32 wins ties: it is the accurate one. On CUDA `auto` is bfloat16. An explicit dtype
(`HELEXA_DTYPE`) is taken as it is where the CPU runs it and refused (`UnsupportedDtype`, one
line naming the missing CPU feature) where it does not. A measurement is remembered per machine,
candidates and model shapes (`engine.cpu.dtype_cache`), so restarts do not repeat it. Every choice
comes with a sentence saying why (`DtypeChoice.detail`), which the worker logs, puts in its
`ready` line and publishes in its node status.

Whatever the choice, the precision-sensitive parts stay in fp32 in the model code: norm
statistics, softmax, sampling (logits are upcast) and the hybrid models' recurrent state.

Weights are random: only their shapes and bytes matter to the clock. Memory-bound shapes are
timed over enough distinct weights to stream from memory as the real model does (a budget of
`STREAM_BUDGET` elements), compute-bound ones over fewer; each time is scaled up to the whole
model. Each figure is the fastest of `REPEATS` passes (see `measure`). Each linear is timed as the
engine runs it (`engine.cpu.cpu_linear.linear_op`: prepacked for oneDNN in fp32 and bf16, and
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

from engine.cpu import cpu_linear, cpu_support, dtype_cache
from engine.frontend.engine_config import EngineConfig
from engine.loading.model_config import ModelConfig

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
# What the start-up log line promises a measurement takes (a few seconds on 2 to 16 cores).
MEASURE_ESTIMATE = "~10 s"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    rows: int
    with_lm_head: bool  # a decode step computes logits for every row; a prefill chunk for ~none
    budget: int


@dataclass(slots=True)
class DtypeChoice:
    dtype: str
    # "measured"; "configured"; "cuda"; "only-supported": fp32, the only candidate this CPU runs.
    reason: str
    # Why, in a sentence for operators (log, ready line, node status).
    detail: str = ""
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


def supported_candidates() -> tuple[str, ...]:
    """The candidates this CPU runs (`engine.cpu.cpu_support`), fp32 always among them."""
    return tuple(d for d in CANDIDATES if cpu_support.dtype_supported(d))


def choose_dtype(config: EngineConfig, model_config: ModelConfig, device: str,
                 cache: Path | None = None) -> DtypeChoice:
    """The configured dtype (refused with `UnsupportedDtype` where this CPU cannot run it);
    bfloat16 on CUDA; on CPU float32 where it is the only dtype the CPU runs, else the measured one
    (remembered in `cache`, see `engine.cpu.dtype_cache`, keyed by this CPU, torch, its threads, the
    candidates and the measured shapes)."""
    if config.dtype != "auto":
        cpu_support.require(config.dtype, device)
        result = DtypeChoice(config.dtype, "configured", f"configured ({config.dtype})")
        log.info("dtype %s as configured", result.dtype)
        return result
    if device != "cpu":
        return DtypeChoice("bfloat16", device, f"bfloat16 on {device}")
    candidates = supported_candidates()
    unsupported = [cpu_support.unsupported_reason(d) for d in CANDIDATES if d not in candidates]
    cpu = f"CPU: {cpu_support.flags_summary()}"
    if candidates == ("float32",):
        result = DtypeChoice("float32", "only-supported", "; ".join([*unsupported, cpu]))
        log.info("dtype float32, not measured: %s", result.detail)
        return result
    cases = scenarios(config)
    key = dtype_cache.cache_key(torch.__version__, torch.get_num_threads(), linear_shapes(model_config),
                                [(c.rows, c.with_lm_head, c.budget) for c in cases], candidates, MIN_GAIN,
                                cpu_linear.method())
    entry = dtype_cache.load(cache, key) if cache is not None else None
    if entry is not None:
        timings = entry["timings_ms"]
        detail = "; ".join([f"measured on this machine at {entry.get('measured_at')}: "
                            f"{describe(timings, candidates, entry['dtype'])}", *unsupported, cpu])
        result = DtypeChoice(entry["dtype"], "measured", detail, timings, entry["measure_s"])
        log.info("dtype %s as measured before (%s): %s", result.dtype, cache, result.detail,
                 extra={"timings_ms": timings})
        return result
    log.info("measuring %s on the model's shapes (once per machine and model, %s) ...", " vs ".join(candidates),
             MEASURE_ESTIMATE)
    start = time.perf_counter()
    timings = measure(model_config, cases, candidates)
    dtype = pick(timings)
    measure_s = round(time.perf_counter() - start, 2)
    detail = "; ".join([f"measured in {measure_s:.1f} s: {describe(timings, candidates, dtype)}",
                        *unsupported, cpu])
    result = DtypeChoice(dtype, "measured", detail, timings, measure_s)
    log.info("dtype %s: %s", result.dtype, result.detail, extra={"timings_ms": timings})
    if cache is not None:
        dtype_cache.store(cache, key, {"dtype": result.dtype, "timings_ms": timings,
                                       "measure_s": result.measure_s})
    return result


def relative_time(timings: dict[str, dict[str, float]], dtype: str) -> float:
    """`dtype`'s time over fp32's: the geometric mean over the scenarios."""
    base = timings["float32"]
    ratios = [timings[dtype][name] / base[name] for name in base]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def describe(timings: dict[str, dict[str, float]], candidates: tuple[str, ...], picked: str) -> str:
    """The measurement in words: each candidate's time relative to fp32's, and the pick."""
    rows = "/".join(name.removeprefix("rows_") for name in timings["float32"])
    compared = [f"{d} at {relative_time(timings, d):.2f}x float32's time over {rows} rows" for d in timings
                if d != "float32"]
    compared += [f"{d} slower on one layer, not measured further" for d in candidates if d not in timings]
    return f"{picked} ({', '.join(compared)}; another dtype must be {MIN_GAIN}x faster than float32)"


def pick(timings: dict[str, dict[str, float]]) -> str:
    """The dtype with the lowest geometric mean of time relative to fp32, if it gains MIN_GAIN."""
    best = min(timings, key=lambda dtype: relative_time(timings, dtype))
    return best if relative_time(timings, best) * MIN_GAIN <= 1.0 else "float32"


def measure(model_config: ModelConfig, cases: list[Scenario],
            candidates: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """Estimated ms of the model's projections per scenario and dtype, for `candidates` (default:
    those this CPU runs; a dtype it cannot run is never timed). A candidate slower than
    fp32 at a decode batch on one layer's shapes is not measured further (fp16 without fp16
    arithmetic takes seconds where fp32 takes milliseconds)."""
    shapes, lm_head = linear_shapes(model_config)
    if candidates is None:
        candidates = supported_candidates()
    candidates = tuple(d for d in candidates if d == "float32" or worth_measuring(d, shapes, cases[1].rows))
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


def worth_measuring(dtype: str, shapes: list[tuple[int, int]], rows: int) -> bool:
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
            times[name].append(_clock(lambda: _linears(inputs, ops)))  # noqa: B023  (_clock calls it in this iteration)
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
