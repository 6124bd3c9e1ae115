"""The batch window: an idle engine that receives a request gathers the rest of its burst first.

Sixteen clients that start together reach the engine over some 10–30 ms (each goes through
HTTP, the gateway and JetStream on its own). Stepping at the first arrival runs a one-prompt
prefill, ~100 ms for SmolLM2 on 2 CPU cores, and the other fifteen wait it out, on cores the step
keeps busy. So an idle engine, once a request arrives, keeps taking requests while they come:
it waits for the next one at most `ARRIVAL_GAP_S`, and at most `window_s` in all, and stops as
soon as the waiting prompts fill a step. A request that arrives alone pays one gap; a busy engine
never waits (its next step takes whatever has arrived, as always).
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Longest pause between two requests of one burst, measured at the worker on 2 loaded cores.
ARRIVAL_GAP_S = 0.010


def gather_burst(poll: Callable[[float], bool], take: Callable[[], bool], step_is_full: Callable[[], bool],
                 window_s: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Call `take` for each request that arrives (`poll(timeout)` says one is there) until a gap,
    the end of the window or a full step. Returns False when `take` did (shut down)."""
    end = clock() + window_s
    while not step_is_full():
        left = end - clock()
        if left <= 0 or not poll(min(ARRIVAL_GAP_S, left)):
            return True
        if not take():
            return False
    return True
