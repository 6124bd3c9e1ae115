"""The scenarios of SPEC §10, each turning streamed requests into one run's results and scores.

Every scenario returns an `Outcome`: the run's `results` (kept whole in `bench_runs.results`) and the
headline numbers as scores (one `scores` row each). A scenario whose every request failed returns an
outcome with `error` set, so a broken target is recorded rather than silently skipped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from apps.bench.client import StreamFailed, StreamResult, chat_body, stream_chat
from apps.bench.config import BenchConfig, ScenarioSpec, Target
from apps.bench.stats import flatness, flatness_verdict, median, percentile

SWAP_UNAVAILABLE = "swap needs helexa workers with model control"
# Common words that most tokenizers keep as one token each with their leading space.
_WORDS = ("the river moves slowly past old stone houses while children play near green fields and "
          "birds sing above quiet roads under a wide blue sky").split()


def build_prompt(approx_tokens: int) -> str:
    """About `approx_tokens` tokens of prose, led by a random tag, so no prompt is served from the
    prefix cache of an earlier sample (or an earlier bench) and every prefill is measured in full."""
    words = [_WORDS[i % len(_WORDS)] for i in range(max(approx_tokens - 16, 8))]
    return f"Sample {uuid.uuid4().hex[:8]}. Continue this story in your own words: " + " ".join(words)


@dataclass(slots=True)
class Score:
    metric: str
    value: float
    unit: str | None = None


@dataclass(slots=True)
class Outcome:
    scenario: str
    started_at: float
    finished_at: float = 0.0
    results: dict[str, Any] = field(default_factory=dict)
    scores: list[Score] = field(default_factory=list)
    error: str | None = None

    def score(self, metric: str, value: float | None, unit: str | None) -> None:
        if value is not None:
            self.scores.append(Score(metric, float(value), unit))


@dataclass(slots=True)
class BenchContext:
    config: BenchConfig
    target: Target
    model: str
    http: httpx.AsyncClient
    # Called once per finished request (success or not), to move the progress bar.
    advance: Callable[[int], None] = lambda n: None


def planned_requests(spec: ScenarioSpec, config: BenchConfig) -> int:
    """How many requests a scenario sends, for the progress bar's total."""
    return {
        "chat": config.samples,
        "concurrency": config.samples * spec.size,
        "context": config.samples * len(spec.rungs),
    }.get(spec.kind, 1)


async def _one(ctx: BenchContext, body: dict[str, Any]) -> StreamResult | StreamFailed:
    try:
        return await stream_chat(ctx.http, body, ctx.config.timeout_s)
    except StreamFailed as exc:
        return exc
    finally:
        ctx.advance(1)


async def _samples(ctx: BenchContext, prompt_tokens: int) -> tuple[list[StreamResult], list[str]]:
    """`samples` requests one after another: the batch-1 view of a prompt size."""
    ok: list[StreamResult] = []
    errors: list[str] = []
    for _ in range(ctx.config.samples):
        body = chat_body(ctx.model, build_prompt(prompt_tokens), ctx.config.max_tokens)
        result = await _one(ctx, body)
        if isinstance(result, StreamFailed):
            errors.append(str(result))
        else:
            ok.append(result)
    return ok, errors


def _summary(results: list[StreamResult]) -> dict[str, Any]:
    ttfts = [r.ttft_s * 1000 for r in results]
    decode = [v for v in (r.decode_tok_s[0] for r in results) if v is not None]
    prefill = [v for v in (r.prefill_tok_s[0] for r in results) if v is not None]
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    return {
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p95_ms": percentile(ttfts, 95),
        "e2e_p50_ms": percentile([r.total_s * 1000 for r in results], 50),
        "decode_tok_s": median(decode),
        "prefill_tok_s": median(prefill),
        "prompt_tokens": median(prompt),
    }


async def run_chat(ctx: BenchContext, spec: ScenarioSpec, outcome: Outcome) -> None:
    ok, errors = await _samples(ctx, spec.size)
    outcome.results = {"prompt_size": spec.size, **_summary(ok), "samples": [r.metrics() for r in ok],
                       "errors": errors}
    if not ok:
        outcome.error = f"all {len(errors)} samples failed: {errors[0]}"
        return
    for metric in ("ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms"):
        outcome.score(metric, outcome.results[metric], "ms")
    outcome.score("prefill_tok_s", outcome.results["prefill_tok_s"], "tok/s")
    outcome.score("decode_tok_s", outcome.results["decode_tok_s"], "tok/s")


async def _burst(ctx: BenchContext, n: int) -> dict[str, Any]:
    """n identical streams at once; node throughput is all their tokens over the burst's wall time."""
    body = chat_body(ctx.model, build_prompt(ctx.config.concurrency_prompt_tokens), ctx.config.max_tokens)
    start = time.perf_counter()
    results = await asyncio.gather(*(_one(ctx, body) for _ in range(n)))
    window = time.perf_counter() - start
    ok = [r for r in results if isinstance(r, StreamResult)]
    failed = [r for r in results if isinstance(r, StreamFailed)]
    return {
        "window_s": window,
        "ttft_ms": [r.ttft_s * 1000 for r in ok],
        "queue_ms": [q for q in (r.queue_ms for r in ok) if q is not None],
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "throughput_tok_s": sum(r.completion_tokens for r in ok) / window if ok and window > 0 else None,
        "shed": sum(1 for f in failed if f.shed),
        "errors": [str(f) for f in failed if not f.shed],
    }


