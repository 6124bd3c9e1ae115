"""The gateway's Litestar app: routes, error handlers, and the parts a request passes through,
built once per process and wired together here (nothing else constructs them).

Before any route runs, `edge_guard` checks who calls: the `Host` header (`auth.AllowedHosts`),
the API key on the guarded routes (`auth.ApiKeys`, which names the principal), and the caller's
request rate (`rate_limit.RateLimiter`). The routes that cost work but generate nothing pass
admission too: stored responses read or deleted here, token counts where the model is known
(`AdmittedTokenCounter`). Below the app, `http_edge` bounds connections, headers and read times.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import Headers
from litestar.exceptions import HTTPException, NotFoundException
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from apps.bus import wire
from apps.bus.codes import Api, ServingError, Unavailable, unavailable
from apps.fleet.catalogue import load_catalogue
from apps.gateway.admission import AdmissionLimits, Admissions, load_per_model
from apps.gateway.api.anthropic import messages
from apps.gateway.api.batches import cancel_batch, create_batch, list_batches, retrieve_batch
from apps.gateway.api.chat import chat_completions
from apps.gateway.api.completions import completions
from apps.gateway.api.files import create_file, delete_file, file_content, list_files, retrieve_file
from apps.gateway.api.front_door import index, not_found
from apps.gateway.api.health import health, metrics, ready
from apps.gateway.api.models import list_models, retrieve_model
from apps.gateway.api.openapi_docs import add_components
from apps.gateway.api.responses import create_response, delete_response, retrieve_response
from apps.gateway.api.tokens import TokenCounter, count_tokens, detokenize, tokenize
from apps.gateway.auth import AllowedHosts, ApiKeys, exposed_without_keys
from apps.gateway.batch_runner import BatchRunner
from apps.gateway.batch_store import BatchStore
from apps.gateway.body_reading import BodyReader
from apps.gateway.bus_client import GatewayBus
from apps.gateway.cold_start import ColdStarts
from apps.gateway.errors import http_error_handler, internal_error_handler, serving_error_handler
from apps.gateway.events import EventPublisher
from apps.gateway.file_store import FileLimits, FileStore
from apps.gateway.generation import GenerationPipeline
from apps.gateway.liveness import Canceller
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
from apps.gateway.rate_limit import RateLimiter
from apps.gateway.response_store import ResponseStore, StoreLimits
from apps.settings import GatewaySettings, bus_limits, catalogue_file

log = logging.getLogger("helexa.gateway")

# Routes that need an API key when keys are configured (vLLM's token routes live outside /v1),
# and whose callers' request rates are limited.
_GUARDED = ("/v1/", "/tokenize", "/detokenize")
_STORED_RESPONSE = "/v1/responses/"
# Of a stored response's id, what an admission event keeps.
_ID_CHARS = 128


class AdmittedTokenCounter(TokenCounter):
    """Token counts admitted like any work on their model (`Admissions.admit_call`), each kind
    (tokenize, count_tokens, detokenize) in its own pool; a model nobody serves is a 404 before
    admission, as for generations (admission keeps a pool per model it admits for)."""

    def __init__(self, admissions: Admissions, bus: GatewayBus, registry: NodeRegistry,
                 cold_starts: ColdStarts) -> None:
        super().__init__(bus, registry, cold_starts)
        self._admissions = admissions

    async def ask(self, question: wire.TokenizeRequest) -> wire.TokenizeReply:
        request = question.request
        if request is None:
            kind, request_id, principal = "detokenize", f"detokenize-{uuid.uuid4().hex}", None
        else:
            kind = "count_tokens" if request.api == Api.MESSAGES else "tokenize"
            request_id, principal = request.request_id, request.principal
        await self._cold_starts.nodes_for(question.model)  # a 404 (or 503) before any admission
        ticket = await self._admissions.admit_call(kind, question.model, request_id, principal)
        try:
            # The nodes as they are once admitted: the wait may have seen some go and others come.
            return await super().ask(question)
        finally:
            ticket.release()


def edge_guard(keys: ApiKeys | None, hosts: AllowedHosts, limiter: RateLimiter | None,
               admissions: Callable[[], Admissions]) -> Callable[[ASGIApp], ASGIApp]:
    """The middleware every route runs in: Host check (421), API key (401) and request rate (429)
    on the guarded routes, then admission for a stored response read or deleted. The principal
    (None for anonymous callers, and everywhere when no keys are configured) is left in the
    request's state for the routes."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            headers = Headers.from_scope(scope)
            hosts.check(headers.get("host"))
            path, principal = scope["path"], None
            if path.startswith(_GUARDED):
                principal = keys.principal(headers) if keys is not None else None
                if limiter is not None:
                    client = scope.get("client")
                    limiter.take(principal, client[0] if client else None)
            scope.setdefault("state", {})["principal"] = principal
            method = scope.get("method")  # HTTP scopes only: the edge serves no websockets (ws="none")
            if not path.startswith(_STORED_RESPONSE) or method not in ("GET", "DELETE"):
                await app(scope, receive, send)
                return
            kind = f"responses.{method.lower()}"
            ticket = await admissions().admit_call(kind, "-", path.removeprefix(_STORED_RESPONSE)[:_ID_CHARS],
                                                   principal)
            try:
                await app(scope, receive, send)
            finally:
                ticket.release()

        return guarded

    return middleware


