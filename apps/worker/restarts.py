"""A model's engine core that dies comes back by itself.

`SupervisedEngine` is the `Engine` a model loop serves from: it passes everything to the running
core (`engine.frontend.core_client.AsyncEngine`), and when that core's process dies unasked it starts a new
one with the same configuration (the dtype the first one measured, pinned); a core that hangs
(alive, silent past `EngineConfig.stall_s` while it holds work) is killed by its client and dies
the same way. The requests the dead
core held have had their error outputs already; each run ends with an `engine_lost` error frame,
which a gateway migrates like a lost worker's stream. While the new core starts the engine has no
free slots, so the model loop pulls nothing and new requests wait in JetStream, or go to other
workers of the model.

Not every death is restarted:
- a core that reported a device fault before it died: the model is poisoned (`run.ModelHealth`),
  as a device fault always does, until it is reloaded;
- past the budget (`max_restarts` within `window_s`): a core that keeps dying is not a one-off,
  so the model goes out of service, poisoned with the reason, until it is reloaded. A new core
  that fails to start spends the budget too.
Each death is reported (`CoreExit`) to the worker, which publishes it (`CoreRestarted`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.frontend.core_client import AsyncEngine
from engine.frontend.protocol import CoreInfo, CoreStats, EngineOutputs, EngineRequest, ServiceClass

log = logging.getLogger("helexa.worker")


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._spent: collections.deque[float] = collections.deque()

    @property
    def used(self) -> int:
        self._expire()
        return len(self._spent)

    def spend(self) -> bool:
        """Take one restart, if the window has one left."""
        self._expire()
        if len(self._spent) >= self.max_restarts:
            return False
        self._spent.append(self._clock())
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()


@dataclass(slots=True, frozen=True)
class CoreExit:
    """One death of a model's core and what came of it."""

    restarted: bool
    exitcode: int | None
    held_requests: int
    restarts: int  # within the budget's window, this one included
    max_restarts: int
    restart_ms: float | None = None
    # Why it was not restarted (None when it was): the model is out of service until reloaded.
    out_of_service: str | None = None


class SupervisedEngine:
    """An `Engine` whose core is started again when its process dies (see the module doc)."""

    def __init__(self, engine: AsyncEngine, start: Callable[[], Awaitable[AsyncEngine]],
                 budget: RestartBudget) -> None:
        self._engine = engine
        self._start = start
        self._budget = budget
        self._restarting: asyncio.Task[None] | None = None
        self._stopped = False
        # The worker hears of every death here (set when the model loop joins the worker).
        self.on_exit: Callable[[CoreExit], Awaitable[None]] | None = None
        self._watch(engine)

    # -- the Engine protocol -------------------------------------------------------------------

    @property
    def info(self) -> CoreInfo:
        return self._engine.info

    @property
    def stats(self) -> CoreStats:
        # A dead core's last counters (requests waiting that no longer exist) must not hold back
        # pulling once the new core runs.
        return self._engine.stats if self._restarting is None else CoreStats()

    @property
    def model_id(self) -> str:
        return self._engine.model_id

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._engine.max_num_seqs

    @property
    def pid(self) -> int | None:
        """The running core process's id."""
        return self._engine.pid

    @property
    def restarting(self) -> bool:
        return self._restarting is not None

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        return 0 if self._restarting is not None else self._engine.free_slots(service_class)

    def generate(self, request: EngineRequest) -> EngineOutputs:
        # A dead core (restarting, or out of service) answers with its error output at once.
        return self._engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def shutdown(self) -> None:
        self._stopped = True
        if self._restarting is not None:
            self._restarting.cancel()
            await asyncio.gather(self._restarting, return_exceptions=True)
        await self._engine.shutdown()

    def __getattr__(self, name: str) -> Any:
        # What the core's client offers beyond the Engine protocol (e.g. work it does for the
        # worker off the event loop) is the running core's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    # -- restarts ------------------------------------------------------------------------------

    def _watch(self, engine: AsyncEngine) -> None:
        def died(held_requests: int) -> None:
            if self._stopped or engine is not self._engine or self._restarting is not None:
                return
            self._restarting = asyncio.create_task(self._restart(engine, held_requests))

        engine.on_death = died

    async def _restart(self, dead: AsyncEngine, held: int) -> None:
        await dead.shutdown()  # reaps the process (its exit code) and closes the pipe
        exitcode, device_fault = dead.exitcode, dead.device_fault
        report = CoreExit(restarted=False, exitcode=exitcode, held_requests=held, restarts=self._budget.used,
                          max_restarts=self._budget.max_restarts)
        if device_fault is not None:
            report = replace(report, out_of_service=f"a device fault before the core died: {device_fault}")
        else:
            log.warning("restarting the engine core", extra={"model": dead.model_id, "exitcode": exitcode,
                                                             "held_requests": held, "stalled": dead.stalled})
            report = await self._start_again(report)
        if report.out_of_service is not None:
            log.error("the engine core is not restarted: the model is out of service until reloaded",
                      extra={"model": dead.model_id, "exitcode": exitcode, "error": report.out_of_service})
        self._restarting = None
        if self.on_exit is not None:
            try:
                await self.on_exit(report)
            except Exception:  # the report is lost, the engine is not
                log.exception("reporting an engine core's death failed")

    async def _start_again(self, report: CoreExit) -> CoreExit:
        """A new core, within the budget; failed starts spend it too."""
        while self._budget.spend():
            started = time.monotonic()
            try:
                engine = await self._start()
            except Exception as exc:
                log.error("a new engine core did not start", extra={"error": f"{type(exc).__name__}: {exc}"[:1000]})
                continue
            self._engine = engine
            self._watch(engine)
            report = replace(report, restarted=True, restarts=self._budget.used,
                             restart_ms=round((time.monotonic() - started) * 1000.0, 1))
            log.info("engine core restarted", extra={"model": engine.model_id, "pid": engine.pid,
                                                    "restarts": report.restarts, "restart_ms": report.restart_ms})
            return report
        budget = self._budget
        return replace(report, restarts=budget.used,
                       out_of_service=f"the engine core died and its restart budget is spent "
                                      f"({budget.max_restarts} restarts in {budget.window_s:g} s)")
