"""`helexa up` from start to stop: one instance per data directory, a taken port, restarts that keep
their ports and env file, Ctrl-C, SIGKILL, an app that cannot start.

The worker replies from a script (`HELEXA_WORKER_SCRIPT`), so each start takes seconds and a slow
answer is one the script makes slow; what is tested here is `up`, not the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import nats
import openai
import psutil
import pytest

from apps.embedded import free_port, port_is_free
from apps.embedded.data_dir import read_env
from apps.embedded.nats_server import NatsServer
from tests.support import REPO, AppProcess, eventually

# A slow answer keeps a stream open until `up` is stopped; a medium one ends by itself within seconds.
SCRIPT = {
    "rules": [
        {"match": "slow", "reply": " ".join(f"w{i}" for i in range(400)), "token_delay_s": 0.25},
        {"match": "medium", "reply": " ".join(f"m{i}" for i in range(12)), "token_delay_s": 0.25},
    ],
    "default": "Paris.",
}


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT), encoding="utf-8")
    return path


def start_up(ups: list[AppProcess], data: Path, port: int, script: Path,
             env: dict[str, str] | None = None) -> AppProcess:
    """`helexa up` with nothing exported (its own NATS and PostgreSQL) unless `env` says otherwise,
    added to `ups` (the fixture that kills it at the test's end)."""
    up = AppProcess(["up", "--data-dir", str(data), "--port", str(port)],
                    {"NATS_URL": "", "DATABASE_URL": "", "HELEXA_URL": "", "HELEXA_WORKER_SCRIPT": str(script),
                     **(env or {})})
    ups.append(up)
    return up


def wait_up(up: AppProcess) -> dict:
    return up.wait_for(lambda e: e.get("event") == "ready" and e.get("app") == "up", timeout_s=180)


@pytest.fixture
def ups() -> Iterator[list[AppProcess]]:
    """Every `up` a test starts is killed at its end, whatever happened."""
    started: list[AppProcess] = []
    yield started
    for up in started:
        for proc in _tree(up):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        up.kill()


def _tree(up: AppProcess) -> list[psutil.Process]:
    try:
        root = psutil.Process(up.process.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def processes_using(folder: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and str(folder) in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


class Stream:
    """A streaming chat request in a thread, its SSE `data:` payloads collected as they come."""

    def __init__(self, url: str, model: str, content: str) -> None:
        self.body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True}
        self.url = f"{url}/v1/chat/completions"
        self.events: list[str] = []
        self.failure: Exception | None = None
        self.first_text = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first_text.set()
        except httpx.HTTPError as exc:
            self.failure = exc
        finally:
            self.first_text.set()

    def outcome(self, timeout_s: float) -> str:
        """`finished`, `error` (an error event, then `[DONE]`), or what went wrong."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream never ended"
        assert self.failure is None, repr(self.failure)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        if "error" in chunks[-1]:
            return "error"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]
        return "finished"


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def _reach(values: dict[str, str]) -> None:
    """The env file's URLs, as a shell that sourced it would use them."""
    nc = await nats.connect(values["NATS_URL"], allow_reconnect=False, connect_timeout=5)
    await nc.flush()
    await nc.close()
    conn = await asyncpg.connect(values["DATABASE_URL"], timeout=10)
    assert await conn.fetchval("SELECT count(*) FROM schema_migrations") >= 1
    await conn.close()


def test_a_second_up_on_the_same_data_dir_fails_in_one_line_and_the_first_serves_on(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    data = tmp_path / "data"
    first = start_up(ups, data, free_port(), script)
    ready = wait_up(first)
    nats_log = data / "nats" / "nats-server.log"
    starts = nats_log.read_text().count("Starting nats-server")
    during = Stream(ready["url"], ready["model"], "medium")
    assert during.first_text.wait(60)

    second = subprocess.run([sys.executable, "-m", "apps.cli", "up", "--data-dir", str(data), "--port",
                             str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=10,
                            env={**os.environ, "NATS_URL": "", "DATABASE_URL": ""})
    assert second.returncode != 0
    assert (second.stdout + second.stderr).splitlines() == [
        f"helexa is already running from {data} (pid {first.process.pid}); stop it or use another --data-dir"]

    assert during.outcome(60) == "finished"
    after = httpx.post(f"{ready['url']}/v1/chat/completions", timeout=60, json={
        "model": ready["model"], "messages": [{"role": "user", "content": "Capital of France?"}]})
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "Paris."
    # The JetStream store was opened by one server only.
    assert nats_log.read_text().count("Starting nats-server") == starts
    assert [p.info["name"] for p in processes_using(data)].count("nats-server") == 1
    assert first.stop(signal.SIGTERM, timeout_s=60) == 0


def test_a_taken_gateway_port_starts_nothing(tmp_path: Path, script: Path) -> None:
    data = tmp_path / "data"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "apps.cli", "up", "--data-dir", str(data), "--port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "NATS_URL": "", "DATABASE_URL": "",
                                   "HELEXA_WORKER_SCRIPT": str(script)})
    assert done.returncode != 0
    assert (done.stdout + done.stderr).splitlines() == [
        f"port {port} is in use: stop the other server or set HELEXA_PORT"]
    assert not (data / "nats").exists() and not (data / "postgres").exists()
    assert processes_using(data) == []


def test_restarts_keep_ports_and_env_file_and_a_sourced_env_file_still_means_embedded_servers(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    data, port = tmp_path / "data", free_port()
    first = start_up(ups, data, port, script)
    ready = wait_up(first)
    values = read_env(data)
    assert f"source {data / 'env'}" in first.output()
    assert stat.S_IMODE((data / "env").stat().st_mode) == 0o600
    assert values["HELEXA_URL"] == ready["url"] == f"http://127.0.0.1:{port}"
    asyncio.run(_reach(values))
    assert first.stop(signal.SIGTERM, timeout_s=60) == 0

    # As after `source .helexa/env`: the exported URLs are this data directory's own servers.
    second = start_up(ups, data, port, script, env=values)
    wait_up(second)
    assert {"nats-server", "postgres"} <= {p.info["name"] for p in processes_using(data)}
    assert read_env(data) == values
    asyncio.run(_reach(values))
    assert second.stop(signal.SIGTERM, timeout_s=60) == 0

    # NATS's port taken meanwhile: a new one, said in one line, and the env file has it.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", _port(values["NATS_URL"])))
        squatter.listen()
        third = start_up(ups, data, port, script, env=values)
        wait_up(third)
        (moved,) = [e for e in third.lines if e.get("old_port")]
        assert (moved["server"], moved["old_port"]) == ("nats", _port(values["NATS_URL"]))
        now = read_env(data)
        assert _port(now["NATS_URL"]) == moved["port"] != moved["old_port"]
        assert now["DATABASE_URL"] == values["DATABASE_URL"]
        asyncio.run(_reach(now))
        assert third.stop(signal.SIGTERM, timeout_s=60) == 0


def test_ctrl_c_ends_the_streams_then_stops_the_apps_then_the_servers_quietly(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    data = tmp_path / "data"
    up = start_up(ups, data, free_port(), script)
    ready = wait_up(up)
    streams = [Stream(ready["url"], ready["model"], "slow") for _ in range(4)]
    assert all(s.first_text.wait(60) for s in streams)
    procs = _tree(up)
    assert {"nats-server", "postgres"} <= {p.name() for p in procs}

    os.killpg(up.process.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
    eventually(lambda: not _alive(procs), timeout_s=15, message=lambda: f"still running: {_alive(procs)}")
    assert up.process.wait(5) == 0
    assert {s.outcome(15) for s in streams} <= {"error", "finished"}
    everything = up.output(last=100_000)
    assert "Traceback" not in everything
    stopped = [e["app"] for e in up.lines if e.get("event") == "stopped" and e.get("logger") == "helexa.up"]
    assert stopped == ["gateway", "worker", "recorder", "postgres", "nats"]


def test_ctrl_c_during_the_first_start_stops_before_any_app_and_the_next_start_serves(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    """Ctrl-C while NATS starts ends the start there: no PostgreSQL, no app. Ctrl-C in a terminal
    while PostgreSQL's database is being made (initdb, in up's process group, gets it too): no app,
    nothing left running, and the half-made database is no obstacle to the next start."""
    data = tmp_path / "data"

    def stopped_by(signal_it: Callable[[AppProcess], None], line: str) -> list[str]:
        up = start_up(ups, data, free_port(), script)
        up.wait_for(lambda e: str(e.get("event", "")).startswith(line), timeout_s=120)
        signal_it(up)
        assert up.process.wait(120) == 0
        up.stop()  # collects the rest of its output
        assert "Traceback" not in up.output(last=100_000)
        assert processes_using(data) == []
        return [e["app"] for e in up.lines if e.get("event") == "stopped" and e.get("logger") == "helexa.up"]

    assert stopped_by(lambda up: os.kill(up.process.pid, signal.SIGINT), "starting NATS") == ["nats"]
    assert not (data / "postgres" / "pgdata").exists()
    assert stopped_by(lambda up: os.killpg(up.process.pid, signal.SIGINT),
                      "creating PostgreSQL's database") == ["postgres", "nats"]

    again = start_up(ups, data, free_port(), script)
    ready = wait_up(again)
    assert _answer(openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused", max_retries=0, timeout=60),
                   ready["model"]) == "Paris."
    assert again.stop(signal.SIGTERM, timeout_s=60) == 0


def test_an_app_that_dies_is_restarted_and_serves_again(tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    """The supervisor sleeps until a child exits (no polling): a killed gateway is started again
    after its backoff, on the same port, and answers; the other apps ran on untouched."""
    up = start_up(ups, tmp_path / "data", free_port(), script)
    ready = wait_up(up)
    children = {p.cmdline()[-1]: p for p in psutil.Process(up.process.pid).children()
                if p.cmdline()[-2:-1] == ["apps.cli"]}
    assert {"gateway", "worker", "recorder"} <= set(children), children
    children["gateway"].kill()
    restarted = up.wait_for(lambda e: e.get("event") == "child restarted" and e.get("app") == "gateway", timeout_s=60)
    assert restarted["restarts"] == 1
    client = openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused", max_retries=0)
    answer = eventually(lambda: _answer(client, ready["model"]), timeout_s=60, message="the gateway never came back")
    assert answer == "Paris."
    assert all(children[app].is_running() for app in ("worker", "recorder"))


def test_an_app_that_cannot_come_back_ends_up_in_one_line_after_its_tries(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    """A worker that exits before it is ready again, restart after restart (its script now
    unreadable), is not restarted forever: after HELEXA_UP_RESTART_TRIES in a row `up` stops
    everything and ends in one line naming it and what it said last."""
    own_script = tmp_path / "script.json"
    own_script.write_text(script.read_text(encoding="utf-8"), encoding="utf-8")
    data = tmp_path / "data"
    up = start_up(ups, data, free_port(), own_script, env={"HELEXA_UP_RESTART_TRIES": "2"})
    wait_up(up)
    workers = [p for p in psutil.Process(up.process.pid).children() if p.cmdline()[-2:] == ["apps.cli", "worker"]]
    assert len(workers) == 1, workers
    own_script.write_text("{not json", encoding="utf-8")
    workers[0].kill()
    assert up.process.wait(120) == 1
    up.stop()  # collects the rest of its output
    restarted = [e["restarts"] for e in up.lines if e.get("event") == "child restarted"]
    assert restarted == [1, 2]
    lines = up.output(last=100_000).strip().splitlines()
    assert lines[-1].startswith("helexa: the worker did not come back after 2 restarts in a row (exit 1: "
                                "the model could not be loaded: "), lines[-1]
    assert "Traceback" not in "\n".join(lines)
    assert processes_using(data) == []


def test_an_embedded_server_that_dies_is_started_again_and_the_system_serves_and_records(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    # Killed for memory, or crashed: `up` says so, starts it again on the same port and data, and
    # the apps, which wait out an outage, serve and record again.
    data = tmp_path / "data"
    up = start_up(ups, data, free_port(), script)
    ready = wait_up(up)
    client = openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused", max_retries=0, timeout=30)
    database = read_env(data)["DATABASE_URL"]
    for name, binary in (("nats", "nats-server"), ("postgres", "postgres")):
        server = next(p for p in psutil.Process(up.process.pid).children() if p.name() == binary)
        server.kill()
        exited = up.wait_for(lambda e, n=name: e.get("event") == "embedded server exited, restarting"
                             and e.get("app") == n, timeout_s=30)
        assert exited["returncode"] == -signal.SIGKILL and exited["log"].endswith(".log")
        up.wait_for(lambda e, n=name: e.get("event") == "embedded server restarted" and e.get("app") == n,
                    timeout_s=90)
        assert eventually(lambda: _answer_or_wait(client, ready["model"]), timeout_s=90,
                          message=f"no answer after {name} restarted") == "Paris."
    recorded = eventually(lambda: asyncio.run(_runs(database)) >= 2, timeout_s=90,
                          message="the answers after the restarts were not recorded")
    assert recorded and up.process.poll() is None


def _answer_or_wait(client: openai.OpenAI, model: str) -> str | None:
    """An answer, or None while the system is still coming back (a 5xx, a timeout)."""
    try:
        return _answer(client, model)
    except openai.APIStatusError as exc:
        if exc.status_code >= 500:
            return None
        raise


async def _runs(database_url: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'ok'")
    finally:
        await conn.close()


def _answer(client: openai.OpenAI, model: str) -> str | None:
    try:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "capital?"}])
    except openai.APIConnectionError:
        return None  # not listening again yet
    return reply.choices[0].message.content


def test_up_killed_with_sigkill_under_load_leaves_no_process(tmp_path: Path, script: Path,
                                                           ups: list[AppProcess]) -> None:
    data, port = tmp_path / "data", free_port()
    up = start_up(ups, data, port, script)
    ready = wait_up(up)
    streams = [Stream(ready["url"], ready["model"], "slow") for _ in range(4)]
    assert all(s.first_text.wait(60) for s in streams)
    procs = _tree(up)
    assert len(procs) >= 6  # up, its three apps, NATS, PostgreSQL (and its backends)

    up.process.send_signal(signal.SIGKILL)  # no cleanup at all
    eventually(lambda: not _alive(procs), timeout_s=10, message=lambda: f"still running: {_alive(procs)}")
    assert processes_using(data) == []
    eventually(lambda: port_is_free(port), timeout_s=5)


def test_an_app_that_cannot_start_ends_up_in_one_line(tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    data = tmp_path / "data"
    up = start_up(ups, data, free_port(), script, env={"HELEXA_MODEL": str(tmp_path / "missing.gguf")})
    up.wait_for(lambda e: e.get("event") == "the model could not be loaded", timeout_s=180)
    assert up.process.wait(10) != 0
    up.stop()  # collects the rest of its output
    lines = up.output(last=100_000).strip().splitlines()
    assert lines[-1].startswith("helexa: the worker did not start (exit 1): the model could not be loaded: "
                                "FileNotFoundError"), lines[-1]
    assert "Traceback" not in "\n".join(lines)
    assert processes_using(data) == []


def test_a_gateway_that_cannot_bind_exits_at_once_naming_the_address(nats_server: NatsServer) -> None:
    """What `up` relies on when its port is taken after its own check: the gateway exits non-zero
    with uvicorn's one line (it used to hang in its shutdown now and then)."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        for _ in range(3):  # the hang came one start in a few
            # faulthandler: a hung gateway given SIGABRT writes every thread's stack before it dies.
            gateway = AppProcess(["gateway", "--port", str(port)],
                                 {"NATS_URL": nats_server.url_for("gateway"), "PYTHONFAULTHANDLER": "1"})
            try:
                try:
                    code = gateway.process.wait(60)  # the hang was forever; a loaded host imports slowly
                except subprocess.TimeoutExpired:
                    gateway.process.send_signal(signal.SIGABRT)
                    gateway.process.wait(30)
                    gateway.stop()
                    raise AssertionError(f"the gateway hung; its output and stacks:\n{gateway.output(400)}") from None
                assert code != 0
            finally:
                gateway.kill()
            gateway.stop()
            errors = [e["event"] for e in gateway.lines if e.get("level") == "error"]
            assert errors == [f"[Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
                              "address already in use"]
            assert "Traceback" not in gateway.output(last=100_000)


def test_a_batch_completes_across_ctrl_c_and_up_again_on_the_same_data_dir(
        tmp_path: Path, script: Path, ups: list[AppProcess]) -> None:
    """The whole system stopped mid-batch (Ctrl-C) and started again: the batch's claim and lines
    wait in the data directory's NATS and PostgreSQL, and the new gateway runs what is missing. The
    stopping gateway gives its claim back, but a NATS server that restarts forgets that and hands
    the claim out again only after the batch ack wait: 8 s here rather than the default minute."""
    data, port, lines = tmp_path / "data", free_port(), 16
    env = {"HELEXA_BATCH_CONCURRENCY": "4", "HELEXA_BATCH_ACK_WAIT_S": "8"}
    first = start_up(ups, data, port, script, env=env)
    ready = wait_up(first)
    client = openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused", max_retries=0, timeout=60)
    content = b"".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": ready["model"], "messages": [{"role": "user", "content": f"medium {i}"}]}}).encode() + b"\n"
        for i in range(lines))
    upload = client.files.create(file=("batch.jsonl", content), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

    def completed() -> int:
        counts = client.batches.retrieve(created.id).request_counts
        return counts.completed if counts is not None else 0

    eventually(lambda: completed() >= 2, 120, message="no line finished")
    os.killpg(first.process.pid, signal.SIGINT)
    assert first.process.wait(60) == 0

    second = start_up(ups, data, port, script, env=env)
    wait_up(second)
    done = eventually(lambda: (b := client.batches.retrieve(created.id)).status == "completed" and b, 180,
                      message="the batch never completed after the restart")
    assert done.request_counts is not None and done.output_file_id is not None
    assert (done.request_counts.total, done.request_counts.completed) == (lines, lines)
    output = [json.loads(row) for row in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(row["custom_id"] for row in output) == sorted(f"line-{i}" for i in range(lines))
    assert second.stop(signal.SIGTERM, timeout_s=60) == 0
