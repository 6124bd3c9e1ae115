"""Reply messages per token and the services' CPU per request, by frame window and stream count.

`helexa up` runs with a scripted worker (`HELEXA_WORKER_SCRIPT`: no model, the real tokenizer,
parsers and frames) that emits one token every `--token-delay-ms` per stream, a GPU-like rate, so
what is measured is the pipeline around an engine, not the engine. For each frame window
(`HELEXA_FRAME_WINDOW_MS`) one system is started; at each stream count S, S streams of
`--max-tokens` tokens run at once through the OpenAI SDK, `--runs` times. Each text chunk the client
gets is one `Delta` frame (the frame window's unit), so `frames_per_token` is text chunks / tokens.
Frames for one gateway share NATS messages (`apps.bus.bundles`): `messages_per_token` counts, with an
operator's subscription to the gateways' inboxes, every message on a reply subject or a bundle
subject (frames of every kind, alone or bundled), per generated token. CPU per request comes from
each process's threads (benchmarks.process_cpu) by role. A run whose streams did not all carry the
script's text is reported as failed, without figures.

    python -m benchmarks.frame_window --windows 0 10 20 --streams 1 16 64 \
        --out benchmarks/results/frame_window-<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from apps.bus import bundles, connection, roles, topology
from apps.embedded import stored_port
from apps.embedded.nats_server import NatsServer
from benchmarks.lib import emit, machine_info
from benchmarks.openai_load import OpenAILoad
from benchmarks.process_cpu import ProcessCPU
from benchmarks.servers import free_port, helexa_up

# Words the default model's tokenizer keeps as one token each, so the reply has as many tokens as words.
WORDS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen twenty").split()


def script(tokens: int, token_delay_s: float) -> dict:
    reply = " ".join(WORDS[i % len(WORDS)] for i in range(tokens + 8))
    return {"default": reply, "rules": [{"match": "", "reply": reply, "token_delay_s": token_delay_s}]}


class ReplyMessages:
    """Counts the reply messages (frames alone, and bundles) every gateway of a system receives,
    from an operator's connection on a loop of its own."""

    def __init__(self, nats_dir: Path) -> None:
        self._url = NatsServer(nats_dir, stored_port(nats_dir)).url_for(roles.OPERATOR)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.count = 0

    def __enter__(self) -> ReplyMessages:
        self._thread.start()
        self._nc = self._call(connection.connect(self._url, "bench-reply-messages", role=roles.OPERATOR))
        self._call(self._nc.subscribe(f"{topology.inbox_root(roles.GATEWAY)}.>", cb=self._on_message))
        self._call(self._nc.flush())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._nc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=30)

    async def _on_message(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        # `_INBOX.gateway.<user>.<home id>.r.<token or bundle>`; not alive probes, not other inbox traffic.
        if len(parts) == 6 and parts[4] == bundles.REPLY:
            self.count += 1

    def counted(self) -> int:
        """Messages so far; everything the server routed here before this call is counted."""
        self._call(self._nc.flush())
        return self.count


def measure(window_ms: float, streams: list[int], runs: int, max_tokens: int, token_delay_s: float,
            scratch: Path) -> dict:
    script_path = scratch / "script.json"
    expected = script(max_tokens, token_delay_s)
    script_path.write_text(json.dumps(expected))
    os.environ.update({"HELEXA_WORKER_SCRIPT": str(script_path), "HELEXA_FRAME_WINDOW_MS": str(window_ms),
                       "HELEXA_MAX_NUM_SEQS": str(max(streams)), "HELEXA_RATE_LIMIT_RPS": "0"})
    results: dict = {"window_ms": window_ms, "by_streams": {}}
    server = helexa_up(scratch / f"w{window_ms}", free_port(), "float32")
    with server, OpenAILoad(server.base_url, server.model) as load, \
            ReplyMessages(scratch / f"w{window_ms}" / "data" / "nats") as messages:
        load.run([[1, 2, 3]], max_tokens, concurrent=False)  # warm-up: connections, first templates
        for count in streams:
            per_run: list[dict[str, Any]] = []
            for _ in range(runs):
                cpu = ProcessCPU(server.pid, server.cpu_role)
                before = messages.counted()
                with cpu:
                    result = load.run([[1, 2, 3]] * count, max_tokens, concurrent=True)
                sent = messages.counted() - before
                texts_ok = all(s.text.strip() and expected["default"].startswith(s.text.strip())
                               and s.completion_tokens == max_tokens for s in result.streams)
                if not texts_ok:
                    per_run.append({"failed": "a stream's text or token count differs from the script"})
                    continue
                chunks = sum(len(s.gaps) + 1 for s in result.streams)
                tokens = sum(s.completion_tokens for s in result.streams)
                per_run.append({"frames_per_token": chunks / tokens, "messages_per_token": sent / tokens,
                                "tokens_per_s": tokens / result.wall_s,
                                "itl_ms_median": result.itl_ms_median, "cpu_ms_per_request": cpu.per_request(count)})
            good = [r for r in per_run if "failed" not in r]
            if len(good) < len(per_run):
                results["by_streams"][count] = {"failed": [r for r in per_run if "failed" in r]}
                continue
            results["by_streams"][count] = {
                "runs": len(good),
                "frames_per_token": round(statistics.median(r["frames_per_token"] for r in good), 3),
                "messages_per_token": round(statistics.median(r["messages_per_token"] for r in good), 3),
                "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in good), 1),
                "itl_ms_median": round(statistics.median(r["itl_ms_median"] for r in good), 2),
                "cpu_ms_per_request": {role: round(statistics.median(r["cpu_ms_per_request"].get(role, 0.0)
                                                                     for r in good), 3)
                                       for role in good[0]["cpu_ms_per_request"]},
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=float, nargs="+", default=[0.0, 10.0, 20.0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="per stream: 10 ms is 100 tokens/s")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="helexa-frames-") as scratch:
        by_window = [measure(w, args.streams, args.runs, args.max_tokens, args.token_delay_ms / 1000, Path(scratch))
                     for w in args.windows]
    report = {"benchmark": "frame_window", "machine": machine_info(),
              "inputs": {"windows_ms": args.windows, "streams": args.streams, "runs": args.runs,
                         "max_tokens": args.max_tokens, "token_delay_ms": args.token_delay_ms},
              "results": by_window}
    base = next((r for r in by_window if r["window_ms"] == 0), None)
    if base is not None:
        report["ratios_vs_no_window"] = {
            f"{r['window_ms']}ms": {
                str(s): {"frames_per_token": round(r["by_streams"][s]["frames_per_token"]
                                                   / base["by_streams"][s]["frames_per_token"], 3),
                         "messages_per_token": round(r["by_streams"][s]["messages_per_token"]
                                                     / base["by_streams"][s]["messages_per_token"], 3),
                         "server_cpu_per_request": round(r["by_streams"][s]["cpu_ms_per_request"]["server_total"]
                                                         / base["by_streams"][s]["cpu_ms_per_request"]["server_total"],
                                                         3)}
                for s in args.streams
                if "failed" not in r["by_streams"][s] and "failed" not in base["by_streams"][s]}
            for r in by_window if r["window_ms"] != 0}
    emit(report, args.out)


if __name__ == "__main__":
    main()
