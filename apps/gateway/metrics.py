"""Prometheus metrics of the gateway, named the way vLLM dashboards expect (`helexa:` prefix).

Latencies are observed where the client sees them (the gateway); engine-side state (running and
waiting sequences, KV-cache usage, prefix-cache hits) comes from the workers' `helexa_nodes`
entries, read when Prometheus scrapes: `render` takes them, and this gateway's admission state,
as they are at that moment.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from apps.bus import wire
from apps.gateway.api.structured import CHECKER

if TYPE_CHECKING:
    from apps.gateway.admission import Admission

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("helexa:time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.interactive_ttft = Histogram(
            "helexa:interactive_time_to_first_token_seconds",
            "Time to first token of interactive requests, by whether the model's workers last reported batch "
            "sequences running (batch_load yes/no): what batch work costs interactive users",
            ["model", "batch_load"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = BulkHistogram("helexa:inter_token_latency_seconds", "Time between streamed deltas",
                                 LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("helexa:e2e_request_latency_seconds", "Request latency, publish to final frame",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("helexa:request_queue_time_seconds", "Time from publish until a worker accepted",
                               ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("helexa:prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("helexa:generation_tokens", "Tokens generated", ["model"], registry=r)
        self.outcomes = Counter("helexa:request_success", "Finished requests by finish reason",
                                ["model", "finished_reason"], registry=r)
        self.errors = Counter("helexa:request_errors", "Failed requests by HTTP status", ["model", "status"],
                              registry=r)
        self.rejections = Counter("helexa:admission_rejections", "Requests refused before running, by reason",
                                  ["model", "reason"], registry=r)
        self.event_backlog = Gauge("helexa:gateway_event_backlog", "Events queued for publishing on EVENTS",
                                   registry=r)
        self.events_held = Gauge("helexa:gateway_events_held",
                                 "Events EVENTS did not take yet (full, or the bus away), held to be published again",
                                 registry=r)
        self.events_full = Gauge("helexa:gateway_events_full",
                                 "1 while EVENTS is too full for new requests (they get 503 events_full)", registry=r)
        self.events_dropped = Counter("helexa:gateway_events_dropped", "Events dropped: the publish queue was full",
                                      registry=r)
        self.bus_connections_lost = Counter("helexa:gateway_bus_connections_lost",
                                            "NATS connections the server closed for good (then replaced)", registry=r)
        self.slow_readers = Counter("helexa:gateway_slow_reader_cancels",
                                    "Streams cancelled because the client read too slowly", ["model"], registry=r)
        self.migrations = Counter("helexa:gateway_migrations",
                                  "Requests moved to another worker mid-answer, by why the old one was lost",
                                  ["model", "reason"], registry=r)
        self.batch_lines_running = Gauge("helexa:gateway_batch_lines_running",
                                         "Batch lines this gateway's runner has in flight", registry=r)
        self.batch_lines = Counter("helexa:gateway_batch_lines",
                                   "Batch lines this gateway's runner finished, by outcome (answered, failed, invalid)",
                                   ["outcome"], registry=r)
        # What the scrape in progress reports: live nodes, and model → this gateway's admission.
        self._nodes: list[wire.NodeStatus] = []
        self._admissions: Mapping[str, Admission] = {}
        r.register(_NodeCollector(self))

    def render(self, nodes: list[wire.NodeStatus], admissions: Mapping[str, Admission]) -> bytes:
        """The Prometheus text, with engine and admission gauges taken from `nodes` and `admissions`."""
        self._nodes, self._admissions = nodes, admissions
        return generate_latest(self.registry)


class BulkHistogram(Collector):
    """A per-model histogram its observers fill in bulk: each keeps its own `Tally` and adds it
    now and then. For a value observed once per streamed frame (the gaps between texts), where
    prometheus_client's `Histogram.observe` (a lock and a bucket walk per value) was a visible share
    of the gateway's CPU per token. Exposed as any histogram is (`_bucket`, `_sum`, `_count`)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.buckets = name, documentation, buckets
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        registry.register(self)

    def tally(self) -> Tally:
        return Tally(self.buckets)

    def add(self, model: str, tally: Tally) -> None:
        """Add what `tally` holds under `model`, and empty it."""
        if not tally.count:
            return
        counts = self._counts.setdefault(model, [0] * (len(self.buckets) + 1))
        for i, n in enumerate(tally.counts):
            counts[i] += n
        self._sums[model] = self._sums.get(model, 0.0) + tally.total
        tally.clear()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        for model, counts in self._counts.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, self.buckets), "+Inf"), counts, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            family.add_metric([model], buckets, self._sums[model])
        yield family


