"""What `helexa up` keeps beside its servers: the one-instance lock, the env file, stable ports, and
children that die with it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from apps.embedded import stable_port
from apps.embedded.data_dir import AlreadyRunning, UpLock, live_pid, read_env, write_env
from tests.support import REPO, eventually

HOLD_LOCK = """
import sys, time
from pathlib import Path
from apps.embedded.data_dir import UpLock
UpLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding `tmp_path`'s lock, as a running `helexa up` does."""
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None and process.stdout.readline() == "locked\n"
    yield process
    process.kill()
    process.wait()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_second_lock_names_the_holder_and_is_free_once_it_dies(tmp_path: Path,
                                                                 holder: subprocess.Popen[str]) -> None:
    assert live_pid(tmp_path) == holder.pid
    with pytest.raises(AlreadyRunning) as refused:
        UpLock(tmp_path).acquire(wait_s=0.2)
    assert refused.value.pid == holder.pid
    assert f"(pid {holder.pid}); stop it or use another --data-dir" in str(refused.value)
    holder.kill()  # no cleanup at all: the kernel releases the lock
    holder.wait()
    assert live_pid(tmp_path) is None
    lock = UpLock(tmp_path)
    lock.acquire(wait_s=0)
    assert live_pid(tmp_path) == os.getpid()
    lock.release()
    assert live_pid(tmp_path) is None


def test_no_lock_file_or_a_stale_one_means_no_live_up(tmp_path: Path) -> None:
    assert live_pid(tmp_path) is None
    (tmp_path / "up.lock").write_text("12345\n")  # left by an `up` that died
    assert live_pid(tmp_path) is None


def test_the_env_file_is_private_and_sources_in_a_shell(tmp_path: Path) -> None:
    values = {"NATS_URL": "nats://helexa:p-w_d@127.0.0.1:4223", "DATABASE_URL": "postgresql://u:x@127.0.0.1:5/db",
              "HELEXA_URL": "http://127.0.0.1:8000"}
    path = write_env(tmp_path, values)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_env(tmp_path) == values
    shell = subprocess.run(["bash", "-c", f"source {path} && echo $NATS_URL $DATABASE_URL $HELEXA_URL"],
                           capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    assert shell.stdout.split() == list(values.values())


def test_a_server_keeps_its_port_until_another_process_takes_it(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    first = stable_port(tmp_path, "nats")
    assert stable_port(tmp_path, "nats") == first
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        with caplog.at_level(logging.WARNING, logger="helexa.embedded"):
            moved = stable_port(tmp_path, "nats")
    assert moved != first
    (record,) = [r for r in caplog.records if r.name == "helexa.embedded"]
    assert (record.server, record.old_port, record.port) == ("nats", first, moved)  # type: ignore[attr-defined]
    assert stable_port(tmp_path, "nats") == moved


PARENT = """
import signal, subprocess, sys
from apps.embedded.tether import dies_with_us
child = subprocess.Popen(["sleep", "600"], process_group=0, preexec_fn=dies_with_us(signal.SIGTERM))
print(child.pid, flush=True)
child.wait()
"""


def test_a_tethered_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert not _gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        eventually(lambda: _gone(child), timeout_s=5, message=f"sleep {child} outlived its parent")
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
