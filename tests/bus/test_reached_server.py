"""`connection.reached_server` is a barrier a second connection can rely on: once it returns, a subscription
made just before is at the server, so a request another connection sends at once is answered (a
missing subscription would be answered `no responders` by the server itself)."""

from __future__ import annotations

from pathlib import Path

from nats.aio.msg import Msg

from apps.bus import connection
from apps.embedded.nats_server import NatsServer

ROUNDS = 50


async def test_a_subscription_is_at_the_server_once_reached_server_returns(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        responder = await connection.connect(server.url, "barrier-responder", max_reconnect_attempts=0)
        requester = await connection.connect(server.url, "barrier-requester", max_reconnect_attempts=0)
        try:
            async def echo(msg: Msg) -> None:
                await msg.respond(msg.data)

            for round_ in range(ROUNDS):
                subject = f"barrier.{round_}"
                await responder.subscribe(subject, cb=echo)
                await connection.reached_server(responder)
                # NoRespondersError here means the SUB was still on its way.
                reply = await requester.request(subject, str(round_).encode(), timeout=10)
                assert reply.data == str(round_).encode()
        finally:
            await requester.close()
            await responder.close()
