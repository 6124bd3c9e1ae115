"""A hybrid (Qwen3-Next) model served end to end: a tiny random-weight HF dir with a tokenizer and
chat template, a real worker process, the gateway, the OpenAI SDK. Streaming matches the whole
response, and a sequence's linear-attention state slot comes back on finish and on cancellation,
as the node registry reports through the gateway's metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import System
from tests.e2e.test_cancel import stream_until_first_text
from tests.e2e.test_chat import finished_run
from tests.engine.hybrid_models import save_hybrid_dir
from tests.support import AppProcess, eventually


@pytest.fixture(scope="module")
def hybrid_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = save_hybrid_dir(transformers, "qwen3_next", tmp_path_factory.mktemp("e2e") / "tiny-qwen3-next",
                                max_position_embeddings=8192)  # output limit 2048: room for LONG
    worker = AppProcess(["worker"], {
        **system.env_for("worker"), "HELEXA_NODE_ID": "e2e-hybrid", "HELEXA_MODEL": str(directory),
        "HELEXA_MAX_NUM_SEQS": "4", "HELEXA_KV_CACHE_MB": "8", "HELEXA_STATUS_INTERVAL_S": "0.2"})
    try:
        ready = worker.wait_ready()
        assert ready["model"] == directory.name
        yield directory.name
    finally:
        worker.stop()


def engine_gauges(system: System, model: str) -> dict[str, float]:
    text = httpx.get(f"{system.base_url}/metrics", timeout=30).text
    wanted = {"helexa:num_requests_running", "helexa:state_slots_in_use"}
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted and s.labels.get("model") == model}


def wait_for_gauges(system: System, model: str, expected: dict[str, float], timeout_s: float = 30.0) -> None:
    """Until the worker's next status refreshes reach the gateway with the expected values."""
    eventually(lambda: engine_gauges(system, model) == expected, timeout_s,
               message=lambda: repr(engine_gauges(system, model)))


# Random weights emit byte tokens often, so some answers end inside a character: each of these
# prompts exercises the end of a choice once more (the tail the detokenizer holds back).
_PROMPTS = ["Pack my box with five dozen jugs.", "日本語で答えて", "🙂🙃", "How vexingly quick daft zebras jump",
            "Ünïcödé?", "1 2 3 4", "Sphinx of black quartz, judge my vow", "写一首诗"]


@pytest.mark.parametrize("prompt", _PROMPTS)
def test_streaming_matches_the_whole_response(system: System, hybrid_model: str, prompt: str) -> None:
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=hybrid_model, messages=messages, max_tokens=12,
                                           temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    text, finish = "", None
    for chunk in client.chat.completions.create(model=hybrid_model, messages=messages, max_tokens=12,
                                                temperature=0, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert (text, finish) == (whole.choices[0].message.content, "length")
    assert text
    wait_for_gauges(system, hybrid_model, {"helexa:num_requests_running": 0, "helexa:state_slots_in_use": 0})


def test_state_slots_come_back_on_finish_and_on_cancel(system: System, hybrid_model: str) -> None:
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused")

    def while_streaming() -> None:
        # The long stream holds one slot; a second stream takes another and gives it back on finish.
        wait_for_gauges(system, hybrid_model, {"helexa:num_requests_running": 1, "helexa:state_slots_in_use": 1})
        finish = None
        second = client.chat.completions.create(
            model=hybrid_model, messages=[{"role": "user", "content": "hi"}], max_tokens=100,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in second:
            if chunk.choices and chunk.choices[0].delta.content and finish is None:
                finish = "streaming"
                wait_for_gauges(system, hybrid_model,
                                {"helexa:num_requests_running": 2, "helexa:state_slots_in_use": 2})
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "length"
        wait_for_gauges(system, hybrid_model, {"helexa:num_requests_running": 1, "helexa:state_slots_in_use": 1})

    request_id = stream_until_first_text(system.base_url, hybrid_model, while_streaming)
    row = asyncio.run(finished_run(system, request_id))
    assert (row["status"], row["finish_reason"]) == ("cancelled", "abort")
    wait_for_gauges(system, hybrid_model, {"helexa:num_requests_running": 0, "helexa:state_slots_in_use": 0})
