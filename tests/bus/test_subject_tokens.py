"""No subject is built from a token longer than the bus module allows (nats-server closes a
connection whose control line passes 4096 bytes, and nats-py never reconnects after that)."""

from __future__ import annotations

import pytest

from apps.bus import topology


@pytest.mark.parametrize("build", [topology.request_subject, topology.cancel_subject, topology.worker_consumer,
                                   lambda name: topology.event_subject("admission", name),
                                   lambda name: topology.node_endpoint(name, "control")],
                         ids=["request", "cancel", "consumer", "event", "node-endpoint"])
def test_a_token_past_the_bound_is_refused(build) -> None:
    with pytest.raises(topology.TokenTooLong):
        build("m" * (topology.MAX_TOKEN_BYTES + 1))
    # Escaping counts: 400 dots are 1200 bytes once each is written as `~2e`.
    with pytest.raises(topology.TokenTooLong):
        build("." * 400)


def test_the_longest_allowed_token_is_built_and_reads_back() -> None:
    name = "." * (topology.MAX_TOKEN_BYTES // 3)
    subject = topology.cancel_subject(name)
    assert len(subject.rsplit(".", 1)[-1]) <= topology.MAX_TOKEN_BYTES
    assert topology.request_id_from_cancel(subject) == name
    assert topology.model_token("a" * topology.MAX_TOKEN_BYTES) == "a" * topology.MAX_TOKEN_BYTES
