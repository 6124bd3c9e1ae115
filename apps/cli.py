"""`helexa` command line: `up` for one machine, and each app on its own for fleets."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from apps import logs, settings

log = logging.getLogger("helexa")


def _run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run an app's coroutine; SIGTERM and SIGINT ask it to stop cleanly."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    with asyncio.Runner(loop_factory=event_loop_factory()) as loop_runner:
        loop_runner.run(runner())


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The apps' event loop (HELEXA_EVENT_LOOP): uvloop by default, asyncio's own on request. On
    one machine the gateway, the worker and NATS take the first token's way back on the cores the
    engine's next step runs on; with uvloop (and httptools in the gateway) their part of it at 16
    streams went from ~7 to ~2.5 ms (README, "On an AMD EPYC Zen 5 host")."""
    if settings.event_loop() == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def _flags_over(settings: object, args: argparse.Namespace, *names: str) -> None:
    """The values given on the command line for `names` over the environment's (a flag not given keeps it)."""
    for name in names:
        if value := getattr(args, name):
            setattr(settings, name, value)


def cmd_gateway(args: argparse.Namespace) -> None:
    import uvicorn

    from apps.gateway.app import create_app, end_in_flight
    from apps.gateway.http_edge import EdgeLimits, EdgeServer, protocol_class, raise_fd_limit
    from apps.settings import GatewaySettings

    settings = GatewaySettings()
    _flags_over(settings, args, "host", "port")

    async def main(stop: asyncio.Event) -> None:
        app = create_app(settings)
        raise_fd_limit(settings.max_connections)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_config=None, access_log=False,
            # httptools with the edge's limits (connections, header block, header and body time).
            http=protocol_class(EdgeLimits.of(settings)), ws="none",
            timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]  # a float works: call_later
            # A backstop: answers in flight are ended after the stop grace (`end_in_flight`).
            timeout_graceful_shutdown=settings.stop_grace_s + 5,  # type: ignore[arg-type]  # a float works: wait_for
        )
        server = EdgeServer(config)
        # The signals are the app's (`_run_until_signal` sets `stop`, then answers in flight end after
        # the stop grace): uvicorn must not take SIGINT/SIGTERM itself while it serves.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]  # a no-op context
        async def serve() -> None:
            # uvicorn logs why it cannot start (e.g. the port is in use), then raises SystemExit,
            # which a task would hand to the event loop itself: caught here, it ends the task.
            with contextlib.suppress(SystemExit):
                await server.serve()

        serving = asyncio.create_task(serve())
        while not server.started and not serving.done() and not stop.is_set():
            await asyncio.sleep(0.05)
        if serving.done():
            raise SystemExit(1)
        if not server.started:  # stopped while starting (e.g. still waiting for NATS): nothing to end
            # uvicorn reports its cancelled start-up as a failure, with a traceback: not one here.
            logging.getLogger("uvicorn.error").disabled = True
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            return
        logs.announce_ready("gateway", url=f"http://{settings.host}:{settings.port}")
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.exit()
        ending = asyncio.create_task(end_in_flight(app, settings.stop_grace_s))
        await serving
        ending.cancel()

    _run_until_signal(main)


def cmd_worker(args: argparse.Namespace) -> None:
    from apps.fleet.catalogue import load_catalogue
    from apps.settings import WorkerSettings, bus_limits, catalogue_file
    from apps.worker.loading import open_model
    from apps.worker.process import EXIT_BUS_LOST, EXIT_REFUSED, BusConnectionLost, WorkerProcess
    from engine.frontend.protocol import EngineRefused

    settings = WorkerSettings()
    _flags_over(settings, args, "model", "served_model_name")
    if args.tensor_parallel is not None:
        try:
            settings = dataclasses.replace(settings, tensor_parallel=args.tensor_parallel)  # checked again
        except ValueError as exc:
            raise SystemExit(f"helexa worker: {exc}") from None
    script = args.script or settings.script or None
    catalogue = load_catalogue(catalogue_file())

    async def opener(source: str, served_name: str, memory_mb: int):
        return await open_model(settings, source, served_name, script, memory_mb)

    async def main(stop: asyncio.Event) -> None:
        opening = asyncio.create_task(opener(settings.model, settings.served_model_name, 0))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not opening.done():
            # Stopped while loading (which can take minutes): the engine process goes now (and
            # one the load starts later), and the load, left without it, ends.
            while not opening.done():
                for process in multiprocessing.active_children():
                    process.terminate()
                await asyncio.wait({opening}, timeout=0.2)
            with contextlib.suppress(Exception):
                opening.result()
            return
        exc = opening.exception()
        if isinstance(exc, EngineRefused):  # e.g. HELEXA_DTYPE=bfloat16 on a CPU without bf16
            logging.getLogger("helexa.worker").error(
                f"the worker cannot start (HELEXA_DTYPE={settings.dtype}): {exc}",
                extra={"model": settings.model or "default"})
            raise SystemExit(EXIT_REFUSED)
        if exc is not None:
            # A model that cannot be served (a wrong path): one line, then exit 1.
            log.debug("the model could not be loaded", exc_info=exc)
            log.error("the model could not be loaded", extra={"error": f"{type(exc).__name__}: {exc}"})
            raise SystemExit(1)
        await WorkerProcess(settings, bus_limits(), opener, catalogue).run(stop, opening.result())

    try:
        _run_until_signal(main)
    except BusConnectionLost:
        raise SystemExit(EXIT_BUS_LOST) from None


