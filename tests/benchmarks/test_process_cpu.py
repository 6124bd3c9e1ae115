"""CPU accounting by role (benchmarks/process_cpu.py) over a real process tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from benchmarks.process_cpu import CLIENT, ProcessCPU, helexa_role

# On "go", a parent starts a child; the child spends 200 ms of CPU, the parent 50 ms, and once both
# are done the parent says so and both wait (alive, their time kept) to be stopped.
TREE = """
import subprocess, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
if sys.argv[1] == "parent":
    sys.stdin.readline()
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child"], stdout=subprocess.PIPE, text=True)
    burn(0.05)
    child.stdout.readline()
    print("done", flush=True)
else:
    burn(0.2)
    print("done", flush=True)
time.sleep(600)
"""


def role(cmdline: list[str]) -> str:
    return next((part for part in cmdline if part in ("parent", "child")), "other")


def test_each_role_gets_the_cpu_its_processes_spent_and_the_client_its_own() -> None:
    parent = subprocess.Popen([sys.executable, "-c", TREE, "parent", TREE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        cpu = ProcessCPU(parent.pid, role)
        with cpu:
            parent.stdin.write("go\n")
            parent.stdin.flush()
            assert parent.stdout.readline() == "done\n"
            end = time.process_time() + 0.1  # the client's own share
            while time.process_time() < end:
                pass
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait()
    assert cpu.ms["parent"] >= 50
    assert cpu.ms["child"] >= 200  # a process started inside the window counts whole
    assert cpu.ms[CLIENT] >= 100
    per_request = cpu.per_request(2)
    assert per_request["server_total"] == round((cpu.ms["parent"] + cpu.ms["child"] + cpu.ms["other"]) / 2, 3)


def test_helexa_roles_come_from_command_lines() -> None:
    python = "/venv/bin/python"
    assert helexa_role([python, "-m", "apps.cli", "gateway"]) == "gateway"
    assert helexa_role([python, "-m", "apps.cli", "up", "--port", "8000"]) == "supervisor"
    assert helexa_role([python, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                        "--multiprocessing-fork"]) == "engine"
    assert helexa_role(["/x/bin/nats-server", "--config", "c.conf"]) == "nats"
    assert helexa_role(["postgres: helexa helexa 127.0.0.1(5432) idle"]) == "postgres"
