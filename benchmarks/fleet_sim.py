"""A simulated fleet: what each token costs in NATS messages and CPU per process kind as gateways,
workers and streams grow.

One NATS server or a cluster (`--cluster 3`; monitoring on, for /varz message counts), PostgreSQL
and a recorder, G real gateway processes and W scripted workers (`helexa worker --script`: no model,
the real tokenizer, parsers, frames and bus; each worker serves a model name of its own,
`fleet-<i>`, so streams spread over workers by name). The fleet is started once at the largest G and
W of the sweep; a point (G, W, S) drives S concurrent streams through the first G gateways onto the
first W workers (stream i to gateway i mod G, model i mod W) with a light httpx client; the other
processes idle meanwhile and their idle cost is counted with the rest. The script emits one token
every 1/`--token-rate` s per stream after `--ttft-ms`, so TTFT and inter-token gaps are reported as
what the pipeline adds over the script. CPU comes from each process's threads
(benchmarks.process_cpu) by kind; a point is labelled host-bound when the fleet (client included) or
the whole host (others' work included) kept more than 90 % of the cores busy: its latencies then
measure the host, not the pipeline. A run whose streams did not all carry the script's text is
reported failed, without figures.

    python -m benchmarks.fleet_sim --out benchmarks/results/fleet_sim-<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from apps.bus import connection
from apps.bus.topology import BusLimits
from apps.embedded import free_port
from apps.embedded.nats_server import NatsCluster, NatsServer
from apps.embedded.postgres import APP_ROLES, PostgresServer
from apps.recorder.migrate import migrate
from benchmarks.lib import emit, machine_info
from benchmarks.process_cpu import CLIENT, ProcessCPU

ROOT = Path(__file__).resolve().parents[1]
HOST_BOUND_SHARE = 0.9
KINDS = ("gateway", "worker", "recorder", "nats", "postgres")
# Words SmolLM2's tokenizer keeps as one token each: a chunk's words are its tokens.
WORDS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen twenty").split()
DEFAULT_POINTS = ("1,1,8", "1,4,32", "2,4,64", "2,8,128", "4,16,256")


@dataclass(frozen=True, slots=True)
class Point:
    gateways: int
    workers: int
    streams: int

    @classmethod
    def parse(cls, text: str) -> Point:
        """`G,W,S`, each at least 1."""
        try:
            g, w, s = (int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a point is G,W,S (three integers), not {text!r}") from None
        if min(g, w, s) < 1:
            raise argparse.ArgumentTypeError(f"G, W and S must each be at least 1, not {text!r}")
        return cls(g, w, s)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--points", type=Point.parse, nargs="+", default=[Point.parse(p) for p in DEFAULT_POINTS],
                        metavar="G,W,S", help="gateways, workers, concurrent streams")
    parser.add_argument("--runs", type=int, default=3, help="runs per point; medians are reported")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--token-rate", type=float, default=50.0, help="tokens/s per stream in the script")
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="the script's time to first token")
    parser.add_argument("--cluster", type=int, default=1, help="NATS servers: 1, or a cluster (e.g. 3)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--chart", type=Path, help="an SVG of the results")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tokens < 1 or args.cluster < 1 or args.token_rate <= 0 or args.ttft_ms < 0:
        parser.error("--runs, --tokens and --cluster must be at least 1, --token-rate above 0, --ttft-ms at least 0")
    return args


def fleet_role(cmdline: list[str]) -> str:
    """The process kind of a fleet member, from its command line."""
    line = " ".join(cmdline)
    if "apps.cli" in line:
        return next((kind for kind in ("gateway", "worker", "recorder") if kind in cmdline), "other")
    if "nats-server" in line:
        return "nats"
    if "postgres" in line:
        return "postgres"
    return "other"


def host_bound(cpu_ms_total: float, wall_s: float, cpus: int, host_busy_share: float) -> bool:
    """Whether the cores were saturated over the run: the measured processes, or everything on the
    host (others' work included, /proc/stat), busy more than HOST_BOUND_SHARE of every core."""
    return cpu_ms_total > HOST_BOUND_SHARE * wall_s * 1000 * cpus or host_busy_share > HOST_BOUND_SHARE


def busy_share(before: Any, after: Any) -> float:
    """The share of all cores' time between two `psutil.cpu_times()` that was not idle."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    return 1 - idle / total if total > 0 else 0.0


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def run_figures(tokens: int, wall_s: float, cpu_ms: dict[str, float], messages: int, cpus: int,
                host_busy_share: float, ttfts_s: list[float], gaps_s: list[float], ttft_script_s: float,
                token_delay_s: float) -> dict:
    """One run's figures: throughput, messages, CPU per 1k tokens by kind, what the pipeline adds."""
    total = sum(cpu_ms.values())
    per_1k = {kind: round(cpu_ms.get(kind, 0.0) * 1000 / tokens, 3) for kind in (*KINDS, CLIENT)}
    return {
        "tokens_per_s": tokens / wall_s,
        "nats_messages_per_s": messages / wall_s,
        "nats_messages_per_token": messages / tokens,
        "cpu_ms_per_1k_tokens": per_1k,
        "fleet_cpu_share": total / (wall_s * 1000 * cpus),
        "host_busy_share": host_busy_share,
        "host_bound": host_bound(total, wall_s, cpus, host_busy_share),
        "ttft_added_ms_p50": (percentile(ttfts_s, 0.5) - ttft_script_s) * 1000,
        "ttft_added_ms_p99": (percentile(ttfts_s, 0.99) - ttft_script_s) * 1000,
        "itl_added_ms_p50": (percentile(gaps_s, 0.5) - token_delay_s) * 1000,
        "itl_added_ms_p99": (percentile(gaps_s, 0.99) - token_delay_s) * 1000,
    }


def ceilings(cpu_ms_per_1k: dict[str, float]) -> dict[str, float | None]:
    """Tokens/s one core of each kind carries at this cost (None where nothing was spent)."""
    return {kind: (round(1e6 / ms) if ms > 0 else None) for kind, ms in cpu_ms_per_1k.items()}


def medians(runs: list[dict]) -> dict:
    """The median of every figure over runs (per kind for CPU); host-bound if any run was."""
    out: dict[str, Any] = {"runs": len(runs)}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: round(statistics.median(r[key][k] for r in runs), 3) for k in value}
        elif isinstance(value, bool):
            out[key] = any(r[key] for r in runs)
        else:
            out[key] = round(statistics.median(r[key] for r in runs), 3)
    out["ceiling_tokens_per_s_per_core"] = ceilings(out["cpu_ms_per_1k_tokens"])
    return out