def cmd_models(args: argparse.Namespace) -> None:
    """`helexa models ls|load|unload`: the fleet's models, through the workers' control endpoints."""
    import json

    from apps.fleet import control_client, operator
    from apps.settings import GatewaySettings

    async def main() -> None:
        nc = await operator.connect_nats(GatewaySettings().nats_url, name="helexa-cli")
        try:
            if args.action == "ls":
                result = await control_client.list_models(nc)
            elif not args.model:
                raise SystemExit(f"helexa models {args.action} needs a model id")
            elif args.action == "load":
                result = await control_client.load_model(nc, args.model, timeout_s=args.timeout)
            else:
                result = await control_client.unload_model(nc, args.model, timeout_s=args.timeout)
        except control_client.ControlFailed as exc:
            print(json.dumps({"ok": False, "error": str(exc)}))
            raise SystemExit(1) from None
        finally:
            await nc.close()
        print(json.dumps(result, default=str))

    try:
        asyncio.run(main())
    except operator.Unreachable as exc:
        raise SystemExit(str(exc)) from None


def cmd_batches(args: argparse.Namespace) -> None:
    """`helexa batches ls|show|cancel`: the Batch API over the gateway's HTTP (apps.fleet.batches)."""
    import json

    from apps.fleet import batches, operator

    try:
        found = batches.run(args.action, args.batch, batches.gateway_url(args.url), batches.api_key(args.api_key),
                            args.limit)
    except batches.Refused as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        raise SystemExit(1) from None
    except operator.Unreachable as exc:
        raise SystemExit(str(exc)) from None
    for item in found:
        print(json.dumps(item))


def cmd_bus(args: argparse.Namespace) -> None:
    """`helexa bus sub [SUBJECT]`: print the bus's messages as they pass (see apps.fleet.bus_watch);
    `helexa bus setup`: declare the streams, as the administrator NATS_URL names; `helexa bus roles
    [ROLE=USER ...]`: print a nats-server authorization block of the roles (apps.bus.roles)."""
    import nats.errors

    from apps.bus import connection, roles, topology
    from apps.fleet import bus_watch, operator
    from apps.settings import GatewaySettings, bus_limits

    if args.action == "roles":
        pairs = [args.subject, *args.users] if args.subject else []
        named = [pair.split("=", 1) for pair in pairs] or [[role, role] for role in roles.ROLES]
        if any(len(pair) != 2 or pair[0] not in roles.ROLES for pair in named):
            raise SystemExit(f"helexa bus roles: give ROLE=USER pairs, ROLE one of {', '.join(roles.ROLES)}")
        print(roles.authorization(("admin", "ADMIN_PASSWORD"),
                                  [(role, user, f"{user.upper()}_PASSWORD") for role, user in named]))
        return
    if args.action == "setup":
        url = GatewaySettings().nats_url
        try:
            asyncio.run(connection.setup(url, bus_limits()))
        except TimeoutError:
            # JetStream never answers a request NATS refused the user (logged above when it is that).
            raise SystemExit(f"helexa bus setup: the streams were not declared at {connection.without_password(url)}; "
                             "NATS_URL must be an administrator's (an app's or the operator's user may not)") from None
        except (OSError, nats.errors.Error) as exc:
            raise SystemExit(str(operator.unreachable("NATS", "NATS_URL", url, exc))) from None
        log.info("bus topology declared", extra={"nats": connection.without_password(url)})
        return

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await bus_watch.watch(GatewaySettings().nats_url, args.subject or topology.every_subject(), stop)

    try:
        asyncio.run(main())
    except operator.Unreachable as exc:
        raise SystemExit(str(exc)) from None


def cmd_recorder(args: argparse.Namespace) -> None:
    from apps.recorder.app import run_recorder
    from apps.settings import RecorderSettings

    settings = RecorderSettings()
    _run_until_signal(lambda stop: run_recorder(settings, stop, rebuild=args.rebuild))


