"""Generation metrics (runs in the gateway process): what the generation lifecycle counts of each
answer, from its admission to its last frame.

Refusals and errors per model and reason, slow readers, the queue wait (published to first
frame), and per answer its time to first text, the gaps between texts, its end-to-end time, its
tokens and how it finished. The Prometheus collectors are `GatewayMetrics`; this module only says
what each step of a generation records in them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from apps.bus import wire
from apps.gateway.metrics import GatewayMetrics
from engine.frontend.protocol import ServiceClass


class GenerationMetrics:
    """`batch_load(model)`: whether the model's workers last reported batch sequences running."""

    def __init__(self, metrics: GatewayMetrics, batch_load: Callable[[str], bool] | None = None) -> None:
        self._metrics = metrics
        self._batch_load = batch_load

    def rejected(self, model: str, reason: str | None) -> None:
        self._metrics.rejections.labels(model, reason).inc()

    def slow_reader(self, model: str) -> None:
        self._metrics.slow_readers.labels(model).inc()

    def errored(self, model: str, status: int) -> None:
        self._metrics.errors.labels(model, str(status)).inc()

    def migrated(self, model: str, code: str | None) -> None:
        self._metrics.migrations.labels(model, code).inc()

    def first_frame(self, request: wire.GenerateRequest) -> None:
        """The worker's first frame is in: how long the request waited for a worker."""
        self._metrics.queue.labels(request.model).observe(max(time.time() - request.created_at, 0.0))

    def answer(self, request: wire.GenerateRequest) -> AnswerTimer:
        return AnswerTimer(self._metrics, request, self._batch_load)


# Gaps an answer counts before it adds them to the inter-token histogram.
ITL_ADD_EVERY = 32


class AnswerTimer:
    """One answer's timings and totals, recorded as its frames come."""

    def __init__(self, metrics: GatewayMetrics, request: wire.GenerateRequest,
                 batch_load: Callable[[str], bool] | None = None) -> None:
        self._metrics = metrics
        self._model = request.model
        self._interactive = request.service_class == ServiceClass.INTERACTIVE
        self._batch_load = batch_load
        self._created_at = request.created_at
        self._last_text_at: float | None = None
        # The gaps between texts, counted here and added to the model's histogram every
        # `ITL_ADD_EVERY` gaps and when the answer ends (a frame's observation is the hot path).
        self._itl = metrics.itl.tally()

    def frame(self, frame: wire.Delta | wire.Final) -> None:
        now, metrics, model = time.time(), self._metrics, self._model
        if isinstance(frame, wire.Delta) and (frame.text or frame.reasoning or frame.tool_calls):
            if self._last_text_at is None:
                ttft = max(now - self._created_at, 0.0)
                metrics.ttft.labels(model).observe(ttft)
                if self._interactive:
                    load = "yes" if self._batch_load is not None and self._batch_load(model) else "no"
                    metrics.interactive_ttft.labels(model, load).observe(ttft)
            else:
                self._itl.observe(now - self._last_text_at)
                if self._itl.count >= ITL_ADD_EVERY:
                    metrics.itl.add(model, self._itl)
            self._last_text_at = now
        if isinstance(frame, wire.Final):
            metrics.e2e.labels(model).observe(max(now - self._created_at, 0.0))
            metrics.prompt_tokens.labels(model).inc(frame.usage.prompt_tokens)
            metrics.generation_tokens.labels(model).inc(frame.usage.completion_tokens)
            metrics.outcomes.labels(model, frame.finish_reason).inc()

    def close(self) -> None:
        """The answer ended (or its client left): its gaps not yet added go to the histogram."""
        self._metrics.itl.add(self._model, self._itl)