def script(tokens: int, ttft_s: float, token_delay_s: float) -> dict:
    reply = " ".join(WORDS[i % len(WORDS)] for i in range(tokens + 8))
    return {"default": reply, "rules": [{"match": "", "reply": reply, "first_token_delay_s": ttft_s,
                                         "token_delay_s": token_delay_s}]}


class MonitoredNats(NatsServer):
    """The embedded NATS server with its monitoring port on (for /varz), as a cluster's has."""

    def _config(self) -> str:
        text = super()._config()
        if self.http_port is None or "http:" not in text:
            self.http_port = self.http_port or free_port()
            text += f"http: \"127.0.0.1:{self.http_port}\"\n"
        return text


def bus(folder: Path, cluster: int) -> NatsServer | NatsCluster:
    """One monitored server, or a cluster of `cluster` servers (a cluster's servers monitor already)."""
    return NatsCluster(folder, size=cluster) if cluster > 1 else MonitoredNats(folder)


def servers_of(nats: NatsServer | NatsCluster) -> list[NatsServer]:
    return nats.servers if isinstance(nats, NatsCluster) else [nats]


def messages(nats: NatsServer | NatsCluster) -> int:
    """Messages in and out of every server so far (/varz): a message crossing a route counts on both."""
    total = 0
    for server in servers_of(nats):
        varz = httpx.get(f"http://127.0.0.1:{server.http_port}/varz", timeout=10).json()
        total += varz["in_msgs"] + varz["out_msgs"]
    return total


def rss_mib(nats: NatsServer | NatsCluster) -> float:
    return sum(psutil.Process(s.process.pid).memory_info().rss for s in servers_of(nats) if s.process) / 2**20


