"""The frame window is paced by the engine's steps (apps/worker/frame_window.py): the larger of the
floor and `steps` of the engine's steps at the pace its own counters show, never past the cap;
an engine that reports no steps (the scripted one) gets the floor; a restarted engine's counters
start again. A Replier given a paced window holds what that window holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.bus import connection, wire
from apps.embedded.nats_server import NatsServer
from apps.settings import WorkerSettings
from apps.worker import frame_window
from apps.worker.frame_window import REFRESH_STEPS, FrameWindow
from apps.worker.replies import Replier
from engine.frontend.protocol import CoreStats
from tests.worker.in_process import listen
from tests.worker.test_frame_window import SUBJECT, deltas, everything_sent_arrived


class Counters:
    """An engine's stats as the worker reads them: rank 0's steps and their seconds."""

    def __init__(self) -> None:
        self.stats = CoreStats(rank_steps=[0], rank_step_seconds=[0.0])

    def step(self, times: int, seconds_each: float) -> None:
        self.stats.rank_steps[0] += times
        self.stats.rank_step_seconds[0] += times * seconds_each


def test_the_window_is_steps_at_the_engines_pace_between_the_floor_and_the_cap() -> None:
    engine = Counters()
    window = FrameWindow(0.02, 2.5, lambda: engine.stats)
    assert window.seconds == 0.02  # no steps yet: the floor
    engine.step(REFRESH_STEPS - 1, 0.03)
    assert window.seconds == 0.02  # not read before REFRESH_STEPS steps
    engine.step(1, 0.03)
    assert window.seconds == pytest.approx(0.075)  # a CPU's 30 ms steps: 2.5 of them
    engine.step(REFRESH_STEPS, 0.004)
    assert window.seconds == 0.02  # a GPU's 4 ms steps: the floor is longer
    engine.step(REFRESH_STEPS, 2.0)
    assert window.seconds == frame_window.MAX_WINDOW_S  # a large model on a CPU: capped


def test_a_restarted_engine_counts_again_and_an_engine_without_steps_gets_the_floor() -> None:
    engine = Counters()
    window = FrameWindow(0.02, 2.5, lambda: engine.stats)
    engine.step(REFRESH_STEPS * 4, 0.03)
    assert window.seconds == pytest.approx(0.075)
    engine.stats = CoreStats(rank_steps=[0], rank_step_seconds=[0.0])  # the core process restarted
    engine.step(REFRESH_STEPS, 0.06)
    assert window.seconds == pytest.approx(0.15)
    scripted = FrameWindow(0.02, 2.5, CoreStats)  # no rank counters at all
    assert scripted.seconds == 0.02
    assert FrameWindow(0.0, 0.0, lambda: engine.stats).seconds == 0.0  # both off: a frame per delta


def test_the_settings_default_to_a_20_ms_floor_and_three_steps() -> None:
    settings = WorkerSettings(nats_url="nats://unused")
    assert (settings.frame_window_ms, settings.frame_window_steps) == (20.0, 3.0)
    with pytest.raises(ValueError, match="HELEXA_FRAME_WINDOW_STEPS"):
        WorkerSettings(nats_url="nats://unused", frame_window_steps=-1)


async def test_a_replier_holds_what_its_paced_window_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps of 20 s (and a cap above them) make a window no loop here outlasts.
    monkeypatch.setattr(frame_window, "MAX_WINDOW_S", 600.0)
    engine = Counters()
    engine.step(REFRESH_STEPS, 20.0)
    with NatsServer(tmp_path / "nats") as server:
        nc = await connection.connect(server.url, "frame-pace-test", max_reconnect_attempts=0)
        try:
            got = (await listen(nc, SUBJECT)).frames
            await nc.flush()
            replier = Replier(nc, SUBJECT, attempt=1, node="n",
                              frame_window=FrameWindow(0.0, 2.5, lambda: engine.stats))
            for token in range(5):
                await replier.delta(f"t{token} ", 1, token_ids=[token])
            await everything_sent_arrived(nc, got)
            assert [d.text for d in deltas(got)] == ["t0 "]  # the first alone; the rest held
            await replier.flush()
            await everything_sent_arrived(nc, got)
            assert [d.text for d in deltas(got)] == ["t0 ", "t1 t2 t3 t4 "]
            assert [d.token_ids for d in deltas(got)] == [[0], [1, 2, 3, 4]]
        finally:
            await nc.close()
    assert not [f for f in got if isinstance(f, wire.ErrorFrame)]
