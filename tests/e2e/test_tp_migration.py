"""A stream migrated off a tensor-parallel worker mid-answer (issue 41): the tiny random llama is
served under one name by a TP = 3 worker and a TP = 1 worker. The TP = 1 worker is held stopped
(SIGSTOP) while a greedy stream starts, so the TP = 3 worker takes it; at its first text the TP = 3
worker is stopped (the stream not ended), the TP = 1 one let go, and the TP = 3 one SIGKILLed
(its ranks go with it): the stream can only end on the TP = 1 worker, resumed from the tokens the
TP = 3 ranks produced, and it ends whole, with the same text as an uninterrupted TP = 1 answer
(the tiny model's TP = 3 greedy tokens equal TP = 1's: tests/engine/test_tensor_parallel.py).

The source is the TP = 3 worker because it is the slow one: three gloo ranks on the test machine's
cores take seconds over the 1000 tokens, while the test stops the worker within
milliseconds of the first text; the TP = 1 engine, the first version's source, could finish the
whole answer before then on a quiet host."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
from openai import OpenAI

from tests.e2e.conftest import STATUS_INTERVAL_S, System
from tests.engine.test_tensor_parallel import save_tp_llama
from tests.support import AppProcess, eventually

MODEL = "tp-migration"
TOKENS = 1000  # long enough to be running when its worker dies (the output limit is a quarter of 16384)
PROMPT = [5, 40, 100, 7]


def start_worker(system: System, directory: Path, node: str, tensor_parallel: int) -> AppProcess:
    worker = AppProcess(["worker", "--served-model-name", MODEL], {
        **system.env_for("worker"), "HELEXA_NODE_ID": node, "HELEXA_MODEL": str(directory),
        "HELEXA_TENSOR_PARALLEL": str(tensor_parallel), "HELEXA_DTYPE": "float32", "HELEXA_KERNELS": "torch",
        "HELEXA_MAX_NUM_SEQS": "4", "HELEXA_KV_CACHE_MB": "32", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
    worker.wait_ready(300)
    return worker


def serving_nodes(system: System) -> set[str]:
    """The nodes the gateway lists as serving MODEL now."""
    with httpx.Client(base_url=system.base_url, timeout=30) as http:
        for entry in http.get("/v1/models").json()["data"]:
            if entry["id"] == MODEL:
                return {node["node"] for node in entry["helexa"]["nodes"]}
    return set()


def test_a_stream_whose_tp3_worker_dies_resumes_on_a_tp1_worker_with_the_same_text(
        system: System, tmp_path: Path) -> None:
    directory = save_tp_llama(tmp_path / "tiny-tp-llama", max_position_embeddings=16384)
    client = OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    one = start_worker(system, directory, "e2e-tp-mig-1", 1)
    three: AppProcess | None = None
    try:
        eventually(lambda: serving_nodes(system) == {"e2e-tp-mig-1"}, 60)
        reference = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert reference.usage is not None and reference.usage.completion_tokens == TOKENS
        three = start_worker(system, directory, "e2e-tp-mig-3", 3)
        eventually(lambda: serving_nodes(system) == {"e2e-tp-mig-1", "e2e-tp-mig-3"}, 60)
        one.process.send_signal(signal.SIGSTOP)  # it pulls nothing: the stream goes to TP = 3

        first_text, pieces, usage, errors = threading.Event(), [], [], []

        def read() -> None:
            try:
                for chunk in client.completions.create(
                        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                    for choice in chunk.choices:
                        pieces.append(choice.text)
                        if choice.text:
                            first_text.set()
                    if chunk.usage is not None:
                        usage.append(chunk.usage)
            except Exception as exc:  # the assertions below say what went wrong
                errors.append(exc)
                first_text.set()

        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert first_text.wait(300) and not errors, errors
            three.process.send_signal(signal.SIGSTOP)  # it sends no more frames from here
            assert not usage, "the stream ended before its worker was stopped"
            one.process.send_signal(signal.SIGCONT)
            three.process.send_signal(signal.SIGKILL)
        finally:
            one.process.send_signal(signal.SIGCONT)
            reader.join(600)
        assert not errors, errors
        assert usage and usage[-1].completion_tokens == TOKENS, usage
        text, expected = "".join(pieces), reference.choices[0].text
        at = next((i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b),
                  min(len(text), len(expected)))
        assert text == expected, (len(text), len(expected), at, text[at - 20:at + 40], expected[at - 20:at + 40])
        assert three.process.wait(30) == -signal.SIGKILL
    finally:
        one.process.send_signal(signal.SIGCONT)
        if three is not None:
            three.process.send_signal(signal.SIGCONT)
            three.stop()
        one.stop()
