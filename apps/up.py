"""`helexa up`: the whole system on one machine, kept running, stopped cleanly on Ctrl-C or SIGTERM.

Before anything starts, it takes the data directory's lock (one `up` per data directory) and
checks that the gateway's port is free; either failure is one line and exit 1. Then it starts
(unless NATS_URL / DATABASE_URL point elsewhere: an exported URL of this data directory's own
servers, from `source .helexa/env`, does not count) an embedded NATS server and an embedded
PostgreSQL under the data directory, both locked with credentials kept there and on the ports they
had last time (see `apps.embedded`), declares the bus's streams and migrates (as the servers'
administrators: the only places anything does), writes `<data>/env`, then supervises gateway,
worker and recorder as child processes and prints how to reach everything. An app that exits
before it is ready ends `up` with one line; one that exits once the system is up is started again
after a backoff (1 s, doubling up to 30 s; back to 1 s after a minute of running), so one crash
does not stop the rest.

Least privilege: each child gets only its own role's credentials in its environment (`NATS_URL`
with its NATS user's allow-lists, `apps.bus.roles`; `DATABASE_URL` with its PostgreSQL role, the
worker none), kept in 0600 files under the data directory. The env file gets the operator's NATS
URL (reads everything, writes nothing an app owns), the read-only ledger role's DATABASE_URL (for
`psql`) and the bench's NATS URL (HELEXA_BENCH_NATS_URL). No password is printed or logged.

Every child runs in a process group of its own, so the terminal's Ctrl-C reaches `up` alone: it
stops the gateway (answers in flight get HELEXA_STOP_GRACE_S, 2 s here, then an error event), the
worker and the recorder, then PostgreSQL and NATS, one log line each. If `up` itself is killed, the
kernel stops them all (`apps.embedded.tether`).

On one machine the engine is the work and everything else serves it: the servers, the gateway and
the recorder run at a lower CPU priority (`HELEXA_SERVICES_NICE`, 5; 0 keeps them level), the
worker, whose engine process does the generating, at ours. The engine's threads split each op of
a step between the cores; a service that takes a core from one of them mid-op stalls the other at
the op's end. Measured on 2 cores at 16 streams (`benchmarks/cpu_peers.py`): 297 against 268 tok/s,
inter-token 44 against 51 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import asyncpg
import nats.errors

from apps.bus import connection, roles
from apps.embedded import port_is_free, stable_port, stored_port
from apps.embedded.bus_storage import BusStorageRefused, storage_limits, store_bytes
from apps.embedded.data_dir import AlreadyRunning, UpLock, display_path, write_env
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer, psql_binary
from apps.embedded.tether import dies_with_us
from apps.fleet.operator import without_password
from apps.logs import announce_ready
from apps.settings import BENCH_NATS_URL, GatewaySettings, bus_limits, data_dir, services_nice, up_settings

log = logging.getLogger("helexa.up")

APPS = ("recorder", "worker", "gateway")
STOP_ORDER = ("gateway", "worker", "recorder")
# How long each app gets to stop after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = {"gateway": 10.0, "worker": 10.0, "recorder": 5.0}
# HELEXA_STOP_GRACE_S for `up`'s apps unless set: on Ctrl-C, what an answer in flight gets to finish.
UP_STOP_GRACE_S = 2.0
# The banner's examples ask for a short, greedy answer: they finish in seconds on any CPU.
SAMPLE_MAX_TOKENS = 64
# The apps that generate: they keep up's own priority (their engine processes inherit it).
ENGINE_APPS = frozenset({"worker"})
# The apps with a ledger role of their own (the worker has no DATABASE_URL at all).
LEDGER_APPS = frozenset({"gateway", "recorder"})
# How long declaring the topology on a NATS server `up` did not start may take (its URL may not
# be an administrator's: then the apps wait for someone who is to declare it).
EXTERNAL_SETUP_S = 15.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A child running this long counts as healthy again: its next crash restarts it after FIRST_BACKOFF_S.
STABLE_AFTER_S = 60.0
# How long an exited child's output may take to be read to its end.
PUMP_DRAIN_S = 2.0


class Child:
    """An app process whose log lines are passed through and watched for `ready`; restartable.

    Each child runs in a process group of its own, so the terminal's Ctrl-C reaches only `up`,
    which stops the children itself, in order; and the kernel kills it if `up` dies, even by
    SIGKILL (`apps.embedded.tether`), so no app outlives `up` to serve on as an orphan.
    `exited` is set once its process has exited (its output ends first), so whoever supervises it
    waits on that rather than polling."""

    def __init__(self, app: str, env: dict[str, str], exited: threading.Event, nice: int = 0) -> None:
        self.app = app
        self.env = env
        self.exited = exited
        self.nice = nice
        self.restarts = 0
        # Restarts in a row that exited before they were ready (0 once one is).
        self.failed_restarts = 0
        self.backoff_s = FIRST_BACKOFF_S
        self.spawn()

    def spawn(self) -> None:
        self.ready = threading.Event()
        self.ready_fields: dict = {}
        # What the child said last at error level (or outside the JSON logs), for `up`'s one line.
        self.last_error = ""
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", self.app],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            process_group=0,
            preexec_fn=dies_with_us(signal.SIGKILL),
        )
        lower_priority(self.process.pid, self.nice)
        self.pump = threading.Thread(target=self._pump, args=(self.process, self.ready), daemon=True)
        self.pump.start()

    def _pump(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stderr.write(line)
            try:
                entry = json.loads(line)
            except ValueError:
                if line.strip():
                    self.last_error = line.strip()
                continue
            if not isinstance(entry, dict):
                continue
            if entry.get("level") in ("error", "critical"):
                self.last_error = ": ".join(str(entry[k]) for k in ("event", "error") if entry.get(k))
            if not ready.is_set() and entry.get("event") == "ready":
                self.ready_fields = entry
                ready.set()
        process.wait()
        self.exited.set()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; then whatever is left of its process group (an
        engine process still loading a model) goes too. Returns the exit code."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.process.pid)
                self.process.wait()
        _kill_group(self.process.pid)
        return self.process.returncode


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing is left of it


def lower_priority(pid: int, nice: int) -> None:
    """Raise process `pid`'s niceness by `nice`, every thread it has (a thread it starts later
    inherits it from the one that starts it)."""
    if nice <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]  # no /proc: the process's main thread
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError as exc:  # the thread ended, or the system refuses
            log.debug("could not lower a thread's priority", extra={"pid": pid, "tid": tid, "error": repr(exc)})


class EmbeddedServer:
    """`up`'s own NATS or PostgreSQL, watched like the apps: its exit (killed for memory, a crash)
    sets `attention`, and the supervisor starts it again (same port, data and credentials)."""

    def __init__(self, name: str, server: NatsServer | PostgresServer, log_file: Path,
                 attention: threading.Event, nice: int) -> None:
        self.name, self.server, self.log_file, self.nice = name, server, log_file, nice
        self.attention = attention
        self.backoff_s = FIRST_BACKOFF_S
        self.started_at = time.monotonic()
        self.restarts = 0
        self.failed_restarts = 0  # restarts in a row that did not start (0 once one does)
        self.watch()

    def watch(self) -> None:
        process = self.server.process
        if process is None:
            return

        def wait() -> None:
            process.wait()
            self.attention.set()

        threading.Thread(target=wait, name=f"watch-{self.name}", daemon=True).start()

    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def restart(self) -> None:
        """Start it again; raises (RuntimeError, TimeoutError, OSError) when it does not come up."""
        self.server.start()
        self.started_at = time.monotonic()
        if self.server.process is not None:
            lower_priority(self.server.process.pid, self.nice)
        self.watch()


class Supervisor:
    """Restarts children, and `up`'s own servers, that exit, each after its own backoff, until
    `stop` is set; one that fails to come back `restart_tries` restarts in a row (0: never give up)
    ends the run with a `StartFailed` naming it and what it said last.

    It sleeps until `attention` is set (a child or server exited, or `stop` was set: whoever sets
    either sets it too) or a restart is due; an idle system wakes it never, not five times a second."""

    def __init__(self, children: list[Child], stop: threading.Event, attention: threading.Event,
                 servers: list[EmbeddedServer] | None = None, restart_tries: int = 0) -> None:
        self.children = children
        self.restart_tries = restart_tries
        self.stop = stop
        self.attention = attention
        self.servers = servers or []
        self._due: dict[str, float] = {}  # app or server → monotonic time of its restart

    def run(self) -> None:
        while not self.stop.is_set():
            self.attention.clear()
            for server in self.servers:
                self._look_after_server(server)
            for child in self.children:
                self._look_after(child)
            due = min(self._due.values(), default=None)
            self.attention.wait(None if due is None else max(due - time.monotonic(), 0.0))

    def _look_after_server(self, server: EmbeddedServer) -> None:
        now = time.monotonic()
        if server.alive():
            return
        if server.name not in self._due:
            process = server.server.process
            if now - server.started_at >= STABLE_AFTER_S:
                server.backoff_s = FIRST_BACKOFF_S
            self._due[server.name] = now + server.backoff_s
            log.error("embedded server exited, restarting", extra={
                "app": server.name, "returncode": process.returncode if process is not None else None,
                "log": display_path(server.log_file), "restart_in_s": server.backoff_s,
                "restarts": server.restarts})  # fmt: skip
            server.backoff_s = min(server.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= self._due[server.name]:
            del self._due[server.name]
            server.restarts += 1
            try:
                server.restart()
            except Exception as exc:  # whatever it was, it is logged and tried again
                log.error("embedded server did not start again", extra={
                    "app": server.name, "error": str(exc), "log": display_path(server.log_file)})
                server.failed_restarts += 1
                self._give_up_after(server.failed_restarts, server.name, f"{_said(exc)} (its log: "
                                    f"{display_path(server.log_file)})")
                self.attention.set()  # look again: its next try is scheduled at once
                return
            server.failed_restarts = 0
            log.info("embedded server restarted", extra={"app": server.name, "restarts": server.restarts})

    def _look_after(self, child: Child) -> None:
        now = time.monotonic()
        if child.alive():
            return
        if child.app not in self._due:
            _kill_group(child.process.pid)  # what it leaves behind (an engine process) goes with it
            child.pump.join(PUMP_DRAIN_S)  # its last lines read, what it said last among them
            if child.restarts and not child.ready.is_set():
                child.failed_restarts += 1
                said = f"exit {child.process.returncode}" + (f": {child.last_error}" if child.last_error else "")
                self._give_up_after(child.failed_restarts, child.app, said)
            else:
                child.failed_restarts = 0
            ran_s = round(now - child.started_at, 1)
            if ran_s >= STABLE_AFTER_S:
                child.backoff_s = FIRST_BACKOFF_S
            self._due[child.app] = now + child.backoff_s
            log.warning("child exited, restarting", extra={
                "app": child.app, "returncode": child.process.returncode, "ran_s": ran_s,
                "restart_in_s": child.backoff_s, "restarts": child.restarts})  # fmt: skip
            child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= self._due[child.app]:
            del self._due[child.app]
            child.restarts += 1
            child.spawn()
            log.info("child restarted", extra={"app": child.app, "pid": child.process.pid,
                                               "restarts": child.restarts})

    def _give_up_after(self, failed_in_a_row: int, name: str, said: str) -> None:
        if self.restart_tries and failed_in_a_row >= self.restart_tries:
            raise StartFailed(f"helexa: the {name} did not come back after {failed_in_a_row} restarts in a row "
                              f"({said}); stopping (HELEXA_UP_RESTART_TRIES)")


# How much of the worker's dtype reason the banner shows (the whole of it is in the worker's log).
BANNER_REASON_CHARS = 160


def _helexa_command() -> str:
    """How the user runs `helexa` from where they stand: the venv's script (as `make run` does), by
    a relative path when it is under the current folder, else its name if that is on the PATH."""
    script = Path(sys.executable).parent / "helexa"
    if not script.exists() or shutil.which("helexa") == str(script):
        return "helexa"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def banner(url: str, model: str, env_file: Path, worker: dict, credential_files: list[Path],
           role_folders: list[Path] | None = None) -> str:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = json.dumps({"model": model, "messages": messages, "temperature": 0, "max_tokens": SAMPLE_MAX_TOKENS})
    psql = psql_binary() if Path(psql_binary()).exists() else "psql"
    dtype = ""
    if worker.get("dtype"):
        # The reason in the worker's log line ends with the CPU's flags: the banner keeps the why.
        why = str(worker.get("dtype_reason") or "").split("; CPU:")[0]
        why = why if len(why) <= BANNER_REASON_CHARS else why[:BANNER_REASON_CHARS - 1] + "…"
        dtype = f"  dtype: {worker['dtype']}" + (f" ({why})" if why else "") + "\n"
    helexa = _helexa_command()
    where = "".join(f"  credentials (readable only by you): {path}\n" for path in credential_files)
    if role_folders:
        where += f"  each app's own, in {' and '.join(str(f) for f in role_folders)}\n"
    source = f"source {display_path(env_file)}"
    return (
        f"\nhelexa is up: {url}/v1 serving {model}\n{dtype}\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  OpenAI SDK: OpenAI(base_url=\"{url}/v1\", api_key=\"unused\").chat.completions.create(\n"
        f"    model=\"{model}\", messages={messages!r}, temperature=0, max_tokens={SAMPLE_MAX_TOKENS})\n\n"
        f"  NATS_URL (the operator's: reads everything), DATABASE_URL (read-only) and HELEXA_URL\n"
        f"  (readable only by you): {env_file}\n"
        f"    {source}\n"
        f"    {helexa} bus sub          # the messages on the bus as they pass\n"
        f"    {psql} \"$DATABASE_URL\"\n"
        f"{where}"
        "Press Ctrl-C to stop.\n"
    )


class StartFailed(Exception):
    """Something `up` started did not come up; the message is the one line the user sees."""


def _unless_stopped(stop: threading.Event) -> None:
    """Between the steps of the start (NATS, the bus, PostgreSQL, migrations): a Ctrl-C during one
    ends the start after it, rather than once the apps are up too."""
    if stop.is_set():
        raise StartFailed("stopped")


def _wait_until_ready(children: list[Child], stop: threading.Event) -> None:
    """Until every child is ready. Before the system is up an exit is a failure to start (a bad
    model, a port in use): reported at once, whichever child it is, rather than retried."""
    while not all(child.ready.is_set() for child in children):
        if stop.wait(0.1):
            raise StartFailed("stopped")
        for child in children:
            if not child.ready.is_set() and not child.alive():
                said = f": {child.last_error}" if child.last_error else " (its log is above)"
                raise StartFailed(f"helexa: the {child.app} did not start (exit {child.process.returncode}){said}")


def _embedded(exported: str, server_dir: Path, urls_at: Callable[[int], set[str]]) -> bool:
    """Whether `up` runs this server itself: nothing is exported, or what is exported is this
    data directory's own server (a sourced env file, of now or from before the roles), rather
    than an external server."""
    if not exported:
        return True
    port = stored_port(server_dir)
    return port is not None and (server_dir / "credentials.json").exists() and exported in urls_at(port)


def _child_env(base: dict[str, str], app: str, nats_urls: dict[str, str],
               database_urls: dict[str, str]) -> dict[str, str]:
    """`base` with `app`'s own credentials and nobody else's."""
    env = {k: v for k, v in base.items() if k not in ("NATS_URL", "DATABASE_URL", BENCH_NATS_URL)}
    env["NATS_URL"] = nats_urls[app]
    if app in database_urls:
        env["DATABASE_URL"] = database_urls[app]
    return env


def _said(exc: BaseException) -> str:
    """An error's text for a one-line failure; never empty (a bare TimeoutError has none)."""
    return str(exc) or ("no answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__)


def _declare_topology(url: str, embedded: bool) -> None:
    """The streams, as the administrator (of `up`'s own server), or tried with an external NATS_URL."""
    try:
        asyncio.run(asyncio.wait_for(connection.setup(url, bus_limits()), None if embedded else EXTERNAL_SETUP_S))
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        if embedded:
            hint = ""
            if "insufficient storage" in str(exc):
                hint = (" (JetStream reserves every stream's size on disk: free some space, or lower "
                        "HELEXA_EVENTS_MAX_BYTES, HELEXA_FILES_MAX_BYTES or HELEXA_REQUESTS_MAX_BYTES)")
            raise StartFailed(f"helexa: cannot declare the bus topology on NATS: {_said(exc)}{hint}") from None
        log.warning("could not declare the bus topology with NATS_URL; the apps wait until an "
                    "administrator does (helexa bus setup)", extra={"error": repr(exc)[:300]})


def _stop_apps(children: list[Child]) -> None:
    """The apps before the servers they need: the gateway first (its clients get their answers
    or an error event within its stop grace), then the worker, then the recorder."""
    by_app = {child.app: child for child in children}
    for app in STOP_ORDER:
        child = by_app.get(app)
        if child is None:
            continue
        was_alive = child.alive()
        code = child.stop(STOP_TIMEOUT_S[app])
        if was_alive:
            log.info("stopped", extra={"app": app, "returncode": code})


def run_up(args: argparse.Namespace) -> int:
    from apps.recorder.migrate import migrate

    stop = threading.Event()
    # Set with `stop` and whenever a child exits: what the supervisor waits on.
    attention = threading.Event()
    children: list[Child] = []
    watched: list[EmbeddedServer] = []  # up's own servers, started again if they exit

    def on_signal(*_: object) -> None:
        if stop.is_set():  # a second Ctrl-C: no more waiting, for the apps or the servers
            for child in children:
                _kill_group(child.process.pid)
            for server in watched:
                if server.server.process is not None:
                    _kill_group(server.server.process.pid)
        stop.set()
        attention.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    folder = Path(args.data_dir).resolve() if args.data_dir else data_dir()
    settings = up_settings()
    env = dict(settings.inherited_env)
    # The apps keep what they must not lose (events EVENTS has not taken yet) in this folder too.
    env["HELEXA_DATA_DIR"] = str(folder)
    if args.port:
        env["HELEXA_PORT"] = str(args.port)
    if args.model:
        env["HELEXA_MODEL"] = str(Path(args.model).resolve())
    if getattr(args, "tensor_parallel", None) is not None:
        env["HELEXA_TENSOR_PARALLEL"] = str(args.tensor_parallel)
    # On Ctrl-C an answer in flight gets this long before its error event (unless set otherwise).
    env.setdefault("HELEXA_STOP_GRACE_S", str(UP_STOP_GRACE_S))
    gateway = GatewaySettings(port=args.port) if args.port else GatewaySettings()
    nice = services_nice()
    credential_files: list[Path] = []
    role_folders: list[Path] = []
    lock = UpLock(folder)
    try:
        lock.acquire()
    except AlreadyRunning as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    except OSError as exc:
        print(f"helexa: cannot use the data directory {folder}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    failure = ""
    with ExitStack() as servers:
        servers.callback(lock.release)  # last: the servers are stopped while we still hold it
        if not port_is_free(gateway.port, gateway.host):
            print(f"port {gateway.port} is in use: stop the other server or set HELEXA_PORT", file=sys.stderr,
                  flush=True)
            return 1
        try:
            nats_dir, pg_dir = folder / "nats", folder / "postgres"
            exported_nats = settings.exported_nats_url
            nats_embedded = _embedded(exported_nats, nats_dir, lambda p: {
                NatsServer(nats_dir, p).url, NatsServer(nats_dir, p).url_for(roles.OPERATOR)})
            if nats_embedded:
                try:
                    sizes = storage_limits(nats_dir, os.environ)
                except BusStorageRefused as exc:
                    raise StartFailed(f"helexa: cannot size the bus at {nats_dir}: {exc}") from None
                os.environ.update(sizes)  # the bus setup below reads them, as every app does
                env.update(sizes)
                log.info("starting NATS", extra={"data_dir": str(nats_dir)})
                servers.callback(log.info, "stopped", extra={"app": "nats"})
                nats_server = servers.enter_context(
                    NatsServer(nats_dir, port=stable_port(nats_dir, "nats"), tethered=True,
                               max_file_store=store_bytes(os.environ)))
                if nats_server.process is not None:
                    lower_priority(nats_server.process.pid, nice)
                watched.append(EmbeddedServer("nats", nats_server, nats_dir / "nats-server.log", attention, nice))
                admin_nats = nats_server.url
                nats_urls = {role: nats_server.url_for(role) for role in roles.ROLES}
                credential_files.append(nats_server.credentials_file)
                role_folders.append(nats_server.users_dir)
            else:
                admin_nats = exported_nats
                nats_urls = dict.fromkeys(roles.ROLES, exported_nats)
            _unless_stopped(stop)
            _declare_topology(admin_nats, nats_embedded)
            _unless_stopped(stop)
            exported_database = settings.exported_database_url
            postgres: PostgresServer | None = None
            if _embedded(exported_database, pg_dir, lambda p: {
                    PostgresServer(pg_dir, p).url, PostgresServer(pg_dir, p).role_url("reader")}):
                first = not (pg_dir / "pgdata" / "PG_VERSION").exists()
                log.info("creating PostgreSQL's database (first start)" if first else "starting PostgreSQL",
                         extra={"data_dir": str(pg_dir)})
                servers.callback(log.info, "stopped", extra={"app": "postgres"})
                postgres = servers.enter_context(
                    PostgresServer(pg_dir, port=stable_port(pg_dir, "postgres"), tethered=True))
                if postgres.process is not None:  # its backends, forked later, inherit it
                    lower_priority(postgres.process.pid, nice)
                watched.append(EmbeddedServer("postgres", postgres, postgres.data_dir / "postgres.log", attention,
                                              nice))
                owner_database = postgres.url
                credential_files.append(postgres.credentials_file)
                role_folders.append(postgres.data_dir / "roles")
            else:
                owner_database = exported_database
            _unless_stopped(stop)
            url = f"http://{gateway.host}:{gateway.port}"
            log.info("applying migrations")
            try:
                asyncio.run(migrate(owner_database))
                if postgres is not None:
                    asyncio.run(postgres.open_app_roles())
            except (OSError, asyncpg.PostgresError) as exc:
                raise StartFailed(f"helexa: cannot migrate PostgreSQL at {without_password(owner_database)} "
                                  f"(DATABASE_URL): {_said(exc)}") from None
            _unless_stopped(stop)
            if postgres is not None:
                database_urls = {app: postgres.role_url(app) for app in LEDGER_APPS}
                reader_database = postgres.role_url("reader")
            else:
                database_urls = dict.fromkeys(LEDGER_APPS, owner_database)
                reader_database = owner_database
            env_values = {"NATS_URL": nats_urls[roles.OPERATOR], "DATABASE_URL": reader_database,
                          "HELEXA_URL": url}
            if nats_embedded:
                env_values[BENCH_NATS_URL] = nats_urls[roles.BENCH]
            env_file = write_env(folder, env_values)
            for app in APPS:
                children.append(Child(app, _child_env(env, app, nats_urls, database_urls), attention,
                                      0 if app in ENGINE_APPS else nice))
            _wait_until_ready(children, stop)
            worker = next(c.ready_fields for c in children if c.app == "worker")
            model = worker.get("model")
            print(banner(url, model or "", env_file, worker, credential_files, role_folders), flush=True)
            announce_ready("up", url=url, model=model, data_dir=str(folder), env_file=str(env_file))
            Supervisor(children, stop, attention, watched, settings.restart_tries).run()
        except (StartFailed, RuntimeError, TimeoutError, OSError) as exc:
            if not stop.is_set():
                failure = str(exc) if str(exc).startswith("helexa") else f"helexa: {exc}"
        finally:
            _stop_apps(children)
    if failure:  # the last line, once everything is stopped
        print(failure, file=sys.stderr, flush=True)
        return 1
    return 0
