"""`helexa up` with the default model: its env file's URLs reach its locked servers, the CLI finds
it through that file (`helexa models ls`, `helexa bus sub`), a killed child comes back, and it
stops cleanly. (Starts, stops and failures with a scripted worker: `test_up_lifecycle.py`.)

One `helexa up` serves the whole module; the last test stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import nats
import openai
import psutil
import pytest

from apps.bus import topology
from apps.bus.events import RunFinished, decode_events
from apps.embedded import free_port
from apps.embedded.data_dir import read_env
from tests.support import AppProcess, eventually, eventually_async


@dataclass
class Up:
    process: AppProcess
    data: Path
    ready: dict
    banner: str

    def env_value(self, name: str) -> str:
        """A variable of the env file the banner points to (`source <data>/env`)."""
        assert f"source {self.data / 'env'}" in self.banner, self.banner
        return read_env(self.data)[name]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.ready['url']}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(self, content: str) -> str:
        reply = self.client().chat.completions.create(
            model=self.ready["model"], messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)
        return reply.choices[0].finish_reason


def processes_using(folder: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(folder) in cmdline:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    data = Path(tempfile.mkdtemp(prefix="helexa-up-")) / "data"
    port = free_port()
    process = AppProcess(["up", "--data-dir", str(data), "--port", str(port)], {"NATS_URL": "", "DATABASE_URL": ""})
    try:
        ready = process.wait_for(lambda e: e.get("event") == "ready" and e.get("app") == "up", timeout_s=300)
        # The banner is printed just before this line: it is among the last lines of output.
        yield Up(process, data, ready, process.output())
    finally:
        process.kill()
        shutil.rmtree(data.parent, ignore_errors=True)


async def _refused_by_nats(url: str) -> None:
    async def quiet(exc: Exception) -> None:
        pass

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, error_cb=quiet)


def test_the_env_file_urls_work_and_nothing_else_gets_in(up: Up) -> None:
    nats_url, database_url = up.env_value("NATS_URL"), up.env_value("DATABASE_URL")
    assert up.env_value("HELEXA_URL") == up.ready["url"]
    assert stat.S_IMODE((up.data / "env").stat().st_mode) == 0o600
    # The banner points to the file rather than printing passwords, and its example is bounded.
    assert nats_url not in up.banner and database_url not in up.banner
    assert '"temperature": 0, "max_tokens": 64' in up.banner
    nats_port = re.search(r":(\d+)$", nats_url).group(1)  # type: ignore[union-attr]
    pg_port = re.search(r":(\d+)/", database_url).group(1)  # type: ignore[union-attr]

    async def check() -> None:
        # The printed URLs, exactly as printed, in the two clients operators use from Python.
        nc = await nats.connect(nats_url)
        conn = await asyncpg.connect(database_url)
        try:
            sub = await nc.subscribe(topology.every_subject())
            assert await asyncio.to_thread(up.ask, "Say hi.") in ("stop", "length")
            while True:  # the run's events pass by on the bus
                msg = await sub.next_msg(timeout=60)
                if topology.kind_of_subject(msg.subject) == "run.finished":
                    assert all(isinstance(e, RunFinished) for e in decode_events(msg.data))
                    break
            assert await conn.fetchval("SELECT count(*) FROM schema_migrations") >= 3
        finally:
            await conn.close()
            await nc.close()
        await _refused_by_nats(f"nats://127.0.0.1:{nats_port}")
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{pg_port}/postgres", timeout=10)

    asyncio.run(check())
    files = re.findall(r"credentials \(readable only by you\): (\S+)", up.banner)
    assert sorted(Path(f).parent.name for f in files) == ["nats", "postgres"]
    assert all(stat.S_IMODE(Path(f).stat().st_mode) == 0o600 for f in files)


def test_cli_commands_find_the_running_up_through_its_env_file(up: Up) -> None:
    """Nothing exported: `helexa models ls` reads NATS_URL from the data directory's env file."""
    listing = AppProcess(["--data-dir", str(up.data), "models", "ls"], {"NATS_URL": "", "DATABASE_URL": ""})
    assert listing.process.wait(30) == 0
    listing.stop()
    (answer,) = [e for e in listing.lines if "models" in e]
    assert answer["models"] == [up.ready["model"]]


