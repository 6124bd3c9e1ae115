"""Connection death is never silent for the gateway, against a real nats-server and a scripted worker.

nats-py gives up on a connection for good when the server answers `-ERR` (here: a control line
past 4096 bytes, the failure a 4 KB model name once caused). The gateway must notice, report the
outage on /health, and serve again on a new connection. A server that hangs (SIGSTOP) is an
outage too, and one restarted on the same port is ridden out.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from apps.embedded.nats_server import NatsServer
from apps.gateway.app import create_app
from apps.settings import GatewaySettings
from tests.support import AppProcess, eventually_async

MODEL = "outage-model"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def worker(own_nats: NatsServer, tmp_path: Path) -> Iterator[AppProcess]:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [], "default": "still here"}), encoding="utf-8")
    process = AppProcess(["worker", "--script", str(script), "--served-model-name", MODEL],
                         {"NATS_URL": own_nats.url, "HELEXA_NODE_ID": "outage-worker",
                          "HELEXA_STATUS_INTERVAL_S": "0.5"})
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
async def gateway(own_nats: NatsServer, worker: AppProcess) -> AsyncIterator[tuple[AsyncTestClient, object]]:
    settings = GatewaySettings(nats_url=own_nats.url)
    app = create_app(settings)
    # The Host a keyless loopback gateway answers (the test client's own would be a 421).
    async with AsyncTestClient(app=app, base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as http:
        await eventually_async(lambda: _status(http, "/ready", 200), 30)
        yield http, app


async def _status(http: AsyncTestClient, path: str, expected: int) -> bool:
    return (await http.get(path)).status_code == expected


async def _serves(http: AsyncTestClient) -> bool:
    response = await http.post("/v1/chat/completions", json=ASK)
    return response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "still here"


async def test_a_connection_the_server_closed_for_good_is_replaced(gateway: tuple[AsyncTestClient, object]) -> None:
    http, app = gateway
    assert await _serves(http)
    bus = app.state.bus  # type: ignore[attr-defined]
    old = bus.nc
    # What a 4 KB model name once made the gateway send: the server answers -ERR and hangs up.
    await old.publish("x." + "y" * 5000, b"")
    await eventually_async(lambda: _status(http, "/health", 503), 5, interval_s=0.01,
                           message="/health never reported the outage")
    assert old.is_closed
    await eventually_async(lambda: _serves(http), 10, message="the gateway did not serve again within 10 s")
    assert bus.nc is not old and await _status(http, "/health", 200)
    metrics = (await http.get("/metrics")).text
    assert "helexa:gateway_bus_connections_lost_total 1.0" in metrics


async def test_a_hung_server_is_an_outage_and_its_restart_is_ridden_out(
        own_nats: NatsServer, gateway: tuple[AsyncTestClient, object]) -> None:
    http, _ = gateway
    assert await _serves(http)
    process = own_nats.process  # type: ignore[attr-defined]
    process.send_signal(signal.SIGSTOP)
    try:
        await eventually_async(lambda: _status(http, "/health", 503), 10, message="/health ignored a hung server")
    finally:
        process.send_signal(signal.SIGCONT)
    own_nats.stop()
    own_nats.start()
    await eventually_async(lambda: _serves(http), 10, message="the gateway did not serve again within 10 s")
    assert await _status(http, "/health", 200)