async def run_concurrency(ctx: BenchContext, spec: ScenarioSpec, outcome: Outcome) -> None:
    bursts = [await _burst(ctx, spec.size) for _ in range(ctx.config.samples)]
    ttfts = [t for b in bursts for t in b["ttft_ms"]]
    queue = [q for b in bursts for q in b["queue_ms"]]
    throughput = [b["throughput_tok_s"] for b in bursts if b["throughput_tok_s"] is not None]
    shed = sum(b["shed"] for b in bursts)
    failed = sum(len(b["errors"]) for b in bursts)
    outcome.results = {
        "concurrency": spec.size,
        "prompt_size": ctx.config.concurrency_prompt_tokens,
        "ttft_median_ms": median(ttfts),
        "ttft_p95_ms": percentile(ttfts, 95),
        "throughput_tok_s": median(throughput),
        "queue_wait_median_ms": median(queue),
        "shed": shed,
        "failed": failed,
        "bursts": bursts,
    }
    if not ttfts:
        errors = [e for b in bursts for e in b["errors"]]
        outcome.error = f"every stream of every burst failed ({shed} shed by admission)" + (
            f": {errors[0]}" if errors else "")
        return
    outcome.score("ttft_median_ms", outcome.results["ttft_median_ms"], "ms")
    outcome.score("ttft_p95_ms", outcome.results["ttft_p95_ms"], "ms")
    outcome.score("throughput_tok_s", outcome.results["throughput_tok_s"], "tok/s")
    outcome.score("queue_wait_median_ms", outcome.results["queue_wait_median_ms"], "ms")
    outcome.score("shed", shed, "requests")
    outcome.score("failed", failed, "requests")


async def run_context(ctx: BenchContext, spec: ScenarioSpec, outcome: Outcome) -> None:
    """The context ladder: the batch-1 chat measurement at each size, and how decode holds up."""
    points: list[dict[str, Any]] = []
    errors: list[str] = []
    for rung in spec.rungs:
        ok, rung_errors = await _samples(ctx, rung)
        errors.extend(rung_errors)
        points.append({"context": rung, "samples": len(ok), **_summary(ok)})
    with_decode = [p for p in points if p["decode_tok_s"] is not None]
    ratio = flatness(with_decode[0]["decode_tok_s"], with_decode[-1]["decode_tok_s"]) if len(with_decode) > 1 else None
    outcome.results = {"points": points, "decode_flatness": ratio, "verdict": flatness_verdict(ratio),
                       "errors": errors}
    if not any(p["samples"] for p in points):
        outcome.error = f"every sample failed: {errors[0]}"
        return
    outcome.score("decode_flatness", ratio, "ratio")
    for p in points:
        outcome.score(f"prefill_tok_s@{p['context']}", p["prefill_tok_s"], "tok/s")
        outcome.score(f"decode_tok_s@{p['context']}", p["decode_tok_s"], "tok/s")


async def run_capability(ctx: BenchContext, spec: ScenarioSpec, outcome: Outcome) -> None:
    """A fixed prompt at temperature 0; the full text is the artifact a scorer reads later."""
    probe = next(c for c in ctx.config.capabilities if c.name == spec.capability)
    result = await _one(ctx, chat_body(ctx.model, probe.prompt, probe.max_tokens))
    if isinstance(result, StreamFailed):
        outcome.error = str(result)
        return
    outcome.results = {"prompt": probe.prompt, "text": result.text, "reasoning": result.reasoning,
                       **result.metrics()}
    outcome.score("ttft_ms", result.ttft_s * 1000, "ms")
    outcome.score("completion_tokens", result.completion_tokens, "tokens")


async def run_swap(ctx: BenchContext, spec: ScenarioSpec, outcome: Outcome) -> None:
    """Unload the model, load it again, then time the cold first request (our workers only)."""
    try:
        from apps.fleet.control_client import load_model, unload_model
    except ImportError:
        outcome.error = SWAP_UNAVAILABLE
        return
    if not ctx.target.nats_url:
        outcome.error = f"{SWAP_UNAVAILABLE}: set nats_url on target {ctx.target.name!r}"
        return
    from apps.bus import connection, roles

    # Loading and unloading models is the operator's: the target's nats_url is an operator's URL.
    nc = await connection.connect(ctx.target.nats_url, "helexa-bench", role=roles.OPERATOR)
    try:
        started = time.perf_counter()
        await unload_model(nc, ctx.model, timeout_s=ctx.config.swap_timeout_s)
        unloaded = time.perf_counter()
        await load_model(nc, ctx.model, timeout_s=ctx.config.swap_timeout_s)
        loaded = time.perf_counter()
    except Exception as exc:  # whatever model control raises, the run records it and the bench goes on
        outcome.error = f"model control failed: {type(exc).__name__}: {exc}"
        return
    finally:
        await nc.close()
    cold = await _one(ctx, chat_body(ctx.model, build_prompt(128), ctx.config.max_tokens))
    outcome.results = {"unload_ms": (unloaded - started) * 1000, "load_ms": (loaded - unloaded) * 1000}
    if isinstance(cold, StreamFailed):
        outcome.error = f"cold request after reload failed: {cold}"
        return
    outcome.results["cold"] = cold.metrics()
    outcome.score("unload_ms", outcome.results["unload_ms"], "ms")
    outcome.score("load_ms", outcome.results["load_ms"], "ms")
    outcome.score("cold_ttft_ms", cold.ttft_s * 1000, "ms")
    outcome.score("cold_e2e_ms", cold.total_s * 1000, "ms")


_RUNNERS = {
    "chat": run_chat,
    "concurrency": run_concurrency,
    "context": run_context,
    "capability": run_capability,
    "swap": run_swap,
}


async def run_scenario(ctx: BenchContext, spec: ScenarioSpec) -> Outcome:
    outcome = Outcome(scenario=spec.name, started_at=time.time())
    try:
        await _RUNNERS[spec.kind](ctx, spec, outcome)
    except (StreamFailed, OSError, TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.finished_at = time.time()
    return outcome
