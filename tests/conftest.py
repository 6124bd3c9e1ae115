"""Shared fixtures: a real NATS server and a real PostgreSQL, each from its wheel, on free ports;
and the `gpu` marker's auto-skip (`pytest -m gpu` selects every test that needs a CUDA device).

The NATS servers come as `helexa up` leaves its own: locked, with a user per role
(`server.url_for(role)`; `server.url` is the administrator's) and the topology declared, so apps
started on them run with their own role's permissions, as they do in production."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from tests.support import declared
from tests.system import system  # noqa: F401  (the whole system, one per session for e2e and compat tests)

# Workers the tests start compare their text with fp32 references (transformers, earlier runs):
# they run fp32 unless a test asks otherwise. The measured choice has its own tests.
os.environ.setdefault("HELEXA_DTYPE", "float32")
# What the apps the tests start keep on disk (events EVENTS has not taken yet) goes to a folder of
# this session's, not the checkout's `.helexa` of `make run`.
os.environ.setdefault("HELEXA_DATA_DIR", tempfile.mkdtemp(prefix="helexa-tests-"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before triton
# is first imported: here, because test modules of other folders (engine ops, attention) import
# the kernels at collection, before tests/kernels is reached. Nothing launches a Triton kernel on
# CPU unless a test asks for it, so the other tests behave the same with or without it.
if "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    import torch  # only when GPU tests were collected: most test runs never need torch here

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_tests:
        item.add_marker(skip)


# The session bus's limits: the defaults, but a batch held by a gateway a test kills goes to
# another gateway 15 s after (not 60), as an operator may set with HELEXA_BATCH_ACK_WAIT_S.
SESSION_BUS = BusLimits(batch_ack_wait_s=15.0)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        declared(server, SESSION_BUS)
        yield server


def _postgres_dir() -> Path:
    # Not under pytest's tmp: pytest resets its root to 0700 at every session start, which
    # would lock out the unprivileged user PostgreSQL runs as when tests run as root.
    return Path(tempfile.mkdtemp(prefix="helexa-pg-"))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    folder = _postgres_dir()
    try:
        with PostgresServer(folder) as server:
            yield server
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server for one test, for tests that need an empty bus (the topology declared)."""
    with NatsServer(tmp_path / "nats") as server:
        declared(server)
        yield server


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL for one test, not yet started; the test may stop and start it again."""
    folder = _postgres_dir()
    server = PostgresServer(folder)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
