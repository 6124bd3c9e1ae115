"""Ask the fleet's workers to list, load and unload models (their micro-service `control` endpoint).

Used by `helexa models`, by gateways for cold starts, and by the bench. Which worker loads a
model is chosen here from the node registry: a live worker with enough free memory for the
model's catalogue entry, the one with the most free memory first.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyNotFoundError

from apps.bus import topology, wire
from apps.bus.codes import ModelState, NodeState
from apps.fleet.catalogue import CatalogueEntry, load_catalogue
from apps.settings import bus_limits, catalogue_file


class ControlFailed(Exception):
    """No worker could do what was asked; the message says why."""


async def live_nodes(nc: NatsClient) -> list[wire.NodeStatus]:
    js = nc.jetstream()
    kv = await topology.node_registry(js, bus_limits())
    # The keys as the server holds them, from the bucket's stream: nats-py's `kv.keys()` builds the
    # list through a watcher and came back empty once while a worker was rewriting its entry.
    prefix = f"$KV.{topology.NODES_BUCKET}."
    info = await js.stream_info(f"KV_{topology.NODES_BUCKET}", subjects_filter=f"{prefix}>")
    keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
    # Read directly, an entry older than the bucket's TTL is already gone (expired by the server).
    nodes = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        if entry.value:
            try:
                node = wire.node_decoder.decode(entry.value)
            except msgspec.DecodeError:  # a worker of another version (a rolling upgrade): not a candidate
                continue
            if node.status != NodeState.STOPPING:
                nodes.append(node)
    return nodes


async def _control(nc: NatsClient, node: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    try:
        msg = await nc.request(topology.node_endpoint(node, "control"), json.dumps(body).encode(), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise ControlFailed(f"the worker {node} is gone") from None
    except TimeoutError:
        raise ControlFailed(f"the worker {node} did not answer within {timeout_s:g} s") from None
    try:
        answer = json.loads(msg.data)
    except ValueError:
        raise ControlFailed(f"the worker {node} answered what is not JSON ({len(msg.data)} bytes)") from None
    if not isinstance(answer, dict):
        raise ControlFailed(f"the worker {node} answered JSON that is not an object")
    return answer


async def list_models(nc: NatsClient) -> dict[str, Any]:
    """Every live worker's models with their state (ready / poisoned) and what is loading."""
    nodes = await live_nodes(nc)
    return {
        "nodes": [
            {"node": n.node, "free_memory_mb": n.free_memory_mb, "loading": n.loading,
             "models": [{"model": m.model, "state": m.state, "detail": m.detail, "free_slots": m.free_slots,
                         "slots": m.slots} for m in n.models]}
            for n in sorted(nodes, key=lambda n: n.node)
        ],
        "models": sorted({m.model for n in nodes for m in n.models}),
    }


def choose_node(nodes: list[wire.NodeStatus], model: str, entry: CatalogueEntry | None) -> wire.NodeStatus | None:
    """The worker to load `model`: one that has it poisoned (a reload), else the most free memory."""
    for node in nodes:
        if any(m.model == model and m.state == ModelState.POISONED for m in node.models):
            return node
    need = entry.min_memory_mb if entry else 0
    capable = [n for n in nodes if n.status == NodeState.READY and n.free_memory_mb >= need
               and not any(m.model == model for m in n.models)]
    return max(capable, key=lambda n: n.free_memory_mb, default=None)


async def load_model(nc: NatsClient, model: str, *, timeout_s: float,
                     catalogue: dict[str, CatalogueEntry] | None = None) -> dict[str, Any]:
    """Have one capable worker load `model` (or reload it where it is poisoned); returns its reply."""
    catalogue = load_catalogue(catalogue_file()) if catalogue is None else catalogue
    nodes = await live_nodes(nc)
    if any(m.model == model and m.state == ModelState.READY for n in nodes for m in n.models):
        serving = [n.node for n in nodes if any(m.model == model and m.state == ModelState.READY for m in n.models)]
        return {"ok": True, "model": model, "nodes": serving, "already": True}
    node = choose_node(nodes, model, catalogue.get(model))
    if node is None:
        raise ControlFailed(f"no live worker can load '{model}' (free memory or no workers)")
    reply = await _control(nc, node.node, {"op": "load", "model": model}, timeout_s)
    if not reply.get("ok"):
        raise ControlFailed(reply.get("error") or f"the worker {node.node} refused to load '{model}'")
    return {"ok": True, "model": model, "nodes": [node.node]}


async def unload_model(nc: NatsClient, model: str, *, timeout_s: float) -> dict[str, Any]:
    """Unload `model` from every live worker that has it; returns which did."""
    holders = [n.node for n in await live_nodes(nc) if any(m.model == model for m in n.models)]
    if not holders:
        raise ControlFailed(f"no live worker has '{model}' loaded")
    failures = []
    for node in holders:
        reply = await _control(nc, node, {"op": "unload", "model": model}, timeout_s)
        if not reply.get("ok"):
            failures.append(f"{node}: {reply.get('error')}")
    if failures:
        raise ControlFailed("; ".join(failures))
    return {"ok": True, "model": model, "nodes": holders}
