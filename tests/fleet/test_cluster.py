"""A fleet on a 3-server NATS cluster with replicated streams survives losing a server mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from apps.bus import connection, declaration, topology
from apps.embedded import free_port
from apps.embedded.nats_server import NatsCluster
from tests.fleet.conftest import FLEET_ENV, bus_setup, role_env
from tests.support import BENCH_AGAINST_NOTHING, REPO, AppProcess

REPLY = "replicated and still here"


def test_losing_one_of_three_servers_loses_no_request(tmp_path: Path) -> None:
    with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        port = free_port()
        # The node TTL must outlast a leader election of the registry (seconds on a busy machine).
        env = {**FLEET_ENV, "HELEXA_REPLICAS": "3", "HELEXA_PORT": str(port), "HELEXA_NODE_TTL_S": "15"}
        bus_setup(cluster, env)
        script = tmp_path / "script.json"
        script.write_text(json.dumps({"default": REPLY}), encoding="utf-8")
        apps = [AppProcess(["worker", "--script", str(script), "--served-model-name", "ha-model"],
                           {**role_env(cluster, env, "worker"), "HELEXA_NODE_ID": f"ha-{i}"}) for i in range(2)]
        apps.append(AppProcess(["gateway"], role_env(cluster, env, "gateway")))
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
            # Every answer whole or cleanly failed: name the others (a truncated or doubled text).
            assert len(completed) + len(failed) == 50, [r for r in results if r != REPLY and not r.startswith("failed")]
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




async def _replicas(nats_url: str) -> dict[str, int]:
    nc = await connection.connect(nats_url, "replica-check")
    try:
        js = nc.jetstream()
        names = (topology.REQUESTS_STREAM, topology.EVENTS_STREAM, f"KV_{topology.NODES_BUCKET}")
        return {name: (await js.stream_info(name)).config.num_replicas for name in names}
    finally:
        await nc.close()


async def _bench_runs_on_events(nats_url: str) -> int:
    nc = await connection.connect(nats_url, "bench-check")
    try:
        info = await nc.jetstream().stream_info(topology.EVENTS_STREAM,
                                                subjects_filter=topology.event_wildcard("bench.run"))
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


def test_a_bench_run_keeps_the_fleets_three_replicas(tmp_path: Path) -> None:
    """`helexa bench run` (as the bench's own NATS user) leaves the fleet's streams as they are."""
    with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        env = {**os.environ, "NATS_URL": cluster.url_for("bench"), "HELEXA_REPLICAS": "1"}

        async def declare_as_the_fleet_does() -> None:
            nc = await connection.connect(cluster.url, "fleet")
            try:
                await declaration.ensure_topology(nc.jetstream(), topology.BusLimits(replicas=3))
            finally:
                await nc.close()

        asyncio.run(declare_as_the_fleet_does())
        assert set(asyncio.run(_replicas(cluster.url)).values()) == {3}

        config = tmp_path / "bench.toml"
        config.write_text(BENCH_AGAINST_NOTHING.format(port=free_port()), encoding="utf-8")
        # The target refuses connections: the run fails fast and is still published as a failed run.
        ran = subprocess.run([sys.executable, "-m", "apps.cli", "bench", "run", str(config)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=180)
        assert ran.returncode == 1, ran.stderr
        assert "cannot publish" not in ran.stderr, ran.stderr
        assert asyncio.run(_bench_runs_on_events(cluster.url)) == 1
        assert asyncio.run(_replicas(cluster.url)) == {
            topology.REQUESTS_STREAM: 3, topology.EVENTS_STREAM: 3, f"KV_{topology.NODES_BUCKET}": 3}
