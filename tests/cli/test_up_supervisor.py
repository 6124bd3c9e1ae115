"""`up`'s supervisor with a real embedded NATS server that cannot come back: its port taken while
it was down, each restart fails, and after `restart_tries` in a row the run ends naming it."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from apps import up
from apps.embedded.nats_server import NatsServer
from tests.support import eventually


def test_an_embedded_server_that_fails_to_start_again_ends_the_run_after_its_tries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "FIRST_BACKOFF_S", 0.05)
    attention, stop = threading.Event(), threading.Event()
    nats = NatsServer(tmp_path / "nats").start()
    server = up.EmbeddedServer("nats", nats, tmp_path / "nats" / "nats-server.log", attention, nice=0)
    try:
        nats.stop()
        assert attention.wait(10)  # its watcher saw the exit
        with socket.socket() as squatter:  # bound, not listening: nats-server cannot bind it
            squatter.bind(("127.0.0.1", nats.port))
            with pytest.raises(up.StartFailed) as caught:
                up.Supervisor([], stop, attention, [server], restart_tries=2).run()
        assert server.restarts == 2 and server.failed_restarts == 2
        assert str(caught.value).startswith("helexa: the nats did not come back after 2 restarts in a row "
                                            "(nats-server exited with 1"), caught.value
        # With the port free again, a supervisor that never gives up brings it back, and the count
        # of failures in a row starts over.
        supervisor = up.Supervisor([], stop, attention, [server], restart_tries=0)
        watcher = threading.Thread(target=supervisor.run, daemon=True)
        watcher.start()
        eventually(lambda: server.alive() and server.failed_restarts == 0, timeout_s=20,
                   message="the server never came back")
        stop.set()
        attention.set()
        watcher.join(10)
        assert not watcher.is_alive()
    finally:
        nats.stop()

