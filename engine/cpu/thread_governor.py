"""How many threads a CPU step runs on: chosen by measurement while the engine serves.

torch starts with one thread per core the process may use, the fastest count on a quiet machine
(the default model's decode step on a 2-core EPYC: 30 ms on 2 threads, 43 ms on 1). Where another
process keeps one of those cores busy, every parallel region of a step waits at its barrier for the
thread that was descheduled, and the step takes longer than on fewer threads (in process: 66 ms on
2 threads against 43 ms on 1, a prefill 467 ms against 209; under `helexa up` a 2-thread step took
16x a 1-thread one). How busy the machine is changes while the engine serves, so the count is
measured, never assumed.

The governor runs a probe after the first `first_probe` pure decode steps, then every `interval`
of them or every `interval_s` seconds spent in them, whichever comes first (a busy machine makes
steps slow, and counting steps alone would leave it slow for minutes): decode steps alternate
between the current count and one neighbour (a quarter fewer and a quarter more, at least one
thread, in turn, within 1..the starting count), each neighbour step paired with the step before it
when both ran the same number of rows (a decode step's cost grows by a token of context per step,
so the two of a pair cost the same work). After `probe_pairs` pairs it moves to the neighbour when
the median of the pairs' time ratios is at least `margin` faster; a probe that finds no pair in
`4 * probe_pairs` steps (the batch keeps changing) ends without a decision. Other steps (prefill,
mixed) run on the current count and are not measured. A probe costs at most `probe_pairs` steps on
the other count per interval; each probe that keeps the count doubles the intervals, up to
`max_backoff` times (a steady machine is probed less and less: beside a spinning process a probe's
2-thread steps are the slow ones), and a move brings them back.

It starts from what the process may use: torch counts the cores in the affinity mask and knows no
CPU quota, so in a container limited to fewer CPUs than its host has cores it would start a thread
per host core and the kernel would stop the process for the rest of every period once they had
spent the quota (`docs/benchmarks.md`, "Threads under a CPU quota"). The engine core's process calls
`fit_torch_threads` before anything is measured (the dtype choice times linears at this count), which
lowers torch's count to `helexa_kernels.machine.cpu_budget`'s.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helexa_kernels.machine import CpuBudget, cpu_budget

log = logging.getLogger("helexa.engine")


@dataclass(slots=True)
class _Probe:
    candidate: int
    # The last step on the current count, waiting for its neighbour: (rows, seconds).
    pending: tuple[int, float] | None = None
    ratios: list[float] = field(default_factory=list)
    steps: int = 0


class ThreadGovernor:
    def __init__(self, max_threads: int, *, first_probe: int = 4, interval: int = 100, interval_s: float = 5.0,
                 max_backoff: int = 8, probe_pairs: int = 4, margin: float = 0.1,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if max_threads < 2:
            raise ValueError("a governor needs at least 2 threads to choose from")
        self.max_threads = max_threads
        self.current = max_threads
        self.interval = interval
        self.interval_s = interval_s
        self.max_backoff = max_backoff
        # The intervals' multiplier: doubled after a probe that kept the count, back to 1 on a move.
        self.backoff = 1
        self.probe_pairs = probe_pairs
        self.margin = margin
        self._set_threads = set_threads
        self._applied = max_threads
        self.decode_steps = 0
        # Decode steps and their seconds since the last probe ended (the first comes sooner).
        self._since_probe = max(0, interval - first_probe)
        self._seconds_since_probe = 0.0
        self._probe: _Probe | None = None
        self._next_down = True
        # The step begun last: its rows (None: not a pure decode step) and the count it ran on.
        self._step: tuple[int | None, int] = (None, max_threads)
        # Every move: (decode steps so far, from, to, the median ratio that decided it).
        self.moves: list[tuple[int, int, int, float]] = []

    @classmethod
    def for_this_process(cls) -> ThreadGovernor | None:
        """A governor over torch's thread count now, or None where there is nothing to choose."""
        threads = torch.get_num_threads()
        return cls(threads) if threads > 1 else None

    def begin(self, decode_rows: int | None) -> int:
        """Set the thread count for the step about to run (`decode_rows`: its rows when it is a pure
        decode step, else None) and return it."""
        threads = self.current
        if decode_rows is not None:
            if self._probe is None and (self._since_probe >= self.interval * self.backoff
                                        or self._seconds_since_probe >= self.interval_s * self.backoff):
                self._probe = _Probe(self._neighbour())
            if self._probe is not None and self._probe.pending is not None:
                threads = self._probe.candidate
        self._step = (decode_rows, threads)
        self._apply(threads)
        return threads

    def end(self, seconds: float) -> None:
        """The step begun last took `seconds`."""
        rows, threads = self._step
        if rows is None:
            return
        self.decode_steps += 1
        self._since_probe += 1
        self._seconds_since_probe += seconds
        probe = self._probe
        if probe is None:
            return
        probe.steps += 1
        if threads == probe.candidate and probe.pending is not None:
            pending_rows, pending_seconds = probe.pending
            if pending_rows == rows and pending_seconds > 0:
                probe.ratios.append(seconds / pending_seconds)
            probe.pending = None
        else:
            probe.pending = (rows, seconds)
        if len(probe.ratios) >= self.probe_pairs:
            self._decide(probe)
        elif probe.steps >= 4 * self.probe_pairs and probe.pending is None:
            self._finish_probe()

    def restore(self) -> None:
        """Back to the starting count (torch's count is the whole process's)."""
        self.current = self.max_threads
        self._probe = None
        self._apply(self.max_threads)

    def _apply(self, threads: int) -> None:
        """Give torch `threads`, unless it has them already."""
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads

    def _neighbour(self) -> int:
        stride = max(1, self.current // 4)
        down, up = self.current - stride, min(self.current + stride, self.max_threads)
        if down < 1:
            return up
        if up == self.current:
            return down
        candidate = down if self._next_down else up
        self._next_down = not self._next_down
        return candidate

    def _decide(self, probe: _Probe) -> None:
        ratio = statistics.median(probe.ratios)
        if ratio <= 1 - self.margin:
            log.info("CPU steps now on %d threads: decode steps measured %.2fx the time of %d threads",
                     probe.candidate, ratio, self.current)
            self.moves.append((self.decode_steps, self.current, probe.candidate, ratio))
            self.current = probe.candidate
            self.backoff = 1
        else:
            self.backoff = min(2 * self.backoff, self.max_backoff)
        self._finish_probe()

    def _finish_probe(self) -> None:
        self._probe = None
        self._since_probe = 0
        self._seconds_since_probe = 0.0


def fit_torch_threads(budget: CpuBudget | None = None) -> int:
    """Lower torch's thread count to what this process may use (never raise it: a count set on
    purpose, `OMP_NUM_THREADS` or `torch.set_num_threads`, stays when it fits), and return it."""
    budget = budget or cpu_budget()
    threads = torch.get_num_threads()
    if threads > budget.threads:
        log.info("CPU steps on %d of torch's %d threads: %s", budget.threads, threads, budget.describe())
        torch.set_num_threads(budget.threads)
    return torch.get_num_threads()
