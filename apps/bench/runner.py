"""The run loop of `helexa bench run`: every scenario on every target and model, with a progress bar."""

from __future__ import annotations

import contextlib

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from apps.bench.client import http_client
from apps.bench.config import BenchConfig, ScenarioSpec
from apps.bench.publish import EventPublisher, ResultsFile, outcome_events
from apps.bench.scenarios import BenchContext, planned_requests, run_scenario
from apps.settings import bus_limits


async def run_bench(config: BenchConfig, specs: list[ScenarioSpec], nats_url: str | None,
                    out: str | None, console: Console) -> int:
    """Every scenario on every target and model, publishing each run as soon as it ends, so an
    interrupted bench keeps what it measured. Returns how many runs failed."""
    results = ResultsFile()
    failures = 0
    config_snapshot = msgspec.to_builtins(config)
    for entry in config_snapshot["targets"]:
        entry.pop("api_key", None)  # every event carries the config; never the keys
    plan = [(t, m, s) for t in config.targets for m in config.models_for(t) for s in specs]
    total = sum(planned_requests(s, config) for _, _, s in plan)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    async with contextlib.AsyncExitStack() as stack:
        publisher = await stack.enter_async_context(EventPublisher(nats_url, bus_limits())) if nats_url else None
        with progress:
            task = progress.add_task("bench", total=total)
            for target, model, spec in plan:
                progress.update(task, description=f"{target.name} · {model} · {spec.name}")
                async with http_client(target.base_url, target.api_key) as http:
                    ctx = BenchContext(config, target, model, http, lambda n: progress.advance(task, n))
                    outcome = await run_scenario(ctx, spec)
                run, scores = outcome_events(outcome, target=target.name, model=model,
                                             config={**config_snapshot, "target": target.name})
                if outcome.error:
                    failures += 1
                    console.print(f"[red]{target.name} · {model} · {spec.name} failed:[/] {outcome.error}")
                if publisher:
                    await publisher.publish([run, *scores])
                results.runs.append(run)
                results.scores.extend(scores)
                if out:
                    results.write(out)
    for run in results.runs:
        console.print(f"run {run.run_id}  {run.target} · {run.model} · {run.scenario}")
    return failures
