"""How long a stream's tokens after a frame wait to go out together (`Replier`'s frame window).

A frame costs the same in every process it passes (the worker's encode and publish, the NATS
server's routing, the gateway's decode, SSE chunk and socket write) however many tokens it
carries. The window is the larger of a floor in milliseconds (`HELEXA_FRAME_WINDOW_MS`, 20) and a
number of the engine's steps (`HELEXA_FRAME_WINDOW_STEPS`, 3) at the pace it has been stepping,
capped at `MAX_WINDOW_S`:

- on a GPU (steps of ~10 ms) that is the floor, or a little more: two or three tokens a frame at
  100 tokens/s per stream;
- on a CPU, where a 16-stream step of the default model takes ~30 ms, a floor of 20 ms merged
  nothing: every token was its own frame. Three steps make two or three tokens a frame there
  too. On 2 cores that cut the services' CPU per 64-token request at 16 streams from ~12 to ~8 ms
  and, with fewer wake-ups taking the cores from the engine's threads mid-step, raised the
  engine's tokens/s by ~15% (docs/benchmarks.md, "Frames at the engine's pace").

The first token of a stream never waits, nor does its last, and no text waits longer than one
window. The pace is read from the engine's own step counters (`CoreStats.rank_steps` and
`rank_step_seconds`, rank 0) and refreshed every `REFRESH_STEPS` steps; an engine that reports no
steps (the scripted engine) gets the floor. Both settings at 0 send every delta as it comes.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.frontend.protocol import CoreStats

# A window never longer than this, however slow the steps (a large model on a CPU): text a reader
# waits for should not come in bursts further apart.
MAX_WINDOW_S = 0.25
# Steps between two readings of the engine's pace.
REFRESH_STEPS = 16
# How often `at` looks at the engine's counters (every delta of every stream asks for the window).
LOOK_EVERY_S = 0.1


class FrameWindow:
    """The frame window now, in seconds (`seconds`): fixed, or paced by the engine's steps."""

    __slots__ = ("_floor_s", "_next_look", "_seconds", "_seen_seconds", "_seen_steps", "_stats", "_steps")

    def __init__(self, floor_s: float, steps: float = 0.0, stats: Callable[[], CoreStats] | None = None) -> None:
        self._floor_s = floor_s
        self._steps = steps
        self._stats = stats if steps > 0 else None
        self._seconds = floor_s
        self._seen_steps = 0
        self._seen_seconds = 0.0
        self._next_look = 0.0

    def at(self, now: float) -> float:
        """The window at monotonic time `now`, the engine's counters read at most every `LOOK_EVERY_S`."""
        if now < self._next_look:
            return self._seconds
        self._next_look = now + LOOK_EVERY_S
        return self.seconds

    @property
    def seconds(self) -> float:
        if self._stats is not None:
            stats = self._stats()
            if stats.rank_steps and stats.rank_step_seconds:
                steps, step_seconds = stats.rank_steps[0], stats.rank_step_seconds[0]
                if steps < self._seen_steps:  # a restarted engine counts from zero again
                    self._seen_steps, self._seen_seconds = 0, 0.0
                if steps - self._seen_steps >= REFRESH_STEPS:
                    pace = (step_seconds - self._seen_seconds) / (steps - self._seen_steps)
                    self._seconds = max(self._floor_s, min(self._steps * pace, MAX_WINDOW_S))
                    self._seen_steps, self._seen_seconds = steps, step_seconds
        return self._seconds