@contextmanager
def app(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """`helexa <args>` as a child in a process group of its own, stopped when the block ends."""
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "apps.cli", *args], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        try:
            yield process
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def wait_ready(ports: list[int], models: list[str], processes: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(ports)
    while pending:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a fleet process exited during start (logs in the scratch folder)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateways {pending} did not list all {len(models)} models in {timeout_s:.0f} s")
        port = pending[0]
        try:
            listed = {m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError):
            listed = set()
        if set(models) <= listed:
            pending.pop(0)
        else:
            time.sleep(0.5)  # a start takes seconds; polling faster only steals the cores it needs


async def one_stream(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[tuple[float, int]] = []
    text, usage = "", 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if delta:
                    times.append((time.perf_counter(), len(delta.split())))
                    text += delta
    gaps = [(t - prev) / n for (prev, _), (t, n) in zip(times, times[1:], strict=False) for _ in range(n)]
    return {"ttft_s": times[0][0] - start if times else float("nan"), "gaps_s": gaps, "text": text,
            "tokens": usage}


async def drive(point: Point, ports: list[int], tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=point.streams, max_keepalive_connections=point.streams)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(
            one_stream(client, f"http://127.0.0.1:{ports[i % point.gateways]}/v1/chat/completions",
                       f"fleet-{i % point.workers}", tokens) for i in range(point.streams)))
        return list(streams), time.perf_counter() - start


def measure(point: Point, args: argparse.Namespace, ports: list[int], nats: NatsServer | NatsCluster,
            expected: str) -> dict:
    cpus = os.cpu_count() or 1
    runs: list[dict] = []
    for _ in range(args.runs):
        cpu = ProcessCPU(os.getpid(), fleet_role)
        before, host_before = messages(nats), psutil.cpu_times()
        with cpu:
            streams, wall_s = asyncio.run(drive(point, ports, args.tokens))
        after, host_after = messages(nats), psutil.cpu_times()
        if not all(s["tokens"] == args.tokens and expected.startswith(s["text"].strip()) and s["text"].strip()
                   for s in streams):
            return {"failed": "a stream's text or token count differs from the script"}
        figures = run_figures(sum(s["tokens"] for s in streams), wall_s, dict(cpu.ms), after - before, cpus,
                              busy_share(host_before, host_after),
                              [s["ttft_s"] for s in streams], [g for s in streams for g in s["gaps_s"]],
                              args.ttft_ms / 1000, 1 / args.token_rate)
        figures["nats_rss_mib"] = rss_mib(nats)
        runs.append(figures)
    return medians(runs)


def run_sweep(args: argparse.Namespace, scratch: Path) -> list[dict]:
    g_max = max(p.gateways for p in args.points)
    w_max = max(p.workers for p in args.points)
    s_max = max(p.streams for p in args.points)
    expected = script(args.tokens, args.ttft_ms / 1000, 1 / args.token_rate)
    script_path = scratch / "script.json"
    script_path.write_text(json.dumps(expected))
    with ExitStack() as stack:
        nats = bus(scratch / "nats", args.cluster)
        stack.enter_context(nats)
        asyncio.run(connection.setup(nats.url, BusLimits()))
        postgres = stack.enter_context(PostgresServer(scratch / "pg"))
        asyncio.run(migrate(postgres.url))
        asyncio.run(postgres.open_app_roles())

        def env(kind: str) -> dict[str, str]:
            found = {"NATS_URL": nats.url_for(kind)}
            if kind in APP_ROLES:
                found["DATABASE_URL"] = postgres.role_url(kind)
            return found

        processes = [stack.enter_context(app(["recorder"], env("recorder"), scratch / "recorder.log"))]
        models = [f"fleet-{i}" for i in range(w_max)]
        for i, model in enumerate(models):
            processes.append(stack.enter_context(app(
                ["worker", "--script", str(script_path), "--served-model-name", model],
                {**env("worker"), "HELEXA_NODE_ID": f"fleet-{i}", "HELEXA_MAX_NUM_SEQS": str(s_max)},
                scratch / f"worker-{i}.log")))
        ports = [free_port() for _ in range(g_max)]
        for i, port in enumerate(ports):
            processes.append(stack.enter_context(app(
                ["gateway"], {**env("gateway"), "HELEXA_PORT": str(port), "HELEXA_RATE_LIMIT_RPS": "0",
                              "HELEXA_BATCH_CONCURRENCY": "0"}, scratch / f"gateway-{i}.log")))
        wait_ready(ports, models, processes, timeout_s=300)
        asyncio.run(drive(Point(g_max, w_max, w_max), ports, 4))  # warm-up: connections, templates
        results = []
        for point in args.points:
            print(f"[fleet_sim] G={point.gateways} W={point.workers} S={point.streams}", file=sys.stderr, flush=True)
            results.append({"gateways": point.gateways, "workers": point.workers, "streams": point.streams,
                            **measure(point, args, ports, nats, expected["default"])})
        return results


def chart(results: list[dict], path: Path) -> None:
    """Delivered tokens/s by point, and CPU ms per 1k tokens by process kind, as one SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if "failed" not in r]
    labels = [f"G{r['gateways']} W{r['workers']} S{r['streams']}" + (" *" if r["host_bound"] else "") for r in good]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(labels, [r["tokens_per_s"] for r in good], color="#4472c4")
    left.set_ylabel("delivered tokens/s")
    left.set_title("throughput (* host-bound)")
    bottom = [0.0] * len(good)
    for kind in KINDS:
        values = [r["cpu_ms_per_1k_tokens"][kind] for r in good]
        right.bar(labels, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("CPU ms per 1k tokens")
    right.set_title("services' CPU per 1k tokens by kind")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, format="svg")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="helexa-fleet-") as scratch:
        results = run_sweep(args, Path(scratch))
    report = {"benchmark": "fleet_sim", "machine": machine_info(), "load_average_1m_before": round(load_before, 2),
              "inputs": {"points": [f"{p.gateways},{p.workers},{p.streams}" for p in args.points], "runs": args.runs,
                         "tokens": args.tokens, "token_rate": args.token_rate, "ttft_ms": args.ttft_ms,
                         "recorder_and_postgres": True,
                         "nats": f"a cluster of {args.cluster}" if args.cluster > 1 else "one server"},
              "results": results}
    emit(report, args.out)
    if args.chart:
        chart(results, args.chart)


if __name__ == "__main__":
    main()
