"""`helexa up` sizes the bus to the disk at a data directory's first start, so a small disk still
starts (a real nats-server whose store is that of a small disk), keeps what it chose, and says
what to do when even the smallest bus does not fit; a setting it cannot use is one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.bus import connection
from apps.bus.topology import BusLimits
from apps.embedded.bus_storage import (
    DISK_SHARE,
    SIZED,
    BusStorageRefused,
    size_to_disk,
    storage_limits,
    store_bytes,
)
from apps.embedded.nats_server import NatsServer
from apps.up import StartFailed, _declare_topology
from tests.support import REPO

GIB = 1 << 30
DEFAULTS = {s.variable: s.default for s in SIZED}


def reserved(sizes: dict[str, int]) -> int:
    return sum(sizes[s.variable] * s.copies for s in SIZED)


def test_a_large_disk_keeps_the_defaults_and_a_small_one_scales_them_to_its_share() -> None:
    assert size_to_disk(100 * GIB, {}) == DEFAULTS
    small = size_to_disk(8 * GIB, {})
    assert reserved(small) <= 8 * GIB * DISK_SHARE
    for s in SIZED:
        assert s.floor <= small[s.variable] < s.default
    # A size set by hand is kept, and the others share what it leaves.
    chosen = size_to_disk(8 * GIB, {"HELEXA_FILES_MAX_BYTES": str(GIB)})
    assert "HELEXA_FILES_MAX_BYTES" not in chosen
    assert reserved({**chosen, "HELEXA_FILES_MAX_BYTES": GIB}) <= 8 * GIB * DISK_SHARE


def test_a_disk_too_small_for_the_smallest_bus_is_refused_saying_what_to_do() -> None:
    with pytest.raises(BusStorageRefused) as refused:
        size_to_disk(GIB, {})
    assert "1.00 GiB free" in str(refused.value) and "--data-dir" in str(refused.value)
    # Sizes set by hand are the operator's to judge: the others take their floors beside them.
    chosen = size_to_disk(6 * GIB, {s.variable: str(GIB) for s in SIZED[:2]})  # 4 GiB set, 3 GiB share
    assert chosen == {SIZED[2].variable: SIZED[2].floor}
    assert size_to_disk(10 * GIB, {s.variable: str(2 * GIB) for s in SIZED}) == {}


def test_the_first_starts_choice_is_kept_and_an_older_store_keeps_its_sizes(tmp_path: Path) -> None:
    first = storage_limits(tmp_path / "nats", {}, free_bytes=8 * GIB)
    assert {k: int(v) for k, v in first.items()} == size_to_disk(8 * GIB, {})
    # Later starts reuse it, whatever the disk has free now: no stream shrinks under its events.
    assert storage_limits(tmp_path / "nats", {}, free_bytes=100 * GIB) == first
    assert storage_limits(tmp_path / "nats", {}, free_bytes=GIB) == first
    # A variable set in the environment wins over the record.
    assert "HELEXA_EVENTS_MAX_BYTES" not in storage_limits(tmp_path / "nats", {"HELEXA_EVENTS_MAX_BYTES": "1"})
    # A store made before sizes were chosen keeps the ones its streams have.
    (tmp_path / "old" / "jetstream").mkdir(parents=True)
    assert storage_limits(tmp_path / "old", {}, free_bytes=GIB) == {}
    # A record cut short (a full disk) is refused naming it, not a traceback at every start.
    (tmp_path / "nats" / "bus-storage.json").write_text('{"HELEXA_EVENTS_MAX', encoding="utf-8")
    with pytest.raises(BusStorageRefused) as unreadable:
        storage_limits(tmp_path / "nats", {})
    assert "bus-storage.json cannot be read" in str(unreadable.value) and "delete it" in str(unreadable.value)
    # The store's limit holds what the bus reserves, whatever the disk has free later.
    assert store_bytes({k: str(v) for k, v in first.items()}) >= reserved({k: int(v) for k, v in first.items()})


def test_on_a_small_disks_store_the_defaults_cannot_be_declared_and_the_sized_bus_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = 8 * GIB
    store = int(free * 0.75)  # what JetStream allows by default on a disk with `free` bytes free
    for s in SIZED:
        monkeypatch.delenv(s.variable, raising=False)
    with NatsServer(tmp_path / "defaults", max_file_store=store) as server:
        with pytest.raises(StartFailed) as refused:
            _declare_topology(server.url, embedded=True)
    message = str(refused.value)
    assert "insufficient storage" in message and "HELEXA_EVENTS_MAX_BYTES" in message
    assert "ServerError()" not in message

    # `up`'s first start on that disk: the sizes it chooses are declared, and again at the next start.
    sizes = storage_limits(tmp_path / "sized", os.environ, free_bytes=free)
    for variable, value in sizes.items():
        monkeypatch.setenv(variable, value)
    with NatsServer(tmp_path / "sized", max_file_store=store) as server:
        _declare_topology(server.url, embedded=True)
        asyncio.run(connection.setup(server.url, BusLimits(
            request_max_bytes=int(sizes["HELEXA_REQUESTS_MAX_BYTES"]),
            event_max_bytes=int(sizes["HELEXA_EVENTS_MAX_BYTES"]),
            files_max_bytes=int(sizes["HELEXA_FILES_MAX_BYTES"]))))


def test_a_setting_that_cannot_be_used_is_one_line_naming_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "apps.cli", "up", "--data-dir", str(tmp_path / "up")], cwd=REPO,
                          env={**os.environ, "HELEXA_PORT": "eighty"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "helexa: HELEXA_PORT must be an integer, got 'eighty'"
    assert not (tmp_path / "up" / "nats").exists()  # nothing was started
