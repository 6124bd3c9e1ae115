"""The gateway's Litestar app: routes, error handlers and the NATS connection's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar, Request
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from apps.bus.codes import ServingError
from apps.fleet.catalogue import load_catalogue
from apps.gateway.admission import AdmissionLimits, load_per_model
from apps.gateway.anthropic import messages
from apps.gateway.auth import ApiKeys
from apps.gateway.bus_client import GatewayBus
from apps.gateway.chat import chat_completions
from apps.gateway.completions import completions
from apps.gateway.errors import http_error_handler, internal_error_handler, serving_error_handler
from apps.gateway.models import health, list_models, metrics, ready
from apps.gateway.openapi_docs import add_components
from apps.settings import GatewaySettings, bus_limits, catalogue_file


def create_app(settings: GatewaySettings | None = None) -> Litestar:
    settings = settings or GatewaySettings()
    keys = ApiKeys.load(settings.api_keys_file) if settings.api_keys_file else None

    async def authenticate(request: Request) -> None:
        # Principals exist only when keys are configured; anonymous callers are None.
        request.state.principal = keys.principal(request) if keys and request.url.path.startswith("/v1/") else None

    @asynccontextmanager
    async def bus_lifespan(app: Litestar) -> AsyncIterator[None]:
        admission = AdmissionLimits(
            max_in_flight=settings.max_in_flight,
            max_queue_depth=settings.max_queue_depth,
            max_wait_s=settings.max_wait_s,
            max_per_principal=settings.max_per_principal,
        )
        per_model = load_per_model(settings.admission_file, admission) if settings.admission_file else None
        app.state.bus = await GatewayBus.connect(settings.nats_url, limits=bus_limits(), admission=admission,
                                                 per_model=per_model, catalogue=load_catalogue(catalogue_file()),
                                                 cold_start_wait_s=settings.cold_start_wait_s)
        try:
            yield
        finally:
            await app.state.bus.close()

    app = Litestar(
        route_handlers=[chat_completions, completions, messages, list_models, health, ready, metrics],
        lifespan=[bus_lifespan],
        before_request=authenticate,
        exception_handlers={
            ServingError: serving_error_handler,
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
