"""A preemption reaches the ledger: the engine reports it on the request's stream (here a scripted
engine reporting one after the first token, as `engine.core` does when the scheduler preempts), the
worker publishes `run.preempted`, the recorder projects it into `preemptions`, and the answer is
whole. The scheduler's mechanism itself is tested on a real model in tests/engine/test_priority.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import System, scripted_worker
from tests.support import eventually, fetch_rows

PREEMPTED = "preempted-model"
SCRIPT = {"rules": [{"match": "preempt me", "reply": "one two three four", "preempt": "interactive_waiting"}],
          "default": "fine"}



def test_a_preemption_is_a_ledger_row_with_its_reason(system: System, tmp_path: Path) -> None:
    with scripted_worker(system, tmp_path, PREEMPTED, SCRIPT):
        client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.create(
            model=PREEMPTED, messages=[{"role": "user", "content": "preempt me"}], extra_body={"priority": 3})
        assert completion.choices[0].message.content == "one two three four"
        request_id = completion.id

        def recorded() -> list[asyncpg.Record]:
            return asyncio.run(fetch_rows(system.database_url, "SELECT * FROM preemptions WHERE request_id = $1",
                                     request_id))

        (row,) = eventually(recorded, timeout_s=30.0, message="no preemption row in the ledger")
        assert (row["model"], row["node"], row["reason"], row["service_class"], row["tokens_kept"]) == (
            PREEMPTED, f"e2e-{PREEMPTED}", "interactive_waiting", "interactive", 1)
        (run,) = eventually(lambda: asyncio.run(fetch_rows(
            system.database_url, "SELECT status FROM runs WHERE request_id = $1 AND status <> 'running'",
            request_id)), timeout_s=30.0)
        assert run["status"] == "ok"

        def preemptions_metric() -> float:
            text = httpx.get(f"{system.base_url}/metrics", timeout=30).text
            return sum(sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples
                       if sample.name == "helexa:preemptions_total"
                       and sample.labels == {"model": PREEMPTED, "reason": "interactive_waiting"})

        # The worker's node entry carries its engine's counts to the gateway's /metrics.
        assert eventually(preemptions_metric, timeout_s=30.0) == 1

        def pulled_metric() -> dict[str, float]:
            text = httpx.get(f"{system.base_url}/metrics", timeout=30).text
            return {sample.labels["service_class"]: sample.value for family in text_string_to_metric_families(text)
                    for sample in family.samples
                    if sample.name == "helexa:requests_pulled_total" and sample.labels.get("model") == PREEMPTED}

        # And what its intake pulled, by class (this model got one interactive request, no batch line).
        assert eventually(lambda: pulled_metric().get("interactive") == 1, timeout_s=30.0)
        assert pulled_metric().get("batch", 0) == 0
