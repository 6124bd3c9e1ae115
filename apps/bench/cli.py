"""`helexa bench run | report | score`: arguments, and each command handed to the module that does it.
Heavy imports wait until a bench command runs, so other `helexa` commands do not pay for them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from apps.bus.events import ScoreRecorded

if TYPE_CHECKING:
    from apps.settings import BenchSettings


def add_commands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", required=True)

    run = sub.add_parser("run", help="run the scenarios of a TOML config against its targets")
    run.add_argument("config", help="the bench TOML file")
    run.add_argument("--out", default=None, help="also write the published events to this JSON file")
    run.add_argument("--no-publish", action="store_true", help="do not publish onto EVENTS (needs --out)")
    run.add_argument("--nats-url", default=None, help="where to publish (NATS_URL)")
    run.set_defaults(func=cmd_run)

    report = sub.add_parser("report", help="the latest run per target, model and scenario")
    report.add_argument("--results", default=None, help="read a `bench run --out` file instead of PostgreSQL")
    report.add_argument("--database-url", default=None, help="PostgreSQL to read (DATABASE_URL)")
    report.add_argument("--format", choices=("md", "json"), default="md")
    report.add_argument("--output", default=None, help="write the table here instead of stdout")
    report.add_argument("--plots", default=None, help="write PNG plots into this folder")
    report.set_defaults(func=cmd_report)

    score = sub.add_parser("score", help="record a quality score for a bench run (e.g. a capability probe)")
    score.add_argument("--run", required=True, help="the run id (see `bench report`)")
    score.add_argument("--score", required=True, type=float)
    score.add_argument("--scorer", required=True, help="who or what gave the score")
    score.add_argument("--metric", default="quality")
    score.add_argument("--unit", default=None)
    score.add_argument("--database-url", default=None, help="PostgreSQL where the run is recorded (DATABASE_URL)")
    score.add_argument("--nats-url", default=None, help="where to publish (NATS_URL)")
    score.set_defaults(func=cmd_score)


def _settings(args: argparse.Namespace) -> BenchSettings:
    from apps.settings import BenchSettings

    settings = BenchSettings()
    settings.nats_url = getattr(args, "nats_url", None) or settings.nats_url
    settings.database_url = getattr(args, "database_url", None) or settings.database_url
    return settings


def cmd_run(args: argparse.Namespace) -> None:
    import nats.errors
    from rich.console import Console

    from apps.bench.config import ConfigError, load_config
    from apps.bench.runner import run_bench
    from apps.fleet.operator import without_password

    console = Console(stderr=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the progress bar
    try:
        config, specs = load_config(args.config)
    except ConfigError as exc:
        sys.exit(f"helexa bench: {exc}")
    if args.no_publish and not args.out:
        sys.exit("helexa bench: --no-publish needs --out, or the results go nowhere")
    nats_url = None if args.no_publish else _settings(args).nats_url
    try:
        failures = asyncio.run(run_bench(config, specs, nats_url, args.out, console))
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        sys.exit(f"helexa bench: cannot publish to NATS at {without_password(nats_url or '')} ({exc!r}; NATS_URL or "
                 "--nats-url); --no-publish --out FILE runs without it")
    sys.exit(1 if failures else 0)


def cmd_report(args: argparse.Namespace) -> None:
    import asyncpg

    from apps.bench import report
    from apps.fleet.operator import without_password

    try:
        if args.results:
            runs = report.runs_from_file(args.results)
        else:
            database_url = _settings(args).database_url
            runs = asyncio.run(report.runs_from_database(database_url))
    except (OSError, ValueError, asyncpg.PostgresError) as exc:
        where = "" if args.results else \
            f" from PostgreSQL at {without_password(database_url)} (DATABASE_URL or --database-url)"
        sys.exit(f"helexa bench: cannot read bench runs{where}: {exc}")
    text = report.render_markdown(runs) if args.format == "md" else report.render_json(runs)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    if args.plots:
        for path in report.write_plots(runs, args.plots):
            print(f"wrote {path}", file=sys.stderr)


async def _find_run(database_url: str, run_id: str) -> tuple[str, str] | None:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT model, scenario FROM bench_runs WHERE run_id = $1", run_id)
    finally:
        await conn.close()
    return (row["model"], row["scenario"]) if row else None


def cmd_score(args: argparse.Namespace) -> None:
    from apps.bench.publish import EventPublisher, bench_node
    from apps.fleet.operator import without_password
    from apps.settings import bus_limits

    settings = _settings(args)
    try:
        found = asyncio.run(_find_run(settings.database_url, args.run))
    except OSError as exc:
        sys.exit(f"helexa bench: cannot reach PostgreSQL at {without_password(settings.database_url)} "
                 f"(DATABASE_URL or --database-url): {exc}")
    if found is None:
        sys.exit(f"helexa bench: no bench run {args.run!r} in bench_runs")
    model, scenario = found
    event = ScoreRecorded(model=model, node=bench_node(), run_id=args.run, scenario=scenario,
                               metric=args.metric, value=args.score, unit=args.unit, scorer=args.scorer)

    async def publish() -> None:
        async with EventPublisher(settings.nats_url, bus_limits()) as publisher:
            await publisher.publish([event])

    asyncio.run(publish())
    print(f"scored run {args.run}: {args.metric}={args.score:g} by {args.scorer}")
