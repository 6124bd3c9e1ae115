"""A batch's claim on the BATCHES work queue, on a real server with the shortest ack wait an
operator may set (`HELEXA_BATCH_ACK_WAIT_S` 4): a gateway's runner reads the ack wait from the
consumer (with the gateway role's rights) and keeps its claim from every other runner for as long
as it lives; a claim nobody keeps alive goes to the next runner after the ack wait."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import topology
from apps.bus.connection import connect
from apps.embedded.nats_server import NatsServer
from apps.gateway.batch_runner import keep_claim_alive
from tests.support import declared

ACK_WAIT_S = topology.MIN_BATCH_ACK_WAIT_S


async def _claims_taken_past_the_ack_wait(nc: NatsClient, keep_alive: bool) -> int:
    """One claim taken by one runner (kept alive or not); then how many a second runner pulling for
    twice the ack wait gets."""
    await nc.jetstream().publish(topology.BATCH_SUBJECT, b"batch_one")
    first = await topology.batch_puller(nc)
    second = await topology.batch_puller(nc)
    [claim] = await first.fetch(1, timeout=10)
    keeper = asyncio.create_task(keep_claim_alive(nc, claim)) if keep_alive else None
    try:
        taken = await second.fetch(1, timeout=2 * ACK_WAIT_S)
        for late in taken:
            await late.ack()
        return len(taken)
    finally:
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await claim.ack()
        await first.stop()
        await second.stop()


def test_a_runner_reads_the_ack_wait_and_keeps_its_claim_while_it_lives(own_nats: NatsServer) -> None:
    declared(own_nats, topology.BusLimits(batch_ack_wait_s=ACK_WAIT_S))

    async def main() -> None:
        nc = await connect(own_nats.url_for("gateway"), "gateway-test", role="gateway")
        try:
            assert await topology.batch_ack_wait_s(nc) == ACK_WAIT_S
            assert await _claims_taken_past_the_ack_wait(nc, keep_alive=True) == 0
            # The control: the same claim, not kept alive, is the other runner's after the ack wait.
            assert await _claims_taken_past_the_ack_wait(nc, keep_alive=False) == 1
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_batch_ack_wait_below_the_floor_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="batch_ack_wait_s"):
        topology.BusLimits(batch_ack_wait_s=ACK_WAIT_S - 1)
