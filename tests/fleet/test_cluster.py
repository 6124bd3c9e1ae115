"""A fleet on a 3-server NATS cluster with replicated streams survives losing a server mid-run."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from apps.embedded import free_port
from apps.embedded.nats_server import NatsCluster
from tests.fleet.conftest import FLEET_ENV
from tests.support import AppProcess

REPLY = "replicated and still here"


def test_losing_one_of_three_servers_loses_no_request(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        port = free_port()
        # The node TTL must outlast a leader election of the registry (seconds on a busy machine).
        env = {**FLEET_ENV, "NATS_URL": cluster.url, "HELEXA_REPLICAS": "3", "HELEXA_PORT": str(port),
               "HELEXA_NODE_TTL_S": "15"}
        script = tmp_path / "script.json"
        script.write_text(json.dumps({"default": REPLY}), encoding="utf-8")
        apps = [AppProcess(["worker", "--script", str(script), "--served-model-name", "ha-model"],
                           {**env, "HELEXA_NODE_ID": f"ha-{i}"}) for i in range(2)]
        apps.append(AppProcess(["gateway"], env))
        try:
            for app in apps:
                app.wait_ready()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=90)
            answered = 0
            lock = threading.Lock()
            tenth_done = threading.Event()

            def one(i: int) -> str:
                nonlocal answered
                try:
                    reply = client.chat.completions.create(
                        model="ha-model", messages=[{"role": "user", "content": f"request {i}"}])
                    outcome = reply.choices[0].message.content or ""
                except openai.APIStatusError as exc:  # a clean failure: a status and an error body
                    assert exc.status_code in (500, 503), exc
                    outcome = f"failed: {exc.body}"
                with lock:
                    answered += 1
                    if answered == 10:
                        tenth_done.set()
                return outcome

            with ThreadPoolExecutor(5) as pool:
                outcomes = pool.map(one, range(50))
                assert tenth_done.wait(120)
                cluster.servers[0].process.kill()  # type: ignore[union-attr]
                results = list(outcomes)
            assert len(results) == 50
            completed = [r for r in results if r == REPLY]
            failed = [r for r in results if r.startswith("failed")]
            assert len(completed) + len(failed) == 50, results
            assert len(completed) >= 10
            # The fleet goes on serving on the two servers left.
            after = client.chat.completions.create(model="ha-model", messages=[{"role": "user", "content": "after"}])
            assert after.choices[0].message.content == REPLY
        except BaseException:
            for app in apps:
                print(app.args, app.output()[-6000:])
            raise
        finally:
            for app in reversed(apps):
                app.stop()