def create_app(settings: GatewaySettings | None = None) -> Litestar:
    settings = settings or GatewaySettings()
    keys = ApiKeys.load(settings.api_keys_file) if settings.api_keys_file else None
    hosts = AllowedHosts.for_gateway(settings.allowed_hosts, keys is None, settings.host, settings.port)
    if exposed_without_keys(keys is None, settings.host):
        log.warning("no API keys on an address others can reach: every caller can read, list, delete and "
                    "cancel every stored response, file and batch; set HELEXA_API_KEYS",
                    extra={"host": settings.host, "port": settings.port})
    limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst) if settings.rate_limit_rps else None

    @asynccontextmanager
    async def bus_lifespan(app: Litestar) -> AsyncIterator[None]:
        admission = AdmissionLimits(
            max_in_flight=settings.max_in_flight,
            max_queue_depth=settings.max_queue_depth,
            max_wait_s=settings.max_wait_s,
            max_per_principal=settings.max_per_principal,
        )
        per_model = load_per_model(settings.admission_file, admission) if settings.admission_file else None
        limits = bus_limits()
        gateway_metrics = GatewayMetrics()
        bus = await GatewayBus.connect(settings.nats_url, limits, gateway_metrics)
        registry = NodeRegistry(bus, limits)
        registry.start()
        events = EventPublisher(bus, gateway_metrics)
        events.start()
        admissions = Admissions(admission, per_model, gateway_metrics, events.emit)
        cold_starts = ColdStarts(bus, registry, gateway_metrics, load_catalogue(catalogue_file()),
                                 settings.cold_start_wait_s)
        app.state.bus, app.state.registry = bus, registry
        app.state.metrics, app.state.admissions = gateway_metrics, admissions
        app.state.generations = GenerationPipeline(bus, cold_starts, admissions, Canceller(lambda: bus.nc), events,
                                                   gateway_metrics, settings, batch_load=registry.batch_running)
        app.state.bodies = BodyReader()
        app.state.token_counter = AdmittedTokenCounter(admissions, bus, registry, cold_starts)
        app.state.responses = ResponseStore(settings.database_url, events, settings.response_wait_s, StoreLimits(
            settings.max_stored_response_bytes, settings.max_chain_responses, settings.max_chain_bytes,
            settings.response_cache_bytes, settings.response_cache_ttl_s))
        app.state.files = FileStore(settings.database_url, events, lambda: bus.js, FileLimits(
            settings.max_file_bytes, settings.max_batch_lines, settings.max_batch_line_bytes,
            settings.max_files_per_principal, settings.max_file_bytes_per_principal), settings.response_wait_s)
        app.state.batches = BatchStore(settings.database_url, events, lambda: bus.js, settings.response_wait_s)
        runner = BatchRunner(bus, app.state.batches, app.state.files, app.state.generations,
                             settings.batch_concurrency, settings.max_request_bytes, events.emit, gateway_metrics)
        if settings.batch_concurrency:
            runner.start()
        try:
            yield
        finally:
            await runner.stop()
            await registry.stop()
            await events.stop()
            await app.state.responses.close()
            await app.state.files.close()
            await app.state.batches.close()
            await bus.close()

    app = Litestar(
        route_handlers=[chat_completions, completions, messages, create_response, retrieve_response, delete_response,
                        create_file, list_files, retrieve_file, file_content, delete_file,
                        create_batch, list_batches, retrieve_batch, cancel_batch,
                        list_models, retrieve_model, tokenize, detokenize, count_tokens, health, ready, metrics, index],
        lifespan=[bus_lifespan],
        middleware=[edge_guard(keys, hosts, limiter, lambda: app.state.admissions)],
        exception_handlers={
            ServingError: serving_error_handler,
            NotFoundException: not_found,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        openapi_config=OpenAPIConfig(title="helexa", version="0.1.0", path="/openapi"),
        request_max_body_size=settings.max_request_bytes,
        debug=False,
        logging_config=None,
    )
    app.state.settings = settings
    add_components(app.openapi_schema)
    return app


async def end_in_flight(app: Litestar, grace_s: float) -> None:
    """On SIGTERM, once the server takes no new requests: answers in flight get `grace_s` to
    finish, then each ends with a `gateway_stopping` error (an error event and `[DONE]` for a
    stream), and its worker is told to stop."""
    bus = app.state.get("bus")
    if bus is None:
        return
    deadline = time.monotonic() + grace_s
    while bus.open_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if bus.open_streams:
        log.info("ending the answers in flight: the gateway is stopping", extra={"answers": bus.open_streams})
        bus.fail_streams(unavailable(Unavailable.GATEWAY_STOPPING))
