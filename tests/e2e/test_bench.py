"""`helexa bench` against the running system: a small config end to end, its numbers landing in
`scores` through EVENTS and the recorder, a quality score given afterwards, and the report with plots."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from apps.bench.client import StreamResult, chat_body, http_client, stream_chat
from apps.bench.publish import MEASURED_BY, ResultsFile
from tests.e2e.conftest import System, scripted_worker
from tests.support import REPO, eventually_async

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def helexa(system: System, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    # As the bench runs: its own NATS user, and the read-only ledger role for reports.
    env = {**os.environ, "NATS_URL": system.nats_server.url_for("bench"),
           "DATABASE_URL": system.postgres.role_url("reader")}
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def write_config(path: Path, system: System, model: str, scenarios: list[str]) -> Path:
    path.write_text(f"""
models = ["{model}"]
scenarios = {scenarios!r}
samples = 2
max_tokens = 8
timeout_s = 120

[[targets]]
name = "local"
base_url = "{system.base_url}/v1"

[[capabilities]]
name = "greet"
prompt = "Say hello to the reader."
max_tokens = 8
""".replace("'", '"'), encoding="utf-8")
    return path


async def recorded_scores(system: System, run_ids: list[str], count: int,
                          timeout_s: float = 30.0) -> list[asyncpg.Record]:
    """The `scores` rows of these runs once the recorder has projected `count` of them."""
    conn = await asyncpg.connect(system.database_url)

    async def enough() -> list[asyncpg.Record] | None:
        rows = await conn.fetch("SELECT * FROM scores WHERE run_id = ANY($1::text[])", run_ids)
        return rows if len(rows) >= count else None

    try:
        return await eventually_async(
            enough, timeout_s, message=lambda: f"fewer than {count} scores recorded; recorder said:\n"
                                               f"{system.recorder.output()}")
    finally:
        await conn.close()


def test_bench_records_scores_takes_a_quality_score_and_reports_with_plots(system: System, tmp_path: Path) -> None:
    config = write_config(tmp_path / "bench.toml", system, system.model,
                          ["chat:32", "concurrency:2", "context:16,64", "capability:greet"])
    out = tmp_path / "results.json"
    ran = helexa(system, "bench", "run", str(config), "--out", str(out))
    assert ran.returncode == 0, ran.stderr

    results = ResultsFile.read(out)
    runs = {r.scenario: r for r in results.runs}
    assert set(runs) == {"chat:32", "concurrency:2", "context:16,64", "capability:greet"}
    assert all("error" not in r.results for r in runs.values()), [r.results.get("error") for r in runs.values()]
    assert len(runs["chat:32"].results["samples"]) == 2
    assert runs["concurrency:2"].results["shed"] == 0
    assert len(runs["context:16,64"].results["points"]) == 2
    assert runs["capability:greet"].results["text"]

    rows = asyncio.run(recorded_scores(system, [r.run_id for r in results.runs], len(results.scores)))
    by_run = {(row["scenario"], row["metric"]): row for row in rows}
    assert len(rows) == len(results.scores)
    assert {row["scorer"] for row in rows} == {MEASURED_BY}
    assert {row["model"] for row in rows} == {system.model}
    assert by_run[("chat:32", "ttft_p50_ms")]["value"] > 0
    assert by_run[("chat:32", "decode_tok_s")]["unit"] == "tok/s"
    assert by_run[("concurrency:2", "throughput_tok_s")]["value"] > 0
    assert by_run[("context:16,64", "decode_flatness")]["value"] > 0
    assert ("context:16,64", "prefill_tok_s@64") in by_run

    probe = runs["capability:greet"].run_id
    scored = helexa(system, "bench", "score", "--run", probe, "--score", "4", "--scorer", "reviewer")
    assert scored.returncode == 0, scored.stderr
    quality = asyncio.run(recorded_scores(system, [probe], 3))  # ttft_ms, completion_tokens, quality
    assert [(q["metric"], q["value"], q["scorer"]) for q in quality if q["scorer"] == "reviewer"] == [
        ("quality", 4.0, "reviewer")]

    plots = tmp_path / "plots"
    report = helexa(system, "bench", "report", "--plots", str(plots), "--output", str(tmp_path / "report.md"))
    assert report.returncode == 0, report.stderr
    for name in ("concurrency.png", "context.png"):
        assert (plots / name).read_bytes()[:8] == PNG_SIGNATURE
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "decode flatness:" in markdown
    assert f"| local | {system.model} | capability:greet | {probe} |" in markdown
    assert "quality=4 (reviewer)" in markdown


def test_a_thinking_only_stream_counts_as_output(system: System, tmp_path: Path) -> None:
    """A model that spends its whole budget in reasoning streams no `content` at all; the bench still
    times its first token and counts its chunks instead of calling the stream dead."""
    script = {"rules": [], "default": "<think>" + "let me consider this carefully " * 20 + "</think>Done."}
    with scripted_worker(system, tmp_path, "thinker", script):
        async def one_stream() -> StreamResult:
            async with http_client(f"{system.base_url}/v1", None) as http:
                return await stream_chat(http, chat_body("thinker", "Think.", 8), timeout_s=60)

        direct = asyncio.run(one_stream())
        config = write_config(tmp_path / "bench.toml", system, "thinker", ["chat:16"])
        ran = helexa(system, "bench", "run", str(config), "--out", str(tmp_path / "r.json"), "--no-publish")
    assert (direct.text, direct.generated_chunks > 0) == ("", True)
    assert direct.reasoning.startswith("let me consider")
    assert ran.returncode == 0, ran.stderr
    (run,) = ResultsFile.read(tmp_path / "r.json").runs
    samples = run.results["samples"]
    assert len(samples) == 2
    assert all(s["generated_chunks"] > 0 and s["ttft_ms"] > 0 for s in samples)
    assert all(s["completion_tokens"] == 8 and s["finish_reason"] == "length" for s in samples)


def test_a_bad_config_fails_before_any_request(system: System, tmp_path: Path) -> None:
    config = write_config(tmp_path / "bench.toml", system, system.model, ["chat:32", "latency"])
    ran = helexa(system, "bench", "run", str(config))
    assert ran.returncode != 0
    assert "unknown scenario 'latency'" in ran.stderr


def test_scoring_an_unknown_run_is_refused(system: System) -> None:
    scored = helexa(system, "bench", "score", "--run", "no-such-run", "--score", "1", "--scorer", "x")
    assert scored.returncode != 0
    assert "no bench run 'no-such-run'" in scored.stderr
