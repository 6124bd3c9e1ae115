"""CPU time that a server's processes and the benchmark's own client spend on a load, by role.

A latency figure on a shared 2-core host moves by ±10 % from one minute to the next; the CPU a
process spends on a request moves far less, so this is where what each part of a pipeline costs
is read. Time comes from each thread's /proc/<pid>/task/<tid>/schedstat (nanoseconds on a CPU),
summed over the threads of every process under the server's root: a thread that ends during the
load takes its time with it, one that starts during it counts whole.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil

CLIENT = "client"


def helexa_role(cmdline: list[str]) -> str:
    """The part of `helexa up` a process is, from its command line."""
    line = " ".join(cmdline)
    if "apps.cli" in line:
        return cmdline[-1] if cmdline[-1] in ("gateway", "worker", "recorder") else "supervisor"
    if "spawn_main" in line:
        return "engine"  # the worker's engine process (multiprocessing spawn)
    if "nats-server" in line:
        return "nats"
    if "postgres" in line:
        return "postgres"
    return "other"


def whole_server(cmdline: list[str]) -> str:
    return "server"


def _thread_ns(pid: int) -> dict[int, int]:
    """Nanoseconds each thread of `pid` has run, by thread id; empty once the process is gone."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            times[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    return times


class ProcessCPU:
    """`with ProcessCPU(root_pid, role) as cpu: <load>`, then `cpu.ms` is CPU milliseconds by role,
    this process's own under CLIENT. Counts accumulate over every `with` of one instance."""

    def __init__(self, root_pid: int, role: Callable[[list[str]], str] = whole_server) -> None:
        self.root_pid, self.role = root_pid, role
        self.ms: Counter[str] = Counter()
        self._start: dict[tuple[int, int], int] = {}

    def _snapshot(self) -> dict[tuple[int, int], tuple[str, int]]:
        try:
            root = psutil.Process(self.root_pid)
            processes = [(p.pid, self.role(p.cmdline())) for p in [root, *root.children(recursive=True)]]
        except psutil.Error:
            processes = []
        processes.append((os.getpid(), CLIENT))
        snapshot = {}
        for pid, role in processes:
            for tid, ns in _thread_ns(pid).items():
                snapshot[(pid, tid)] = (role, ns)
        return snapshot

    def __enter__(self) -> ProcessCPU:
        self._start = {key: ns for key, (_, ns) in self._snapshot().items()}
        return self

    def __exit__(self, *exc: object) -> None:
        for key, (role, ns) in self._snapshot().items():
            self.ms[role] += (ns - self._start.get(key, 0)) / 1e6

    def per_request(self, requests: int) -> dict[str, float]:
        """Milliseconds of CPU per request by role, plus the server's total (every role but the client)."""
        result = {role: round(ms / requests, 3) for role, ms in sorted(self.ms.items())}
        result["server_total"] = round(sum(ms for role, ms in self.ms.items() if role != CLIENT) / requests, 3)
        return result
