"""A process armed with `engine.frontend.parent_death.arm` dies with its parent, even a SIGKILLed one: the
worker's engine core, busy loading a model for a minute, must not outlive a killed worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from engine.frontend import parent_death
from tests.support import eventually

# The parent starts a child that arms the signal and then blocks on a pipe nobody writes to (as
# a core busy loading answers nothing), prints the child's pid and waits.
PARENT = textwrap.dedent("""
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c",
        "import os, signal; from engine.frontend import parent_death; "
        "parent_death.arm(signal.SIGKILL, os.getppid()); print('armed', flush=True); "
        "os.read(os.pipe()[0], 1)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "armed"
    print(child.pid, flush=True)
    child.wait()
""")


@pytest.mark.skipif(not parent_death.supported(), reason="the parent-death signal is Linux's")
def test_an_armed_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        eventually(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, timeout_s=10,
                   message="the armed child outlived its killed parent")
    finally:
        parent.kill()
