"""`helexa bench report`: the latest run per target × model × scenario, from PostgreSQL or a results
file, as markdown or JSON tables and PNG plots (TTFT and throughput vs concurrency, prefill and decode
tok/s vs context)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from apps.bench.publish import MEASURED_BY, ResultsFile

_LATEST_RUNS = """
SELECT DISTINCT ON (target, model, scenario)
       run_id, target, model, scenario, extract(epoch FROM finished_at) AS finished_at, results
FROM bench_runs
ORDER BY target, model, scenario, finished_at DESC, run_id DESC
"""
_LATEST_SCORES = """
SELECT DISTINCT ON (run_id, metric, scorer) run_id, metric, value, unit, scorer
FROM scores WHERE run_id = ANY($1::text[])
ORDER BY run_id, metric, scorer, ts DESC, event_id DESC
"""


@dataclass(slots=True)
class ReportRun:
    target: str
    model: str
    scenario: str
    run_id: str
    finished_at: float
    results: dict[str, Any]
    scores: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.scenario.partition(":")[0]

    def quality(self) -> str:
        """Scores given after the run (by anyone but the bench itself), as `metric=value (scorer)`."""
        given = [s for s in self.scores if s["scorer"] != MEASURED_BY]
        return ", ".join(f"{s['metric']}={s['value']:g} ({s['scorer']})" for s in given) or "unscored"


def _latest(runs: list[ReportRun]) -> list[ReportRun]:
    latest: dict[tuple[str, str, str], ReportRun] = {}
    for run in runs:
        key = (run.target, run.model, run.scenario)
        if key not in latest or (run.finished_at, run.run_id) > (latest[key].finished_at, latest[key].run_id):
            latest[key] = run
    return sorted(latest.values(), key=lambda r: (r.target, r.model, r.scenario))


def runs_from_file(path: str | Path) -> list[ReportRun]:
    data = ResultsFile.read(path)
    runs = [ReportRun(r.target, r.model, r.scenario, r.run_id, r.finished_at, r.results) for r in data.runs]
    by_id = {r.run_id: r for r in runs}
    for s in data.scores:
        if s.run_id in by_id:
            by_id[s.run_id].scores.append({"metric": s.metric, "value": s.value, "unit": s.unit, "scorer": s.scorer})
    return _latest(runs)


async def runs_from_database(database_url: str) -> list[ReportRun]:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(_LATEST_RUNS)
        runs = [ReportRun(r["target"], r["model"], r["scenario"], r["run_id"], float(r["finished_at"]),
                          json.loads(r["results"])) for r in rows]
        by_id = {r.run_id: r for r in runs}
        for s in await conn.fetch(_LATEST_SCORES, list(by_id)):
            by_id[s["run_id"]].scores.append(
                {"metric": s["metric"], "value": s["value"], "unit": s["unit"], "scorer": s["scorer"]})
    finally:
        await conn.close()
    return runs


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(runs: list[ReportRun]) -> str:
    out: list[str] = ["# helexa bench", ""]
    by_kind: dict[str, list[ReportRun]] = {}
    for run in runs:
        by_kind.setdefault(run.kind, []).append(run)
    if chat := by_kind.get("chat"):
        out += ["## Chat latency (one stream at a time)", ""]
        out += _table(
            ["target", "model", "scenario", "prompt tok", "TTFT p50 ms", "TTFT p95 ms", "e2e p50 ms",
             "prefill tok/s", "decode tok/s", "samples"],
            [[r.target, r.model, r.scenario, r.results.get("prompt_tokens"), r.results.get("ttft_p50_ms"),
              r.results.get("ttft_p95_ms"), r.results.get("e2e_p50_ms"), r.results.get("prefill_tok_s"),
              r.results.get("decode_tok_s"), len(r.results.get("samples", []))] for r in chat])
    if burst := by_kind.get("concurrency"):
        out += ["## Concurrency", ""]
        out += _table(
            ["target", "model", "streams", "TTFT median ms", "TTFT p95 ms", "throughput tok/s",
             "queue wait median ms", "shed", "failed"],
            [[r.target, r.model, r.results.get("concurrency"), r.results.get("ttft_median_ms"),
              r.results.get("ttft_p95_ms"), r.results.get("throughput_tok_s"),
              r.results.get("queue_wait_median_ms"), r.results.get("shed"), r.results.get("failed")]
             for r in sorted(burst, key=lambda r: (r.target, r.model, r.results.get("concurrency") or 0))])
    for r in by_kind.get("context", []):
        out += [f"## Context scaling: {r.target} · {r.model}", ""]
        out += _table(["context tok", "prompt tok", "prefill tok/s", "decode tok/s", "samples"],
                      [[p["context"], p.get("prompt_tokens"), p.get("prefill_tok_s"), p.get("decode_tok_s"),
                        p.get("samples")] for p in r.results.get("points", [])])
        ratio = r.results.get("decode_flatness")
        verdict = r.results.get("verdict")
        out += [f"decode flatness: {_fmt(ratio, 2)}" + (f" — decode {verdict}" if verdict else ""), ""]
    if probes := by_kind.get("capability"):
        out += ["## Capability", ""]
        out += _table(["target", "model", "scenario", "run id", "completion tok", "quality"],
                      [[r.target, r.model, r.scenario, r.run_id, r.results.get("completion_tokens"), r.quality()]
                       for r in probes])
    if swaps := by_kind.get("swap"):
        out += ["## Model swap", ""]
        out += _table(["target", "model", "unload ms", "load ms", "cold TTFT ms", "cold e2e ms"],
                      [[r.target, r.model, r.results.get("unload_ms"), r.results.get("load_ms"),
                        (r.results.get("cold") or {}).get("ttft_ms"), (r.results.get("cold") or {}).get("e2e_ms")]
                       for r in swaps])
    failed = [r for r in runs if r.results.get("error")]
    if failed:
        out += ["## Failed runs", ""]
        out += _table(["target", "model", "scenario", "error"],
                      [[r.target, r.model, r.scenario, r.results["error"]] for r in failed])
    return "\n".join(out)


def render_json(runs: list[ReportRun]) -> str:
    return json.dumps([asdict(r) for r in runs], indent=2)


def _series(runs: list[ReportRun], kind: str) -> dict[str, list[ReportRun]]:
    series: dict[str, list[ReportRun]] = {}
    for run in runs:
        if run.kind == kind and not run.results.get("error"):
            series.setdefault(f"{run.target} · {run.model}", []).append(run)
    return series


def write_plots(runs: list[ReportRun], folder: str | Path) -> list[Path]:
    """PNG plots of whatever the runs cover; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if bursts := _series(runs, "concurrency"):
        fig, (ttft_ax, tput_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for label, series in bursts.items():
            series.sort(key=lambda r: r.results["concurrency"])
            n = [r.results["concurrency"] for r in series]
            ttft_ax.plot(n, [r.results.get("ttft_median_ms") for r in series], marker="o", label=f"{label} median")
            ttft_ax.plot(n, [r.results.get("ttft_p95_ms") for r in series], marker="x", linestyle="--",
                         label=f"{label} p95")
            tput_ax.plot(n, [r.results.get("throughput_tok_s") for r in series], marker="o", label=label)
        ttft_ax.set(title="TTFT vs concurrency", xlabel="concurrent streams", ylabel="ms")
        tput_ax.set(title="Throughput vs concurrency", xlabel="concurrent streams", ylabel="output tok/s")
        for ax in (ttft_ax, tput_ax):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize="small")
        written.append(_save(fig, folder / "concurrency.png"))
    if ladders := _series(runs, "context"):
        fig, (prefill_ax, decode_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for label, series in ladders.items():
            points = series[0].results["points"]
            # The prompt tokens the server counted (template included) where it said, else the rung asked for.
            ctx = [p.get("prompt_tokens") or p["context"] for p in points]
            prefill_ax.plot(ctx, [p.get("prefill_tok_s") for p in points], marker="o", label=label)
            decode_ax.plot(ctx, [p.get("decode_tok_s") for p in points], marker="o",
                           label=f"{label} (flatness {_fmt(series[0].results.get('decode_flatness'), 2)})")
        for ax, what in ((prefill_ax, "Prefill"), (decode_ax, "Decode")):
            ax.set(title=f"{what} tok/s vs context", xlabel="prompt tokens", ylabel="tok/s")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_ylim(bottom=0)
            ax.legend(fontsize="small")
        written.append(_save(fig, folder / "context.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
