"""A worker on a CPU without oneDNN's bf16 and fp16 paths (a Zen 3, any AVX2-only part; here forced
with HELEXA_TEST_UNSUPPORTED_DTYPES, which the engine core's process reads too): with the default
settings it starts in fp32 without trying bf16, says why in its `ready` line and in /v1/models, and
answers; HELEXA_DTYPE=bfloat16 there ends the start with one line naming the CPU features, and a
model load the engine refuses is a 409 in one line."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from apps.bus.codes import ServingError
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.fleet.catalogue import CatalogueEntry
from apps.settings import WorkerSettings
from apps.worker.model_loop import ModelLoop
from apps.worker.process import EXIT_REFUSED, WorkerProcess
from engine.cpu import cpu_support
from engine.cpu.cpu_support import FORCE_UNSUPPORTED_ENV, UnsupportedDtype
from tests.e2e.conftest import STATUS_INTERVAL_S, System
from tests.support import AppProcess, eventually

NO_BF16 = {FORCE_UNSUPPORTED_ENV: "bfloat16,float16"}
SERVED = "smollm2-no-bf16"


def _served_entry(system: System) -> dict | None:
    models = httpx.get(f"{system.base_url}/v1/models", timeout=10).json()["data"]
    return next((m for m in models if m["id"] == SERVED), None)


def test_a_worker_without_bf16_starts_in_fp32_with_default_settings_and_answers(system: System) -> None:
    # Default settings but for the name it serves under and a small KV pool (HELEXA_DTYPE is the
    # default, auto: the session's other workers run fp32 by the suite's choice).
    env = {**system.env_for("worker"), "HELEXA_NODE_ID": "e2e-no-bf16", "HELEXA_DTYPE": "auto",
           "HELEXA_KV_CACHE_MB": "64", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S), **NO_BF16}
    worker = AppProcess(["worker", "--served-model-name", SERVED], env)
    try:
        ready = worker.wait_ready(timeout_s=600)
        assert ready["dtype"] == "float32"
        assert "bf16 unsupported here" in ready["dtype_reason"] and "fp16 unsupported here" in ready["dtype_reason"]
        events = [line["event"] for line in worker.lines]
        # Chosen without a measurement (which would time bf16), and the choice said at start.
        assert any(event.startswith("dtype float32, not measured: bf16 unsupported here") for event in events)
        assert not any(event.startswith("measuring ") for event in events)
        entry = eventually(lambda: _served_entry(system), 30, message="the model never reached /v1/models")
        assert entry["helexa"]["dtype"] == "float32"
        assert entry["helexa"]["dtype_reason"] == ready["dtype_reason"]
        assert entry["helexa"]["nodes"] == [{"node": "e2e-no-bf16", "dtype": "float32",
                                             "dtype_reason": ready["dtype_reason"], "tensor_parallel": 1}]
        reply = httpx.post(f"{system.base_url}/v1/chat/completions", timeout=120, json={
            "model": SERVED, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        assert worker.process.poll() is None
    finally:
        worker.stop()
    assert "Traceback" not in worker.output()


def test_helexa_dtype_bfloat16_without_bf16_ends_the_start_in_one_line() -> None:
    # Refused in the engine core before anything is built or any server is reached.
    worker = AppProcess(["worker"], {"NATS_URL": "nats://127.0.0.1:1", "HELEXA_DTYPE": "bfloat16", **NO_BF16})
    try:
        returncode = worker.process.wait(timeout=300)
    finally:
        worker.stop()
    output = worker.output()
    assert returncode == EXIT_REFUSED, output
    assert "Traceback" not in output
    errors = [line for line in worker.lines if line["level"] in ("error", "critical")]
    assert len(errors) == 1, output
    message = errors[0]["event"]
    assert "HELEXA_DTYPE=bfloat16" in message and "bf16 unsupported here" in message
    assert cpu_support.needed("bfloat16") in message  # the CPU features oneDNN's bf16 path needs
    # Nothing else was started: no kernel build, no weights, no dtype measurement.
    assert not any(line["event"].startswith(("compiling CPU kernels", "loading weights", "measuring "))
                   for line in worker.lines)


async def test_a_load_the_engine_refuses_is_a_409_in_one_line(own_nats: NatsServer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """`helexa models load` of a model whose engine refuses this worker's configuration (its
    HELEXA_DTYPE on this CPU): a 409 naming why, one log line, no traceback; the worker serves on."""
    refusal = "dtype bfloat16 cannot run on this CPU: bf16 unsupported here (oneDNN: no avx512bw/...)"

    async def opener(source: str, served_name: str, memory_mb: int) -> ModelLoop:
        raise UnsupportedDtype(refusal)

    process = WorkerProcess(WorkerSettings(nats_url=own_nats.url, node_id="refusing", status_interval_s=0.5),
                            BusLimits(), opener, {"m": CatalogueEntry(model="m", source="m.gguf")})
    stop = asyncio.Event()
    running = asyncio.create_task(process.run(stop))
    try:
        await asyncio.wait_for(process.ready.wait(), 30)
        caplog.clear()
        with pytest.raises(ServingError) as refused:
            await process.load("m")
        assert refused.value.status == 409 and refusal in refused.value.message
        records = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert [r.getMessage() for r in records] == [f"model load refused: {refusal}"]
        assert records[0].exc_info is None and process.loading == set() and "m" not in process.models
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
