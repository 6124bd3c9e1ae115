"""A tensor-parallel group: model-runner ranks as processes over `torch.distributed`.

Layout. Rank 0 lives in the engine core process, beside the scheduler, KV block tables and prefix
cache, which stay one; ranks 1..N-1 are processes it starts (`start_followers`). Rank 0 in the
core is the simplest layout to keep robust: the sampled tokens are already where the scheduler
is, the sampler, grammar masks and logprobs run unchanged on rank 0's gathered logits, and there
is one fewer process to watch. Followers run `python -m engine.runner.tensor_parallel` with one
end of a pipe passed down (the core is a daemonic multiprocessing child, which `multiprocessing`
forbids to have children of its own). Each step rank 0 sends the step's chunks (token ids,
positions, block tables: a few KB) down every follower's pipe, then all ranks run the same
forward, whose only communication is the collectives of `engine.models.parallel_layers` (gloo on
CPU, nccl on CUDA with a GPU a rank, gloo over CUDA tensors where ranks share one; the same code).
Steps go down pipes rather than a broadcast so an idle follower waits on a pipe with no timeout,
and a collective's timeout (`COLLECTIVE_TIMEOUT_S`) bounds only the wait inside a step, where
every rank is doing the same work.

Death. A follower arms the parent-death signal (`engine.frontend.parent_death`), so it dies with
the core. The core watches the followers' pipes from a thread (`RankWatch`; after its ready report a
follower writes only its step timings, so a pipe that ends is its end): one ending calls `on_lost`, which
in the core process ends the core (`exit_core`), so the worker sees a core death and takes its
restart path. A step that raises on rank 0 leaves the other ranks inside a collective, so at
N > 1 any step error is the group's end (`GroupLost`), never one request's.

Timing. Each rank adds up the seconds its steps take (`StepTally`); a follower sends its running
totals up its pipe after its first step and then at most once every `REPORT_INTERVAL_S` (one small
fixed message, never a collective: the step's latency is untouched), and the watch keeps the
latest, which the core reports as per-rank step time (`/metrics`: `helexa:engine_step_seconds`).
A rank's step time includes its waits inside the collectives, so the ranks' figures stay close;
a rank whose count stops growing is the one to look at.

Every rank gets the same resolved `EngineConfig` (dtype and kernel choice made once by the core)
and its share of the CPU cores.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from engine.frontend import parent_death
from engine.frontend.engine_config import EngineConfig
from engine.models.parallel_layers import Shard
from helexa_kernels.machine import cpu_budget

log = logging.getLogger("helexa.engine")

# How long a rank waits inside one collective (or for the group to form) before it gives up.
COLLECTIVE_TIMEOUT_S = 120.0
# How often at most a follower sends its step timings up its pipe.
REPORT_INTERVAL_S = 1.0


class GroupLost(RuntimeError):
    """A rank died or a collective failed: the group cannot step again."""


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    weight_bytes: int
    kv_bytes: int
    num_blocks: int
    state_bytes: int = 0  # a hybrid model's linear-attention state slots


@dataclass(slots=True)
class StepTally:
    """One rank's steps so far and the seconds they took (running totals: a lost report loses nothing)."""

    rank: int
    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1


