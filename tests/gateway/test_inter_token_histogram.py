"""The inter-token histogram is filled in bulk (apps/gateway/metrics.py `BulkHistogram`): an answer
counts its gaps and adds them every few dozen and when it ends. /metrics must show exactly what
prometheus_client's own Histogram shows for the same values, bucket edges included."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from apps.bus import wire
from apps.gateway import generation_metrics
from apps.gateway.generation_metrics import GenerationMetrics
from apps.gateway.metrics import LATENCY_BUCKETS, GatewayMetrics
from engine.frontend.protocol import SamplingParams

NAME = "helexa:inter_token_latency_seconds"
# Values on bucket edges (upper bounds are inclusive), between them, and past the last one.
VALUES = [0.005, 0.0051, 0.01, 0.2, 0.25, 3.0, 119.0, 120.0, 500.0, 0.0]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) if family.name == NAME for s in family.samples}


def test_bulk_added_gaps_read_as_prometheus_clients_own_histogram() -> None:
    metrics = GatewayMetrics()
    tally = metrics.itl.tally()
    for value in VALUES[:4]:
        tally.observe(value)
    metrics.itl.add("m", tally)
    for value in VALUES[4:]:
        tally.observe(value)
    metrics.itl.add("m", tally)
    metrics.itl.add("m", tally)  # empty now: adds nothing

    registry = CollectorRegistry()
    reference = Histogram(NAME, "Time between streamed deltas", ["model"], buckets=LATENCY_BUCKETS,
                          registry=registry)
    for value in VALUES:
        reference.labels("m").observe(value)
    ours = samples(metrics.render([], {}).decode())
    assert ours == samples(generate_latest(registry).decode())
    assert ours[(f"{NAME}_count", (("model", "m"),))] == len(VALUES)


def test_an_answer_adds_its_gaps_as_it_goes_and_the_rest_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation_metrics, "ITL_ADD_EVERY", 3)
    metrics = GatewayMetrics()
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="r", sampling=SamplingParams(),
                                   prompt="hi")
    timer = GenerationMetrics(metrics).answer(request)

    def count() -> float:
        return samples(metrics.render([], {}).decode()).get((f"{NAME}_count", (("model", "m"),)), 0.0)

    for seq in range(5):  # a first text, then 4 gaps
        timer.frame(wire.Delta(seq=seq, text="t", num_tokens=1))
    assert count() == 3  # added once three were counted; the fourth waits
    timer.close()  # the client left, or the answer ended
    assert count() == 4
