"""A dead engine core comes back (apps/worker/restarts.py): restarted within its budget, with no
slots while the new one starts, not restarted after a device fault or past the budget, failed
starts spending the budget, and a stop during a restart leaving nothing running. The cores here
are stand-ins with the core client's death hooks; tests/e2e/test_core_restart.py kills a real one."""

from __future__ import annotations

import asyncio

import pytest

from apps.worker.restarts import CoreExit, RestartBudget, SupervisedEngine
from engine.frontend.protocol import CoreInfo, CoreStats, ServiceClass
from tests.support import eventually_async


class Core:
    """What the supervisor uses of `engine.frontend.core_client.AsyncEngine`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.on_death = None
        self.device_fault: str | None = None
        self.stalled = False
        self.exitcode: int | None = None
        self.dead = False
        self.closed = False
        self.info = CoreInfo(model_id="m", max_model_len=64, max_num_seqs=4, num_blocks=8, block_size=16)
        self.stats = CoreStats(num_waiting=3)

    model_id = "m"
    max_model_len = 64
    max_num_seqs = 4

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        return 0 if self.dead else 4

    def die(self, held: int = 2, exitcode: int = -9) -> None:
        self.dead, self.exitcode = True, exitcode
        assert self.on_death is not None
        self.on_death(held)

    async def shutdown(self) -> None:
        self.closed = True


class Starts:
    """New cores on demand: each start waits for `release`, or fails while `failures` last."""

    def __init__(self, failures: int = 0) -> None:
        self.cores: list[Core] = []
        self.failures = failures
        self.release = asyncio.Event()
        self.release.set()
        self.calls = 0

    async def __call__(self) -> Core:
        self.calls += 1
        await self.release.wait()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine core failed to start: out of memory")
        self.cores.append(Core(100 + len(self.cores)))
        return self.cores[-1]


def supervised(starts: Starts, max_restarts: int = 3, clock: list[float] | None = None) -> tuple[
        SupervisedEngine, Core, list[CoreExit]]:
    first = Core(1)
    budget = RestartBudget(max_restarts, 600.0) if clock is None else RestartBudget(max_restarts, 600.0,
                                                                                     clock=lambda: clock[0])
    engine = SupervisedEngine(first, starts, budget)  # type: ignore[arg-type]
    reports: list[CoreExit] = []

    async def heard(report: CoreExit) -> None:
        reports.append(report)

    engine.on_exit = heard
    return engine, first, reports


async def test_a_dead_core_is_restarted_with_no_slots_meanwhile() -> None:
    starts = Starts()
    starts.release.clear()
    engine, first, reports = supervised(starts)
    assert engine.free_slots() == 4 and engine.pid == 1
    first.die(held=2)
    await eventually_async(lambda: starts.calls == 1, 5.0, interval_s=0, message="the restart begun")
    assert engine.restarting and engine.free_slots() == 0
    assert engine.stats.num_waiting == 0  # not the dead core's counters
    assert first.closed  # reaped before the new one starts
    starts.release.set()
    await eventually_async(lambda: reports, 5.0, interval_s=0, message="the exit reported")
    assert reports == [CoreExit(restarted=True, exitcode=-9, held_requests=2, restarts=1, max_restarts=3,
                                restart_ms=reports[0].restart_ms)]
    assert not engine.restarting and engine.free_slots() == 4 and engine.pid == 100
    first.die()  # a late word from the old core changes nothing
    assert starts.calls == 1


async def test_past_the_budget_the_model_is_out_of_service() -> None:
    starts = Starts()
    engine, first, reports = supervised(starts, max_restarts=2)
    core = first
    for n in range(1, 4):
        core.die()
        await eventually_async(lambda n=n: len(reports) == n, 5.0, interval_s=0, message=f"exit {n} reported")
        core = starts.cores[-1]
    assert [r.restarted for r in reports] == [True, True, False]
    assert reports[-1].out_of_service is not None and "restart budget is spent" in reports[-1].out_of_service
    assert starts.calls == 2 and engine.free_slots() == 0


async def test_the_budget_is_per_window() -> None:
    clock = [0.0]
    starts = Starts()
    engine, first, reports = supervised(starts, max_restarts=1, clock=clock)
    first.die()
    await eventually_async(lambda: len(reports) == 1, 5.0, interval_s=0, message="the first exit reported")
    clock[0] = 601.0
    starts.cores[-1].die()
    await eventually_async(lambda: len(reports) == 2, 5.0, interval_s=0, message="the second exit reported")
    assert [r.restarted for r in reports] == [True, True] and reports[1].restarts == 1


async def test_a_core_that_reported_a_device_fault_is_not_restarted() -> None:
    starts = Starts()
    engine, first, reports = supervised(starts)
    first.device_fault = "device fault: RuntimeError: CUDA error: an illegal memory access was encountered"
    first.die()
    await eventually_async(lambda: reports, 5.0, interval_s=0, message="the exit reported")
    assert not reports[0].restarted and "CUDA error" in (reports[0].out_of_service or "")
    assert starts.calls == 0


@pytest.mark.parametrize(("failures", "restarted"), [(2, True), (3, False)], ids=["third-start-runs", "none-runs"])
async def test_failed_starts_spend_the_budget(failures: int, restarted: bool) -> None:
    starts = Starts(failures=failures)
    engine, first, reports = supervised(starts, max_restarts=3)
    first.die()
    await eventually_async(lambda: reports, 5.0, interval_s=0, message="the exit reported")
    assert reports[0].restarted is restarted and reports[0].restarts == 3
    assert starts.calls == 3


async def test_stopping_during_a_restart_cancels_it() -> None:
    starts = Starts()
    starts.release.clear()
    engine, first, reports = supervised(starts)
    first.die()
    await eventually_async(lambda: starts.calls == 1, 5.0, interval_s=0, message="the restart begun")
    await engine.shutdown()
    starts.release.set()
    assert not starts.cores and not reports and first.closed
