"""`helexa` command line: `up` for one machine, and each app on its own for fleets."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

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

    with asyncio.Runner(loop_factory=_event_loop_factory()) as loop_runner:
        loop_runner.run(runner())


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The apps' event loop (HELEXA_EVENT_LOOP): uvloop by default, asyncio's own on request. On
    one machine the gateway, the worker and NATS take the first token's way back on the cores the
    engine's next step runs on; with uvloop (and httptools in the gateway) their part of it at 16
    streams went from ~7 to ~2.5 ms (README, "On an AMD EPYC Zen 5 host")."""
    if settings.event_loop() == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def cmd_gateway(args: argparse.Namespace) -> None:
    import uvicorn

    from apps.gateway.app import create_app
    from apps.settings import GatewaySettings

    settings = GatewaySettings()
    if args.host:
        settings.host = args.host
    if args.port:
        settings.port = args.port

    async def main(stop: asyncio.Event) -> None:
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port, log_config=None, access_log=False,
            timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if serving.done():
            await serving
            raise SystemExit("gateway failed to start")
        logs.announce_ready("gateway", url=f"http://{settings.host}:{settings.port}")
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving

    _run_until_signal(main)


def cmd_worker(args: argparse.Namespace) -> None:
    from apps.fleet.catalogue import load_catalogue
    from apps.settings import WorkerSettings, bus_limits, catalogue_file
    from apps.worker.loading import open_model
    from apps.worker.process import EXIT_BUS_LOST, EXIT_REFUSED, BusConnectionLost, WorkerProcess
    from engine.protocol import EngineRefused

    settings = WorkerSettings()
    if args.model:
        settings.model = args.model
    if args.served_model_name:
        settings.served_model_name = args.served_model_name
    catalogue = load_catalogue(catalogue_file())

    async def opener(source: str, served_name: str, memory_mb: int):  # type: ignore[no-untyped-def]
        return await open_model(settings, source, served_name, args.script, memory_mb)

    async def main(stop: asyncio.Event) -> None:
        first = await opener(settings.model, settings.served_model_name, 0)
        await WorkerProcess(settings, bus_limits(), opener, catalogue).run(stop, first)

    try:
        _run_until_signal(main)
    except BusConnectionLost:
        raise SystemExit(EXIT_BUS_LOST) from None
    except EngineRefused as exc:  # e.g. HELEXA_DTYPE=bfloat16 on a CPU without bf16: one line, no traceback
        logging.getLogger("helexa.worker").error(f"the worker cannot start (HELEXA_DTYPE={settings.dtype}): {exc}",
                                                 extra={"model": settings.model or "default"})
        raise SystemExit(EXIT_REFUSED) from None


def cmd_models(args: argparse.Namespace) -> None:
    """`helexa models ls|load|unload`: the fleet's models, through the workers' control endpoints."""
    import json

    from apps.bus import topology
    from apps.fleet import control_client
    from apps.settings import GatewaySettings

    async def main() -> None:
        nc = await topology.connect(GatewaySettings().nats_url, name="helexa-cli")
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

    asyncio.run(main())


def cmd_recorder(args: argparse.Namespace) -> None:
    from apps.recorder.app import run_recorder
    from apps.settings import RecorderSettings

    settings = RecorderSettings()
    _run_until_signal(lambda stop: run_recorder(settings, stop, rebuild=args.rebuild))


def cmd_migrate(args: argparse.Namespace) -> None:
    from apps.recorder.migrate import migrate
    from apps.settings import RecorderSettings

    applied = asyncio.run(migrate(RecorderSettings().database_url))
    log.info("migrated", extra={"applied": applied})


def cmd_up(args: argparse.Namespace) -> None:
    from apps.up import run_up

    sys.exit(run_up(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helexa", description="LLM serving over NATS JetStream and PostgreSQL")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, ... (HELEXA_LOG_LEVEL, default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on this machine: NATS, PostgreSQL, gateway, worker, recorder")
    up.add_argument("--data-dir", default=None, help="where NATS and PostgreSQL keep data (HELEXA_DATA_DIR)")
    up.add_argument("--port", type=int, default=None, help="gateway port (HELEXA_PORT, default 8000)")
    up.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: SmolLM2-135M)")
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
    worker.set_defaults(func=cmd_worker)

    models = sub.add_parser("models", help="list, load or unload models on the fleet's workers")
    models.add_argument("action", choices=["ls", "load", "unload"])
    models.add_argument("model", nargs="?", default="")
    models.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the workers")
    models.set_defaults(func=cmd_models)

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
    logs.configure(args.log_level or settings.log_level())
    args.func(args)


if __name__ == "__main__":
    main()