def _run_events(output: str, request_id: str) -> dict[str, dict]:
    """The run.started and run.finished bodies of `request_id` among `helexa bus sub` lines
    (subject, headers as JSON when there are any, body)."""
    found = {}
    for line in output.splitlines():
        subject, _, rest = line.partition(" ")
        kind = topology.kind_of_subject(subject)
        if kind not in ("run.started", "run.finished"):
            continue
        decoder = json.JSONDecoder()
        first, end = decoder.raw_decode(rest)
        body = decoder.raw_decode(rest[end:].lstrip())[0] if rest[end:].strip() else first
        if body.get("request_id") == request_id:
            found[kind] = body
    return found


def test_bus_sub_prints_the_run_events_of_a_request(up: Up) -> None:
    watcher = AppProcess(["--data-dir", str(up.data), "bus", "sub"], {"NATS_URL": ""})
    try:
        eventually(lambda: "watching helexa.> on 127.0.0.1:" in watcher.output(), timeout_s=30,
                   message=watcher.output)
        reply = up.client().chat.completions.create(
            model=up.ready["model"], messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
        found = eventually(lambda: len(_run_events(watcher.output(last=100_000), reply.id)) == 2,
                           timeout_s=30, message=watcher.output)
        assert found
        assert _run_events(watcher.output(last=100_000), reply.id)["run.finished"]["status"] == "ok"
    finally:
        watcher.stop(signal.SIGINT)
    assert watcher.process.returncode == 0
    assert "Traceback" not in watcher.output(last=100_000)


def _child(up: Up, app: str) -> psutil.Process:
    found = []
    for child in psutil.Process(up.process.process.pid).children():
        try:
            if child.cmdline()[-2:] == ["apps.cli", app]:
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # a child that has just exited and is not reaped yet has no command line
    (only,) = found
    return only


def test_a_child_killed_with_sigkill_comes_back_and_the_system_serves_again(up: Up) -> None:
    before = {app: [e for e in up.process.lines if e.get("event") == "ready" and e.get("app") == app]
              for app in ("gateway", "recorder")}
    # Both found before either is killed: a killed child is a zombie until `helexa up` reaps it.
    children = [_child(up, app) for app in ("gateway", "recorder")]
    for child in children:
        child.kill()
    for app in ("gateway", "recorder"):
        exited = up.process.wait_for(
            lambda e, a=app: e.get("event") == "child exited, restarting" and e.get("app") == a)
        assert exited["returncode"] == -signal.SIGKILL and exited["restart_in_s"] > 0
        up.process.wait_for(lambda e, a=app: e.get("event") == "ready" and e.get("app") == a
                            and not any(e is old for old in before[a]), timeout_s=120)
    assert httpx.get(f"{up.ready['url']}/health", timeout=10).status_code == 200

    async def recorded_ok() -> int:
        conn = await asyncpg.connect(up.env_value("DATABASE_URL"))
        try:
            return await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'ok'")
        finally:
            await conn.close()

    ok_before = asyncio.run(recorded_ok())
    up.ask("Say hi again.")

    async def one_more() -> bool:
        return await recorded_ok() > ok_before

    # The restarted recorder projects the new run.
    asyncio.run(eventually_async(one_more, 60, message="the run after the restart recorded"))


def test_the_services_beside_the_engine_run_at_a_lower_priority(up: Up) -> None:
    """The servers, the gateway and the recorder (restarted ones too, after the test above) yield
    the CPU to the worker and its engine process: HELEXA_SERVICES_NICE, 5 by default."""
    worker = _child(up, "worker")
    level = worker.nice()
    engine = [p for p in worker.children() if "spawn_main" in " ".join(p.cmdline())]
    assert engine and [p.nice() for p in engine] == [level] * len(engine)
    for app in ("gateway", "recorder"):
        threads = _child(up, app).threads()
        assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in threads} == {level + 5}, app
    servers = [p for p in processes_using(up.data) if p.info["name"] in ("nats-server", "postgres")]
    assert {p.info["name"] for p in servers} == {"nats-server", "postgres"}
    assert {p.nice() for p in servers} == {level + 5}


def test_up_stops_cleanly_on_sigterm(up: Up) -> None:
    servers = processes_using(up.data)
    names = {p.info["name"] for p in servers}
    assert "nats-server" in names and "postgres" in names, names
    models = httpx.get(f"{up.ready['url']}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [up.ready["model"]]

    assert up.process.stop(signal.SIGTERM, timeout_s=90) == 0
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert processes_using(up.data) == []
    assert "Traceback" not in up.process.output(last=100_000)
