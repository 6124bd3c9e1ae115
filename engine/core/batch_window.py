"""The batch window: an idle engine that receives a request gathers the rest of its burst first.

Sixteen clients that start together reach the engine over some 10–30 ms (each goes through
HTTP, the gateway and JetStream on its own). Stepping at the first arrival runs a one-prompt
prefill, ~100 ms for SmolLM2 on 2 CPU cores, and the other fifteen wait it out, on cores the step
keeps busy. So an idle engine, once a request arrives, keeps taking requests while they come, and
stops as soon as the waiting prompts fill a step, or at `window_s` in all, or at a gap:

- `ARRIVAL_GAP_S` after a request whose gateway was still reading others when it published it
  (`GenerateRequest.arriving`, passed on as `EngineRequest.more_arriving`): they are on their way;
- `UNANNOUNCED_GAP_S` after any other: a request from another gateway, or from a client that sent
  its whole request at once, comes a gateway's and a worker's handling after the one before.

A request that arrives alone waits the short gap; a busy engine never waits (its next step takes
whatever has arrived, as always).
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Longest pause between two requests of one burst, measured at the worker on 2 loaded cores.
ARRIVAL_GAP_S = 0.010
# The wait for a request nobody announced: a gateway parses and publishes one in ~1 ms, a worker
# pulls and tokenizes it in another.
UNANNOUNCED_GAP_S = 0.003


def gather_burst(poll: Callable[[float], bool], take: Callable[[], bool], step_is_full: Callable[[], bool],
                 more_arriving: Callable[[], bool], window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> bool:
    """Call `take` for each request that arrives (`poll(timeout)` says one is there) until a gap,
    the end of the window or a full step; `more_arriving()` says whether the last request taken
    announced others. Returns False when `take` did (shut down)."""
    end = clock() + window_s
    while not step_is_full():
        left = end - clock()
        gap = ARRIVAL_GAP_S if more_arriving() else UNANNOUNCED_GAP_S
        if left <= 0 or not poll(min(gap, left)):
            return True
        if not take():
            return False
    return True
