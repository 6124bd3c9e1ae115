"""Turn a model source into a running engine: at start-up and for control `load` requests.

One function so `helexa worker` and a load from the catalogue build engines the same way; with
`script`, the engine replies from that script (tests) but the tokenizer is still the model's.
The engine core's process logs as the worker does (JSON lines on the same stderr), so the steps of
a start that take long (the CPU kernels' one-time build, a wait on another start's build, the
dtype measurement, the weights) each say so while they run. A core that dies is started again the
same way, with the dtype the first one chose (`apps.worker.restarts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging

from apps import logs
from apps.fleet.catalogue import DEFAULT_SOURCE
from apps.settings import WorkerSettings
from apps.worker.model_loop import ModelLoop
from apps.worker.restarts import RestartBudget, SupervisedEngine
from engine.frontend.core_client import AsyncEngine
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import Engine
from engine.frontend.scripted import ScriptedEngine
from engine.loading.default_model import default_model_path

log = logging.getLogger("helexa.worker")


def resolve_source(source: str) -> str:
    """`default` or empty means the built-in default model."""
    if source in ("", DEFAULT_SOURCE):
        return str(default_model_path())
    return source


async def open_model(settings: WorkerSettings, source: str, served_name: str = "", script: str | None = None,
                     memory_mb: int = 0) -> ModelLoop:
    path = resolve_source(source)
    log.info("loading model", extra={"source": path, "served_name": served_name})
    tokenizer, model_id = await asyncio.to_thread(load_tokenizer, path)
    engine: Engine
    if script:
        engine = ScriptedEngine(script, tokenizer, model_id, max_model_len=settings.max_model_len or 8192,
                                max_num_seqs=settings.max_num_seqs)  # type: ignore[assignment]  # TODO: mypy does not
                                # match the async generator its generate returns to EngineOutputs; it is one at run time
    else:
        engine = await _supervised_core(settings, path)
    return ModelLoop(settings, engine, tokenizer, served_name or model_id, source=source or DEFAULT_SOURCE,
                       memory_mb=memory_mb)


async def _supervised_core(settings: WorkerSettings, path: str) -> SupervisedEngine:
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    setup = functools.partial(logs.configure, level)
    config = settings.engine_config(path)
    first = await AsyncEngine.start(config, setup)
    log.info("engine core started", extra={"source": path, "pid": first.pid})
    if first.info.dtype:
        # A restart runs what the first core chose: no second measurement, the same numbers.
        config = dataclasses.replace(config, dtype=first.info.dtype)

    async def start() -> AsyncEngine:
        return await AsyncEngine.start(config, setup)

    return SupervisedEngine(first, start, RestartBudget(settings.core_restarts, settings.core_restart_window_s))
