"""A tensor-parallel rank killed under load (issue 41): a worker of its own serves the tiny random
llama at tensor_parallel 3; one follower rank is SIGKILLed while 4 streams run on it. Every stream
gets an error frame or migrates (here to the same worker's restarted core) and finishes; no rank or
core of the dead group is left; the worker serves again through the core-restart path; the ledger's
run rows say the runs were served on 3 ranks."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator

import asyncpg
import httpx
import psutil
import pytest

from tests.e2e.conftest import STATUS_INTERVAL_S, System
from tests.e2e.test_core_restart import core_pid
from tests.engine.test_tensor_parallel import save_tp_llama
from tests.support import AppProcess, eventually, eventually_async
from tests.system import read_chat_stream

NODE = "e2e-tp-death"
TOKENS = 400  # long enough to be running when the rank dies (the output limit is a quarter of 4096)
STREAMS = 4


@pytest.fixture(scope="module")
def tp_worker(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AppProcess, str]]:
    directory = save_tp_llama(tmp_path_factory.mktemp("e2e") / "tiny-tp-llama", max_position_embeddings=4096)
    worker = AppProcess(["worker"], {
        **system.env_for("worker"), "HELEXA_NODE_ID": NODE, "HELEXA_MODEL": str(directory),
        "HELEXA_TENSOR_PARALLEL": "3", "HELEXA_DTYPE": "float32", "HELEXA_KERNELS": "torch",
        "HELEXA_MAX_NUM_SEQS": "4", "HELEXA_KV_CACHE_MB": "8", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
    try:
        ready = worker.wait_ready(300)
        yield worker, ready["model"]
    finally:
        worker.stop()


def stream(system: System, model: str, prompt: list[int], first_text: threading.Event, out: dict) -> None:
    """One streamed completion; its text, how it ended, its usage and any error event."""
    with httpx.Client(base_url=system.base_url, timeout=600) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                out["body"] = response.read().decode()
                first_text.set()  # nothing will come: the assertions below say why
                return
            out.update(read_chat_stream(response, first_text))


async def run_ranks(database_url: str) -> list[int | None]:
    conn = await asyncpg.connect(database_url)
    try:
        return [r["tensor_parallel"] for r in await conn.fetch(
            "SELECT tensor_parallel FROM runs WHERE node = $1 AND status = 'ok'", NODE)]
    finally:
        await conn.close()


def test_a_killed_rank_ends_the_group_and_the_worker_serves_again(
        system: System, tp_worker: tuple[AppProcess, str]) -> None:
    worker, model = tp_worker
    old_core = psutil.Process(core_pid(worker))
    group = [old_core, *(p for p in old_core.children() if "engine.runner.tensor_parallel" in " ".join(p.cmdline()))]
    assert len(group) == 3, group  # the core is rank 0; ranks 1 and 2 are its children

    texts = [threading.Event() for _ in range(STREAMS)]
    outs: list[dict] = [{} for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(system, model, [5 + i, 40, 100, 7], texts[i], outs[i]))
               for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    try:
        for i, first_text in enumerate(texts):
            assert first_text.wait(300) and outs[i].get("status") == 200, f"stream {i}: {outs[i]}"
        os.kill(group[1].pid, signal.SIGKILL)
    finally:
        for thread in threads:
            thread.join(600)

    # Each stream got an error frame, or migrated and finished whole.
    for out in outs:
        assert out["status"] == 200, out
        assert out["errors"] or (out["finish"] == "length" and out["usage"]["completion_tokens"] == TOKENS), out
    # Nothing of the dead group is left (the worker reaps its core; the ranks die with it).
    eventually(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group), 120,
               message=lambda: repr([(p.pid, p.is_running()) for p in group]))
    # The worker's core-restart path starts a new group.
    new_core = eventually(lambda: core_pid(worker) if core_pid(worker) != old_core.pid else None, 120,
                          message=lambda: worker.output(40))
    assert worker.process.poll() is None
    with httpx.Client(base_url=system.base_url, timeout=300) as http:
        again = http.post("/v1/completions", json={"model": model, "prompt": [5, 40, 100, 7], "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 8
    ranks = psutil.Process(new_core).children()
    assert len([p for p in ranks if "engine.runner.tensor_parallel" in " ".join(p.cmdline())]) == 2

    served = asyncio.run(eventually_async(lambda: run_ranks(system.database_url), 30,
                                          message=lambda: system.recorder.output()))
    assert served and set(served) == {3}, served