class Tally:
    """Values counted into a `BulkHistogram`'s buckets (upper bounds inclusive), not yet added."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def clear(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.total = 0.0


class _NodeCollector(Collector):
    """Engine state as the workers last reported it, summed per model."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        running = GaugeMetricFamily("helexa:num_requests_running", "Sequences in running batches", labels=["model"])
        waiting = GaugeMetricFamily("helexa:num_requests_waiting", "Sequences waiting in engines", labels=["model"])
        kv = GaugeMetricFamily("helexa:kv_cache_usage_perc", "Largest KV-cache usage among workers (0-1)",
                               labels=["model"])
        queries = CounterMetricFamily("helexa:prefix_cache_queries", "Prompt tokens looked up in prefix caches",
                                      labels=["model"])
        hits = CounterMetricFamily("helexa:prefix_cache_hits", "Prompt tokens found in prefix caches",
                                   labels=["model"])
        state_slots = GaugeMetricFamily("helexa:state_slots_in_use",
                                        "Linear-attention state slots held by sequences (hybrid models)",
                                        labels=["model"])
        compiles = CounterMetricFamily("helexa:grammar_compiles",
                                       "Grammar compiles started on workers (engine, and tool-grammar checks)",
                                       labels=["model"])
        compile_hits = CounterMetricFamily("helexa:grammar_compile_cache_hits",
                                           "Constrained requests that shared a grammar compile", labels=["model"])
        batch_running = GaugeMetricFamily("helexa:batch_requests_running",
                                          "Batch-class sequences in running batches", labels=["model"])
        batch_waiting = GaugeMetricFamily("helexa:batch_requests_waiting",
                                          "Batch-class sequences waiting in engines", labels=["model"])
        preemptions = CounterMetricFamily("helexa:preemptions", "Running sequences the engines preempted",
                                          labels=["model", "reason"])
        pulled = CounterMetricFamily("helexa:requests_pulled", "Requests workers pulled from the bus, by service class",
                                     labels=["model", "service_class"])
        step_seconds = SummaryMetricFamily("helexa:engine_step_seconds",
                                           "Engine steps and their seconds, by model-runner rank (tensor parallelism)",
                                           labels=["model", "rank"])
        cpu_threads = GaugeMetricFamily("helexa:engine_cpu_threads",
                                        "Threads a node's CPU engine steps run on now (its CPU quota, then measured)",
                                        labels=["model", "node"])
        per_model: dict[str, list[wire.ModelStatus]] = {}
        for node in self.metrics._nodes:
            for status in node.models:
                per_model.setdefault(status.model, []).append(status)
                if status.cpu_threads:
                    cpu_threads.add_metric([status.model, node.node], status.cpu_threads)
        for model, statuses in per_model.items():
            running.add_metric([model], sum(s.num_running for s in statuses))
            waiting.add_metric([model], sum(s.num_waiting for s in statuses))
            kv.add_metric([model], max(s.kv_usage for s in statuses))
            queries.add_metric([model], sum(s.prefix_queries for s in statuses))
            hits.add_metric([model], sum(s.prefix_hits for s in statuses))
            state_slots.add_metric([model], sum(s.state_slots - s.free_state_slots for s in statuses))
            compiles.add_metric([model], sum(s.grammar_compiles for s in statuses))
            compile_hits.add_metric([model], sum(s.grammar_cache_hits for s in statuses))
            batch_running.add_metric([model], sum(s.batch_running for s in statuses))
            batch_waiting.add_metric([model], sum(s.batch_waiting for s in statuses))
            for reason in sorted({reason for s in statuses for reason in s.preemptions}):
                preemptions.add_metric([model, reason], sum(s.preemptions.get(reason, 0) for s in statuses))
            for cls in sorted({cls for s in statuses for cls in s.pulled}):
                pulled.add_metric([model, cls], sum(s.pulled.get(cls, 0) for s in statuses))
            for rank in range(max(len(s.rank_steps) for s in statuses)):
                ranked = [s for s in statuses if rank < min(len(s.rank_steps), len(s.rank_step_seconds))]
                step_seconds.add_metric([model, str(rank)], count_value=sum(s.rank_steps[rank] for s in ranked),
                                        sum_value=sum(s.rank_step_seconds[rank] for s in ranked))
        yield from (running, waiting, kv, queries, hits, state_slots, compiles, compile_hits)
        yield from (batch_running, batch_waiting, preemptions, pulled, step_seconds, cpu_threads)
        gateway_compiles = CounterMetricFamily("helexa:gateway_grammar_compiles",
                                               "Grammar checks this gateway started compiling")
        gateway_compiles.add_metric([], CHECKER.started)
        yield gateway_compiles
        pending = GaugeMetricFamily("helexa:admission_pending", "Requests admitted or queued at this gateway",
                                    labels=["model"])
        in_flight = GaugeMetricFamily("helexa:admission_in_flight", "Requests holding a slot at this gateway",
                                      labels=["model"])
        for model, admission in self.metrics._admissions.items():
            pending.add_metric([model], admission.pending)
            in_flight.add_metric([model], admission.in_flight)
        yield from (pending, in_flight)