def cmd_migrate(args: argparse.Namespace) -> None:
    import asyncpg

    from apps.fleet import operator
    from apps.recorder.migrate import migrate
    from apps.settings import RecorderSettings

    url = RecorderSettings().database_url
    try:
        applied = asyncio.run(migrate(url))
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise SystemExit(str(operator.unreachable("PostgreSQL", "DATABASE_URL", url, exc))) from None
    log.info("migrated", extra={"applied": applied})


def cmd_up(args: argparse.Namespace) -> None:
    from apps.up import run_up

    sys.exit(run_up(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helexa", description="LLM serving over NATS JetStream and PostgreSQL")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, ... (HELEXA_LOG_LEVEL, default INFO)")
    parser.add_argument("--data-dir", default=None,
                        help="the data directory of `helexa up`, whose env file the commands read "
                             "(HELEXA_DATA_DIR, default .helexa)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on this machine: NATS, PostgreSQL, gateway, worker, recorder")
    up.add_argument("--data-dir", default=argparse.SUPPRESS,
                    help="where NATS and PostgreSQL keep data, the lock and the env file (HELEXA_DATA_DIR)")
    up.add_argument("--port", type=int, default=None, help="gateway port (HELEXA_PORT, default 8000)")
    up.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: SmolLM2-135M)")
    up.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                    help="shard each model across N ranks (HELEXA_TENSOR_PARALLEL, default 1)")
    up.set_defaults(func=cmd_up)

    gateway = sub.add_parser("gateway", help="the OpenAI/Anthropic HTTP gateway")
    gateway.add_argument("--host", default=None)
    gateway.add_argument("--port", type=int, default=None)
    gateway.set_defaults(func=cmd_gateway)

    worker = sub.add_parser("worker", help="a model worker")
    worker.add_argument("--model", default=None, help="a .gguf file or HF model directory")
    worker.add_argument("--served-model-name", default=None)
    worker.add_argument("--script", default=None,
                        help="reply from this JSON script instead of running the model (for testing clients)")
    worker.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="shard each model across N ranks (HELEXA_TENSOR_PARALLEL, default 1)")
    worker.set_defaults(func=cmd_worker)

    models = sub.add_parser("models", help="list, load or unload models on the fleet's workers")
    models.add_argument("action", choices=["ls", "load", "unload"])
    models.add_argument("model", nargs="?", default="")
    models.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the workers")
    models.set_defaults(func=cmd_models)

    batches = sub.add_parser("batches", help="list, show or cancel batches (/v1/batches) as an API key's principal")
    batches.add_argument("action", choices=["ls", "show", "cancel"])
    batches.add_argument("batch", nargs="?", default="")
    batches.add_argument("--url", default=None, help="the gateway (HELEXA_URL)")
    batches.add_argument("--api-key", default=None, help="the API key (HELEXA_API_KEY or OPENAI_API_KEY)")
    batches.add_argument("--limit", type=int, default=20, help="`ls`: how many, newest first (at most 100)")
    batches.set_defaults(func=cmd_batches)

    bus = sub.add_parser("bus", help="watch the bus: `helexa bus sub [SUBJECT]` prints its messages; "
                                     "`setup` declares its streams; `roles` prints its users' permissions")
    bus.add_argument("action", choices=["sub", "setup", "roles"])
    bus.add_argument("subject", nargs="?", default="",
                     help="`sub`: a subject or wildcard (default: helexa.>); `roles`: ROLE=USER pairs "
                          "(default: one user per role, named after it)")
    bus.add_argument("users", nargs="*", default=[], help=argparse.SUPPRESS)
    bus.set_defaults(func=cmd_bus)

    recorder = sub.add_parser("recorder", help="project EVENTS into PostgreSQL")
    recorder.add_argument(
        "--rebuild",
        action="store_true",
        help="first recompute every projection from the recorded events and replay the EVENTS stream",
    )
    recorder.set_defaults(func=cmd_recorder)

    migrate = sub.add_parser("migrate", help="apply database migrations")
    migrate.set_defaults(func=cmd_migrate)

    from apps.bench.cli import add_commands as add_bench_commands

    add_bench_commands(sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint; report; score runs"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        logs.configure(args.log_level or settings.log_level())
        if args.command != "up":
            from apps.fleet import operator

            operator.use_data_dir(Path(args.data_dir).resolve() if args.data_dir else settings.data_dir())
        args.func(args)
    except settings.SettingError as exc:  # one line naming the setting, not a traceback
        print(f"helexa: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
