"""The node's entry in the `helexa_nodes` bucket (runs in the worker process): what the node and
each of its models can take now, refreshed every `status_interval_s` and at once when a model
changes state (gateways must hear of a poisoned one now), and the `node.status` event the ledger
gets when that changes (models loaded or unloaded, poisoned), never for a mere refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from apps.bus import wire
from apps.bus.codes import ModelState, NodeState
from apps.bus.event_publish import publish_event
from apps.bus.events import NodeStatusChanged
from apps.worker.model_lifecycle import ModelLifecycle
from apps.worker.model_loop import ModelLoop

log = logging.getLogger("helexa.worker")


@functools.cache
def helexa_version() -> str:
    """The installed package's version (read once: reading it parses the package's metadata file)."""
    try:
        return importlib.metadata.version("helexa")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


def model_status(loop: ModelLoop) -> wire.ModelStatus:
    """One model's part of the node entry: its limits, slots, engine counters and health."""
    limits = loop.context.derive()
    stats = loop.engine.stats
    info = loop.engine.info
    return wire.ModelStatus(
        model=loop.model_id,
        max_model_len=limits.context,
        max_input_tokens=limits.input,
        max_output_tokens=limits.output,
        slots=loop.engine.max_num_seqs,
        free_slots=loop.free_slots(),
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=round(stats.kv_usage, 4),
        prefix_queries=stats.prefix_queries,
        prefix_hits=stats.prefix_hits,
        batch_running=stats.num_batch_running,
        batch_waiting=stats.num_batch_waiting,
        preemptions=dict(stats.preemptions_by_reason),
        state_slots=stats.num_state_slots,
        free_state_slots=stats.num_free_state_slots,
        state=ModelState.POISONED if loop.poisoned is not None else ModelState.READY,
        # The node entry (a KV write) carries it: bounded like every error text.
        detail=wire.bounded_text(loop.poisoned) if loop.poisoned is not None else None,
        prefill_tok_per_s=round(loop.context.prefill_tok_per_s, 1),
        memory_mb=loop.memory_mb,
        vocab_size=loop.tokenizer.vocab_size,
        dtype=info.dtype,
        dtype_reason=info.dtype_reason,
        pulled=dict(loop.intake.pulled),
        tensor_parallel=info.tensor_parallel,
        rank_steps=list(stats.rank_steps),
        rank_step_seconds=[round(seconds, 6) for seconds in stats.rank_step_seconds],
        cpu_threads=stats.cpu_threads,
        grammar_compiles=stats.grammar_compiles + loop.model.grammars.started,
        grammar_cache_hits=stats.grammar_cache_hits,
    )


class NodeEntry:
    """The node's `helexa_nodes` entry; `attach` it to the bus before publishing."""

    def __init__(self, node: str, models: ModelLifecycle, interval_s: float) -> None:
        self.node = node
        self.models = models
        self.interval_s = interval_s
        # Set when the entry should be refreshed now (a model was poisoned).
        self.changed = asyncio.Event()
        self._last_summary: tuple[str, tuple[tuple[str, str], ...]] | None = None

    def attach(self, kv: KeyValue, js: JetStreamContext) -> None:
        self.kv = kv
        self.js = js

    def status(self, state: NodeState = NodeState.READY) -> wire.NodeStatus:
        return wire.NodeStatus(
            node=self.node, models=[model_status(m) for m in self.models.loops.values()], version=helexa_version(),
            status=state, memory_mb=self.models.memory_mb, free_memory_mb=self.models.free_memory_mb(),
            loading=sorted(self.models.loading),
        )

    async def publish(self, state: NodeState = NodeState.READY) -> None:
        status = self.status(state)
        await self.kv.put(self.node, wire.encode(status))
        # The ledger hears of changes (models loaded or unloaded, poisoned), not of every refresh.
        degraded = any(m.state != ModelState.READY for m in status.models)
        summary = (NodeState.DEGRADED if degraded and state == NodeState.READY else state,
                   tuple((m.model, m.state) for m in status.models))
        if summary != self._last_summary:
            self._last_summary = summary
            await publish_event(self.js, NodeStatusChanged(
                model=status.models[0].model if status.models else "-", node=self.node, status=summary[0],
                version=status.version, models=[m.model for m in status.models],
                slots=sum(m.slots for m in status.models), free_slots=sum(m.free_slots for m in status.models),
                kv_usage=max((m.kv_usage for m in status.models), default=None),
            ))

    async def refresh(self, connection_lost: Callable[[], Awaitable[bool]]) -> None:
        """Publish every interval, or at once when a model changed state, until `connection_lost()`
        says the bus is gone."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), self.interval_s)
            self.changed.clear()
            if await connection_lost():
                return
            try:
                await self.publish()
            except Exception as exc:  # a missed refresh must never end the loop: the node would vanish
                log.warning("status publish failed", extra={"error": repr(exc)})
