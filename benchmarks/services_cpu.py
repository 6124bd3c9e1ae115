"""The services' CPU per request of this tree against another commit's, in one run on one machine.

Issue 38's figure: gateway + worker + NATS + recorder + PostgreSQL CPU milliseconds per request (the
engine process's own beside it, not in the total) at 16 concurrent streams of 64-token requests.
Each tree (this checkout, and `--base`, a `git worktree add <dir> <commit>` checkout) runs its own
`helexa up` (the tree's code first on sys.path, the same Python environment), on the real default
model: the scripted worker is newer than the issue's start, so both sides run the same engine.
Systems alternate A, B, A, B... (`--rounds`), each round starting a fresh system, warming it up and
measuring `--runs` loads; every figure is a median over the loads of a side. CPU comes from each
thread's schedstat by role (benchmarks.process_cpu).

Two figures per role: the raw CPU of the load, and the marginal CPU: the raw less what the role
spends idle (measured over `--idle-s` just before each load) over the load's wall time. Timers,
heartbeats and waiting pulls cost CPU per second, not per request, so on a slow or contended engine
they inflate the raw figure with the load's wall time; the marginal figure is what the requests
themselves cost, and the ratio of the two trees is printed for both.

Correctness gate: greedy with ignore_eos, so every stream of a prompt must carry the same text, in
every load of both trees, and exactly `--max-tokens` tokens; otherwise no figure is printed.

    git worktree add /tmp/h25-base 746cce1
    python -m benchmarks.services_cpu --base /tmp/h25-base --out benchmarks/results/services_cpu-<machine>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from benchmarks.lib import commit_of, emit, machine_info
from benchmarks.openai_load import LoadResult, OpenAILoad
from benchmarks.process_cpu import CLIENT, ProcessCPU
from benchmarks.servers import ROOT, free_port, helexa_up

# The services the issue counts; the engine process and the benchmark's client are printed apart.
SERVICES = ("gateway", "worker", "nats", "recorder", "postgres", "supervisor")


def prompts(count: int, length: int) -> list[list[int]]:
    """Distinct token-id prompts (ordinary vocabulary ids), so no tokenizer is loaded here."""
    return [[1000 + 37 * i + 5 * j for j in range(length)] for i in range(count)]


def one_round(tree: Path, work: list[list[int]], runs: int, max_tokens: int, scratch: Path,
              idle_s: float) -> list[dict]:
    server = helexa_up(scratch, free_port(), "float32", tree=tree)
    loads: list[dict] = []
    with server, OpenAILoad(server.base_url, server.model) as load:
        load.run(work, 8, concurrent=True)  # warm-up: connections, first batches
        for _ in range(runs):
            idle = ProcessCPU(server.pid, server.cpu_role)
            started = time.monotonic()
            with idle:
                time.sleep(idle_s)  # nothing to wait for: the window is the measurement
            idle_wall_s = time.monotonic() - started
            cpu = ProcessCPU(server.pid, server.cpu_role)
            started = time.monotonic()
            with cpu:
                result: LoadResult = load.run(work, max_tokens, concurrent=True)
            wall_s = time.monotonic() - started
            loads.append({"texts": [s.text for s in sorted(result.streams, key=lambda s: s.prompt_index)],
                          "tokens": [s.completion_tokens for s in result.streams],
                          "cpu_ms_per_request": cpu.per_request(len(work)),
                          "idle_cpu_ms_per_s": {role: round(ms / idle_wall_s, 3) for role, ms in idle.ms.items()},
                          "marginal_cpu_ms_per_request": marginal(cpu.ms, idle.ms, idle_wall_s, wall_s, len(work)),
                          "wall_s": round(wall_s, 3), "tok_per_s": result.tok_per_s})
    return loads


def marginal(load_ms: Mapping[str, float], idle_ms: Mapping[str, float], idle_wall_s: float, wall_s: float,
             requests: int) -> dict[str, float]:
    """CPU milliseconds per request by role beyond what the role spends idle over the load's wall
    time (timers, heartbeats, pulls waiting): the cost of the requests themselves, which a slow or
    contended engine does not inflate the way it inflates the raw figure."""
    return {role: round((ms - idle_ms.get(role, 0.0) / idle_wall_s * wall_s) / requests, 3)
            for role, ms in sorted(load_ms.items())}


def summary(loads: list[dict]) -> dict:
    def med(key: str, role: str) -> float:
        return round(statistics.median(load[key].get(role, 0.0) for load in loads), 3)

    def services(key: str) -> list[float]:
        return [round(sum(load[key].get(role, 0.0) for role in SERVICES), 3) for load in loads]

    roles = (*SERVICES, "engine", CLIENT, "other")
    return {"loads": len(loads),
            "services_ms_per_request": round(statistics.median(services("cpu_ms_per_request")), 3),
            "services_ms_per_request_each_load": services("cpu_ms_per_request"),
            "marginal_services_ms_per_request": round(statistics.median(services("marginal_cpu_ms_per_request")), 3),
            "marginal_services_ms_per_request_each_load": services("marginal_cpu_ms_per_request"),
            "by_role_ms_per_request": {role: med("cpu_ms_per_request", role) for role in roles},
            "marginal_by_role_ms_per_request": {role: med("marginal_cpu_ms_per_request", role) for role in roles},
            "idle_by_role_ms_per_s": {role: med("idle_cpu_ms_per_s", role) for role in roles},
            "wall_s": round(statistics.median(load["wall_s"] for load in loads), 3),
            "tok_per_s": round(statistics.median(load["tok_per_s"] for load in loads), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2, help="fresh systems per tree, alternating")
    parser.add_argument("--runs", type=int, default=3, help="measured loads per round")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=5.0,
                        help="idle window before each load, for each role's idle CPU per second")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this": ROOT, "base": args.base.resolve()}
    work = prompts(args.streams, args.prompt_tokens)
    loads: dict[str, list[dict]] = {name: [] for name in trees}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="helexa-services-cpu-") as scratch:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                loads[name] += one_round(tree, work, args.runs, args.max_tokens, Path(scratch) / f"{name}{round_}",
                                         args.idle_s)
    reference = loads["base"][0]["texts"]
    wrong = [f"{name} load {i}" for name, runs in loads.items() for i, load in enumerate(runs)
             if load["texts"] != reference or any(t != args.max_tokens for t in load["tokens"])
             or not all(text.strip() for text in load["texts"])]
    report: dict = {"benchmark": "services_cpu", "machine": machine_info(),
                    "load_average_1m_before": round(load_before, 2),
                    "inputs": {"streams": args.streams, "max_tokens": args.max_tokens,
                               "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "runs": args.runs,
                               "order": "this, base alternating; a fresh system each round",
                               "services": list(SERVICES)},
                    "commits": {name: commit_of(tree) for name, tree in trees.items()}}
    if wrong:
        report["failed"] = f"streams differ from the base's first load or miss tokens: {wrong}"
    else:
        report["results"] = {name: summary(runs) for name, runs in loads.items()}
        this, base = report["results"]["this"], report["results"]["base"]
        report["ratio_services_this_over_base"] = round(this["services_ms_per_request"]
                                                        / base["services_ms_per_request"], 3)
        report["ratio_marginal_services_this_over_base"] = round(this["marginal_services_ms_per_request"]
                                                                 / base["marginal_services_ms_per_request"], 3)
    emit(report, args.out)


if __name__ == "__main__":
    main()
