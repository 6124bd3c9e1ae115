"""Reports from a results file: the latest run per target × model × scenario, tables and PNG plots."""

from __future__ import annotations

from pathlib import Path

from apps.bench.publish import ResultsFile, outcome_events
from apps.bench.report import render_json, render_markdown, runs_from_file, write_plots
from apps.bench.scenarios import Outcome, Score


def events(scenario: str, results: dict, finished_at: float, scores: list[Score] | None = None,
           error: str | None = None):  # type: ignore[no-untyped-def]
    outcome = Outcome(scenario=scenario, started_at=finished_at - 1, finished_at=finished_at, results=results,
                      scores=scores or [], error=error)
    return outcome_events(outcome, target="peer", model="m", config={"samples": 1})


def test_report_takes_the_latest_run_and_renders_tables_and_plots(tmp_path: Path) -> None:
    old_burst, _ = events("concurrency:4", {"concurrency": 4, "ttft_median_ms": 999.0}, 100.0)
    burst, burst_scores = events("concurrency:4", {"concurrency": 4, "ttft_median_ms": 120.0, "ttft_p95_ms": 300.0,
                                                   "throughput_tok_s": 88.0, "shed": 1, "failed": 0}, 200.0,
                                 [Score("throughput_tok_s", 88.0, "tok/s")])
    ladder, _ = events("context:128,4096", {
        "points": [{"context": 128, "prompt_tokens": 150, "prefill_tok_s": 900.0, "decode_tok_s": 50.0, "samples": 2},
                   {"context": 4096, "prompt_tokens": 4120, "prefill_tok_s": 800.0, "decode_tok_s": 30.0,
                    "samples": 2}],
        "decode_flatness": 0.6, "verdict": "drops"}, 150.0)
    broken, _ = events("chat:64", {}, 160.0, error="HTTP 500: boom")
    path = tmp_path / "results.json"
    ResultsFile(runs=[burst, old_burst, ladder, broken], scores=burst_scores).write(path)

    runs = runs_from_file(path)
    assert [(r.scenario, r.run_id) for r in runs] == [
        ("chat:64", broken.run_id), ("concurrency:4", burst.run_id), ("context:128,4096", ladder.run_id)]
    markdown = render_markdown(runs)
    assert "| peer | m | 4 | 120.0 | 300.0 | 88.0 | — | 1 | 0 |" in markdown
    assert "decode flatness: 0.60 — decode drops" in markdown
    assert "| peer | m | chat:64 | HTTP 500: boom |" in markdown
    assert '"throughput_tok_s"' in render_json(runs)

    written = write_plots(runs, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["concurrency.png", "context.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