def backend_for(device: str, world: int, gpus: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo on CPU, and where ranks share a GPU (NCCL
    refuses two ranks on one device; gloo takes CUDA tensors: the GPU check of one-GPU machines)."""
    return "nccl" if torch.device(device).type == "cuda" and gpus >= world else "gloo"


def join_group(shard: Shard, init_file: str, device: str) -> None:
    """Join the process group (blocks until every rank has)."""
    if torch.device(device).type == "cpu":
        # The CPUs this process may use (its affinity and cgroup quota, `helexa_kernels.machine`), shared.
        usable = cpu_budget().threads
        threads = max(usable // shard.world, 1)
        torch.set_num_threads(threads)
        if threads == 1 and shard.world >= usable:
            log.warning("tensor_parallel %d on %d usable CPUs: one thread a rank; this layout is for "
                        "correctness, not speed", shard.world, usable)
    else:
        torch.cuda.set_device(shard.rank % torch.cuda.device_count())
    gpus = torch.cuda.device_count() if torch.device(device).type == "cuda" else 0
    dist.init_process_group(backend_for(device, shard.world, gpus), init_method=f"file://{init_file}", rank=shard.rank,
                            world_size=shard.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def rank_device(config: EngineConfig, shard: Shard) -> str:
    if torch.device(config.device).type == "cuda" and torch.cuda.device_count() > 1:
        return f"cuda:{shard.rank % torch.cuda.device_count()}"
    return config.device


class RankWatch:
    """Calls `on_lost(why)` once when any follower ends while the group is open."""

    def __init__(self, conns: list[Connection], processes: list[subprocess.Popen[bytes]],
                 on_lost: Callable[[str], None]) -> None:
        self.conns = conns
        self.processes = processes
        self.on_lost = on_lost
        self.closing = threading.Event()
        self.lost: str | None = None
        # Each follower's latest step timings, by rank (written by the watch thread only).
        self.tallies: dict[int, StepTally] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Once every follower has reported ready: from then on a readable pipe means its end."""
        self._thread = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while (rank := self._read_reports()) is None:
            pass
        if self.closing.is_set():
            return
        try:
            code: int | None = self.processes[rank - 1].wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self.lost = f"tensor-parallel rank {rank} died (exit code {code})"
        log.error("%s: the group ends", self.lost)
        self.on_lost(self.lost)

    def _read_reports(self) -> int | None:
        """Wait for the pipes; keep the timings they carry; the rank whose pipe ended, if one did."""
        ready = wait(self.conns)
        for rank, conn in enumerate(self.conns, start=1):
            if conn not in ready:
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return rank
            if isinstance(message, StepTally):
                self.tallies[rank] = message
        return None


class Followers:
    """Rank 0's handle on ranks 1..N-1: their pipes, their processes, the watch on them."""

    def __init__(self, conns: list[Connection], processes: list[subprocess.Popen[bytes]],
                 on_lost: Callable[[str], None]) -> None:
        self.conns = conns
        self.processes = processes
        self.watch = RankWatch(conns, processes, on_lost)
        self.reports: list[RankReport] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def await_ready(self, num_blocks: int) -> list[RankReport]:
        """Each follower's report once its shard is loaded and its KV cache allocated."""
        for conn in self.conns:
            conn.send(num_blocks)
        self.reports = [self._recv(conn) for conn in self.conns]
        self.watch.start()
        return self.reports

    def _recv(self, conn: Connection) -> RankReport:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            raise GroupLost(self.watch.lost or "a tensor-parallel rank exited while loading") from None
        if isinstance(message, str):
            raise GroupLost(message)
        assert isinstance(message, RankReport)
        return message

    def tallies(self) -> list[StepTally]:
        """Ranks 1..N-1's step timings as last reported (zeros before a rank's first report)."""
        got = self.watch.tallies
        return [got.get(rank, StepTally(rank)) for rank in range(1, len(self.conns) + 1)]

    def send_step(self, chunks: object) -> None:
        if self.watch.lost is not None:
            raise GroupLost(self.watch.lost)
        try:
            for conn in self.conns:
                conn.send(chunks)
        except (BrokenPipeError, OSError) as exc:
            raise GroupLost(self.watch.lost or f"a tensor-parallel rank's pipe broke: {exc}") from None

    def close(self) -> None:
        self.watch.closing.set()
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        for conn in self.conns:
            conn.close()


def start_followers(config: EngineConfig, world: int, on_lost: Callable[[str], None]) -> tuple[Followers, str]:
    """Start ranks 1..world-1 for `config` (dtype and kernels already resolved); returns their
    handle and the rendezvous file rank 0 joins with (`join_group`)."""
    init_file = str(Path(tempfile.mkdtemp(prefix="helexa-tp-")) / "rendezvous")
    conns, processes = [], []
    for rank in range(1, world):
        parent_end, child_end = multiprocessing.Pipe()
        fd = child_end.fileno()
        process = subprocess.Popen([sys.executable, "-m", "engine.runner.tensor_parallel", str(fd)],
                                   pass_fds=[fd])
        child_end.close()
        parent_end.send((config, Shard(rank, world), init_file, os.getpid()))
        conns.append(parent_end)
        processes.append(process)
    return Followers(conns, processes, on_lost), init_file


def follower_main(conn: Connection) -> None:
    """A follower rank: join, load this rank's shard, then run each step rank 0 sends."""
    from engine.loading.loader import load_checkpoint
    from engine.runner import ops
    from engine.runner.model_runner import ModelRunner

    config, shard, init_file, parent_pid = conn.recv()
    parent_death.arm(signal.SIGKILL, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = rank_device(config, shard)
    try:
        join_group(shard, init_file, device)
        ops.use_backend(config.kernels, device)
        checkpoint = load_checkpoint(config.model, dtype=getattr(torch, config.dtype), device=device,
                                     shard=shard)
        num_blocks = conn.recv()
        runner = ModelRunner(checkpoint.model, checkpoint.config,
                             dataclasses.replace(config, num_kv_blocks=num_blocks), checkpoint.model_id)
        conn.send(RankReport(shard.rank, runner.weight_bytes, runner.kv_bytes, runner.num_blocks,
                             runner.state_bytes))
    except Exception as exc:
        conn.send(f"tensor-parallel rank {shard.rank} failed to start: {type(exc).__name__}: {exc}")
        return
    tally, reported = StepTally(shard.rank), None
    while True:
        try:
            chunks = conn.recv()
        except (EOFError, OSError):
            return
        if chunks is None:
            break
        started = time.perf_counter()
        runner.follow(chunks)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        done = time.perf_counter()
        tally.add(done - started)
        if reported is None or done - reported >= REPORT_INTERVAL_S:
            conn.send(tally)
            reported = done
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # By the module's name, so what it sends unpickles on rank 0 (not as __main__'s classes).
    from engine.runner import tensor_parallel

    tensor_parallel.follower_main(Connection(int(sys.argv[1])))
