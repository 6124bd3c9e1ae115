"""The front door: `GET /` (the API routes, the docs and the served models) and the 404 for a path
that is no route, which says where the route is when the client's base URL is the mistake.

The usual mistakes are base URLs: the OpenAI SDK appends `/chat/completions` to a base URL that
must end in `/v1`; the Anthropic SDK appends `/v1/messages` to one that must not, so
`base_url=".../v1"` there asks for `/v1/v1/messages`. A 404 under the Anthropic routes is answered
in Anthropic's envelope, so the SDK shows its message.
"""

from __future__ import annotations

import re
from typing import Any

from litestar import Request, Response, get
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.routes import HTTPRoute

from apps.gateway.api import anthropic_schema as an
from apps.gateway.errors import error_body, log_failure

DOCS_PATH = "/openapi"
ANTHROPIC_PREFIX = "/v1/messages"
_DOUBLED = "/v1/v1/"
_SAFE_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$")
_PARAM = re.compile(r"\{([A-Za-z_]+)(:[a-z]+)?\}")
# Methods every route answers on its own, not worth listing.
_IMPLICIT = {"HEAD", "OPTIONS"}


def base_url(request: Request) -> str:
    """This server as the client reached it (`Host` header), or a placeholder if that is odd."""
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}" if _SAFE_HOST.match(host) else "http://<host>:<port>"


def _api_routes(request: Request) -> list[tuple[str, str]]:
    """(method, path) of every route but the docs' own, paths with plain `{name}` parameters."""
    out: list[tuple[str, str]] = []
    for route in request.app.routes:
        if not isinstance(route, HTTPRoute) or route.path == "/" or route.path.startswith(DOCS_PATH):
            continue
        path = _PARAM.sub(r"{\1}", route.path)
        out.extend((method, path) for method in sorted(route.methods - _IMPLICIT))
    return sorted(out, key=lambda r: (r[1], r[0]))


def _is_route(request: Request, path: str) -> bool:
    parts = path.split("/")

    def matches(template: str) -> bool:
        wanted = template.split("/")
        return len(wanted) == len(parts) and all(w == p or w.startswith("{")
                                                 for w, p in zip(wanted, parts, strict=True))

    return any(matches(template) for _, template in _api_routes(request))


def not_found(request: Request, exc: NotFoundException) -> Response:
    """The 404 for a path that is no route, with what to do instead (the app's NotFoundException
    handler: nothing else raises it)."""
    log_failure(f"{request.method} {request.url.path}", 404, str(exc.detail))
    path, base = request.url.path, base_url(request)
    asked = f"There is no route {request.method} {path}"
    single = path.removeprefix("/v1") if path.startswith(_DOUBLED) else f"/v1{path}"
    if path.startswith(_DOUBLED) and single.startswith(ANTHROPIC_PREFIX) and _is_route(request, single):
        message = (f"{asked}: the path holds /v1 twice. The Anthropic SDK appends /v1/messages to its base URL "
                   f'itself: use base_url="{base}" (without /v1).')
    elif _is_route(request, single):
        doubled = ": the path holds /v1 twice" if path.startswith(_DOUBLED) else ""
        message = f'{asked}{doubled}; the route is {single}. The OpenAI SDK\'s base URL is "{base}/v1".'
    else:
        message = (f"{asked}. GET {base}/ lists the routes and {base}{DOCS_PATH} documents them. SDK base URLs: "
                   f'OpenAI "{base}/v1", Anthropic "{base}" (it adds /v1 itself).')
    if path.startswith((ANTHROPIC_PREFIX, f"/v1{ANTHROPIC_PREFIX}")):
        return Response(an.error_body(404, message), status_code=404)
    return Response(error_body(404, message), status_code=404)


@get("/", include_in_schema=False)
async def index(request: Request, state: State) -> dict[str, Any]:
    """What this server is and how to talk to it: base URLs, routes, docs, served models."""
    base = base_url(request)
    return {
        "name": "helexa",
        "openai_base_url": f"{base}/v1",
        "anthropic_base_url": base,
        "docs": f"{base}{DOCS_PATH}",
        "openapi": f"{base}{DOCS_PATH}/openapi.json",
        "routes": [f"{method} {path}" for method, path in _api_routes(request)],
        "models": await state.registry.models() if state.bus.is_connected else [],
    }
