"""The CPU kernels' first build, as a start meets it: a lock the kernel drops when its holder dies,
one build per environment, and a cold worker start that says each long step before it is ready.

The lock is tested on its own with real processes. The builds are real (tens of seconds to
minutes each), so the module makes as few as the claims need, in one cache of its own: the cold
worker start builds the suite's environment, a second environment (a venv beside it) builds once
after a build of its own was killed, and then each loads the other's neighbour from the cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.embedded.nats_server import NatsServer
from engine.cpu.dtype_choice import supported_candidates
from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.build_lock import Holder, build_lock
from tests.support import REPO, AppProcess, eventually

# Holds the lock at argv[1] until its stdin closes (or it is killed), saying "held" once it does.
HOLD = """
import sys
from pathlib import Path
from helexa_kernels.build_lock import build_lock
with build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""

WAITING = "waiting for the CPU kernel build lock held by "
COMPILING = "compiling CPU kernels (one-time, ~"
BUILT = "CPU kernels built in "
FROM_CACHE = "CPU kernels loaded from cache"


def _holder(path: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def _take_in_thread(path: Path) -> tuple[threading.Thread, list[Holder], threading.Event, threading.Event]:
    waited: list[Holder] = []
    waiting, taken = threading.Event(), threading.Event()

    def on_wait(holder: Holder) -> None:
        waited.append(holder)
        waiting.set()

    def take() -> None:
        with build_lock(path, on_wait=on_wait):
            taken.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, waited, waiting, taken


def test_a_waiter_names_the_holder_and_takes_the_lock_once_the_holder_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "build.lock"
    holder = _holder(path)
    thread, waited, waiting, taken = _take_in_thread(path)
    try:
        assert waiting.wait(30), "the waiter never said it waits"
        assert waited[0].pid == holder.pid and waited[0].describe().startswith(f"pid {holder.pid} since ")
        assert not taken.is_set()  # the holder is alive: nobody else has it
        holder.send_signal(signal.SIGKILL)  # killed mid-build: no code of its own runs again
        holder.wait()
        assert taken.wait(30), "the lock of a killed holder was not released"
        thread.join(30)
    finally:
        holder.kill()
        holder.wait()


def test_a_free_lock_is_taken_without_waiting_and_names_no_holder_once_released(tmp_path: Path) -> None:
    path = tmp_path / "build.lock"
    holder = _holder(path)
    assert holder.stdin is not None
    holder.stdin.close()  # ends its block: the lock is released in order
    holder.wait(30)
    thread, waited, _, taken = _take_in_thread(path)
    assert taken.wait(30) and waited == []
    thread.join(30)


# -- real builds ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """XDG_CACHE_HOME for this module's starts: nothing built there yet."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def second_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The interpreter of a second environment: a venv of its own (its own sys.prefix) that finds
    this one's packages through a .pth file, as a second checkout's venv would have them."""
    folder = tmp_path_factory.mktemp("venv-b")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "helexa-test-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(python)


def _build_directory(python: str, cache: Path) -> Path:
    script = "from helexa_kernels.cpu import build_directory; print(build_directory())"
    out = subprocess.run([python, "-c", script], cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                         check=True, capture_output=True, text=True).stdout
    return Path(out.strip())


def _start(python: str, cache: Path) -> subprocess.Popen[str]:
    """`python -m helexa_kernels.cpu` (what `make setup` runs): build or load, one line a step."""
    return subprocess.Popen([python, "-m", "helexa_kernels.cpu"], cwd=REPO, text=True, start_new_session=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _run(python: str, cache: Path) -> list[str]:
    process = _start(python, cache)
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out
    return out.splitlines()


def _index(lines: list[str], prefix: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


@pytest.fixture
def worker_env(nats_server: NatsServer, kernel_cache: Path) -> Iterator[dict[str, str]]:
    yield {"XDG_CACHE_HOME": str(kernel_cache), "NATS_URL": nats_server.url, "HELEXA_NODE_ID": "cold-start",
           "HELEXA_DTYPE": "auto", "HELEXA_KV_CACHE_MB": "64"}


def test_a_cold_start_says_each_long_step_before_it_is_ready(worker_env: dict[str, str], kernel_cache: Path) -> None:
    """Nothing built, the build lock held by another process (this test), no dtype measured yet: the
    worker says it waits (and on whom), that it compiles (and roughly how long), that it measures
    the dtypes (where the CPU runs more than fp32) and that it loads the weights, before `ready`."""
    directory = _build_directory(sys.executable, kernel_cache)
    assert not (directory / cpu_kernels.BUILT_MARKER).exists()
    with build_lock(directory / cpu_kernels.LOCK_FILE):
        worker = AppProcess(["worker"], worker_env)
        try:
            waiting = worker.wait_for(lambda e: e["event"].startswith(WAITING), timeout_s=300)
        except BaseException:
            worker.kill()
            raise
        assert waiting["event"].startswith(f"{WAITING}pid {os.getpid()} since ")
    try:
        ready = worker.wait_ready(timeout_s=1200)
        events = [line["event"] for line in worker.lines]
        measured = len(supported_candidates()) > 1
        steps = ["loading model", WAITING, COMPILING, BUILT,
                 "measuring float32 vs " if measured else "dtype float32, not measured",
                 "loading weights (", "weights loaded in ", "ready"]
        indices = [_index(events, step) for step in steps]
        assert indices == sorted(indices), events
        assert re.match(r"compiling CPU kernels \(one-time, ~\d+ s-\d+ min\)", events[indices[2]])  # rough time
        assert ready["dtype"] in supported_candidates() and ready["dtype_reason"]
        assert sum(event.startswith(COMPILING) for event in events) == 1
    finally:
        worker.stop()


def test_two_environments_build_once_each_and_a_killed_build_delays_no_one(second_python: str,
                                                                            kernel_cache: Path) -> None:
    first = _build_directory(sys.executable, kernel_cache)
    second = _build_directory(second_python, kernel_cache)
    assert first != second  # another sys.prefix: another build
    if not (first / cpu_kernels.BUILT_MARKER).exists():  # the cold start above built it, when it ran
        assert any(line.startswith(BUILT) for line in _run(sys.executable, kernel_cache))

    # A start in the second environment killed while it compiles (torch's baton taken, compilers
    # running); its compilers are left running, as when only the start itself is killed.
    killed = _start(second_python, kernel_cache)
    try:
        assert killed.stdout is not None
        assert killed.stdout.readline().startswith(COMPILING)
        eventually(lambda: any(second.glob(f"{cpu_kernels.WORK_PREFIX}*/lock")), 120,
                   message="the build never took torch's baton")
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        # The next start builds at once: it waits on no one.
        lines = _run(second_python, kernel_cache)
    finally:
        try:
            os.killpg(killed.pid, signal.SIGKILL)  # the killed start's orphaned compilers
        except ProcessLookupError:
            pass
    assert not any(line.startswith(WAITING) for line in lines), lines
    assert lines[_index(lines, "removing what a killed build left")] and _index(lines, COMPILING) < _index(lines, BUILT)

    # Built once each: from now on either environment loads its own, whichever ran last.
    for python in (sys.executable, second_python, sys.executable):
        lines = _run(python, kernel_cache)
        assert [line for line in lines if line.startswith(FROM_CACHE)], lines
        assert not any(line.startswith(COMPILING) for line in lines), lines
