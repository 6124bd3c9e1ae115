"""Bench results as EVENTS: a run becomes one `bench.run` event and one `bench.score` per number, so
the recorder projects them into `bench_runs` and `scores` like any other event. The same events are
also written to a JSON results file, which `helexa bench report --results` reads without a database."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient

from apps.bench.scenarios import Outcome
from apps.bus import connection, declaration, roles
from apps.bus.event_publish import publish_event
from apps.bus.events import BenchRunRecorded, ScoreRecorded
from apps.bus.topology import BusLimits

# `scorer` of the numbers the bench measured itself; quality scores carry their scorer's name.
MEASURED_BY = "helexa-bench"


def bench_node() -> str:
    """The `node` of bench events: the machine the bench ran on (the server is the `target`)."""
    return f"bench@{socket.gethostname()}"


def outcome_events(
    outcome: Outcome, *, target: str, model: str, config: dict[str, Any]
) -> tuple[BenchRunRecorded, list[ScoreRecorded]]:
    run_id = uuid.uuid4().hex
    node = bench_node()
    results = dict(outcome.results)
    if outcome.error:
        results["error"] = outcome.error
    run = BenchRunRecorded(
        model=model, node=node, run_id=run_id, target=target, scenario=outcome.scenario, config=config,
        started_at=outcome.started_at, finished_at=outcome.finished_at, results=results,
    )
    scores = [
        ScoreRecorded(model=model, node=node, run_id=run_id, scenario=outcome.scenario,
                           metric=s.metric, value=s.value, unit=s.unit, scorer=MEASURED_BY)
        for s in outcome.scores
    ]
    return run, scores


async def _reported_later(exc: Exception) -> None:
    """Connection errors surface as the exception `connect` or `publish` raises; no log per retry."""


class EventPublisher:
    """Publishes bench events onto EVENTS and waits for each JetStream ack: a result the stream did not
    take is an error here, not a warning, since the bench exists to record it."""

    def __init__(self, nats_url: str, limits: BusLimits) -> None:
        self.nats_url = nats_url
        self.limits = limits
        self._nc: NatsClient | None = None

    async def __aenter__(self) -> EventPublisher:
        self._nc = await connection.connect(self.nats_url, "helexa-bench", role=roles.BENCH, max_reconnect_attempts=3,
                                          error_cb=_reported_later)
        # Declared by an administrator (`helexa bus setup`, `helexa up`): the bench's role may not.
        await declaration.require_topology(self._nc.jetstream(), wait=False)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._nc is not None:
            await self._nc.flush()
            await self._nc.close()

    async def publish(self, events: Iterable[BenchRunRecorded | ScoreRecorded]) -> None:
        assert self._nc is not None, "use EventPublisher as an async context manager"
        js = self._nc.jetstream()
        for event in events:
            await publish_event(js, event, required=True)


class ResultsFile(msgspec.Struct, kw_only=True):
    """What `helexa bench run --out` writes: the events it published, readable without PostgreSQL."""

    runs: list[BenchRunRecorded] = []
    scores: list[ScoreRecorded] = []

    def write(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self)))

    @classmethod
    def read(cls, path: str | Path) -> ResultsFile:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)
