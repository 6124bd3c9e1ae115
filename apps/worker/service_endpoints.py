"""The worker's NATS micro service `helexa-worker` (runs in the worker process): the node's own
endpoints, beside the model consumers.

`nats micro ls/info/stats` find it. Its endpoints answer a one-shot `generate` (a whole answer in
one reply, served by the model's loop like any pulled request, and refused with a 503 while its
slots are taken), `control` (list, load, unload, through the worker process's model lifecycle) and
`tokenize` (`token_service`). Every reply is measured first, so one past the server's max_payload
is refused here, not by the server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Set
from typing import Any

import msgspec
import nats.micro
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.micro.request import Request as ServiceRequest

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.event_publish import publish_event
from apps.bus.publish import TooLarge, respond
from apps.worker import token_service
from apps.worker.model_loop import ModelLoop
from apps.worker.node_status import helexa_version, model_status
from apps.worker.replies import CollectingReplier
from apps.worker.run import ServedModel


async def _answer(req: ServiceRequest, data: bytes) -> None:
    """A service reply measured first (`apps.bus.publish.respond`): one past the server's
    max_payload is answered with a 413 error instead of costing the worker its connection."""
    try:
        await respond(req._msg, data)  # private: nats.micro's Request.respond sends unmeasured
    except TooLarge as exc:
        await req.respond_error("413", f"the answer ({exc.size} bytes) is larger than the bus carries ({exc.limit})")


class ServiceEndpoints:
    """One node's endpoints. `models` and `loading` are the worker's own (read as they are at each
    request); `load` and `unload` are its model lifecycle."""

    def __init__(self, nc: NatsClient, js: JetStreamContext, node: str, models: Mapping[str, ModelLoop],
                 loading: Set[str], load: Callable[[str], Awaitable[None]],
                 unload: Callable[[str], Awaitable[None]]) -> None:
        self.nc = nc
        self.js = js
        self.node = node
        self.models = models
        self.loading = loading
        self.load = load
        self.unload = unload
        self._background: set[asyncio.Task[None]] = set()

    async def register(self) -> nats.micro.Service:
        version = helexa_version()
        service = await nats.micro.add_service(
            self.nc, name=topology.WORKER_SERVICE, version=version if version[:1].isdigit() else "0.1.0",
            description="helexa model worker", metadata={"node": self.node},
        )
        await service.add_endpoint(name="generate", subject=topology.node_endpoint(self.node, "generate"),
                                   handler=self._on_generate, metadata={"body": "GenerateRequest JSON"})
        await service.add_endpoint(name="control", subject=topology.node_endpoint(self.node, "control"),
                                   handler=self._on_control, metadata={"ops": "list, load, unload"})
        await service.add_endpoint(name="tokenize", subject=topology.node_endpoint(self.node, "tokenize"),
                                   handler=self._on_tokenize, metadata={"body": "TokenizeRequest JSON"})
        return service

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        # Handlers of one endpoint run one at a time: a generation must not wait for another, nor
        # a `list` for a slow load (loads and unloads still take turns, through the lifecycle lock).
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_generate(self, req: ServiceRequest) -> None:
        self._in_background(self._generate(req))

    async def _generate(self, req: ServiceRequest) -> None:
        """A whole answer in one reply, for NATS clients that want no streaming and no gateway."""
        try:
            request = wire.request_decoder.decode(req.data)
        except msgspec.DecodeError as exc:
            await req.respond_error("400", wire.bounded_text(f"the body is not a GenerateRequest: {exc}"))
            return
        loop = self.models.get(request.model)
        if loop is None:
            await req.respond_error("404", wire.bounded_text(f"this worker does not serve the model '{request.model}'"))
            return
        replier = CollectingReplier(attempt=1, node=self.node)
        try:
            outcome = await loop.serve_once(request, replier)
        except ServingError as exc:
            await req.respond_error(str(exc.status), wire.bounded_text(exc.message))
            return
        await publish_event(self.js, outcome)
        errors = [f for f in replier.frames if isinstance(f, wire.ErrorFrame)]
        if errors:
            await req.respond_error(str(errors[0].status), wire.bounded_text(errors[0].message),
                                    data=wire.encode(errors[0]))
            return
        final = next(f for f in replier.frames if isinstance(f, wire.Final))
        text = "".join(f.text for f in replier.frames if isinstance(f, wire.Delta) and f.index == 0)
        await _answer(req, json.dumps({"model": request.model, "node": self.node, "text": text,
                                       "finish_reason": final.finish_reason,
                                       "usage": msgspec.to_builtins(final.usage)}).encode())

    async def _on_tokenize(self, req: ServiceRequest) -> None:
        self._in_background(self._tokenize(req))

    async def _tokenize(self, req: ServiceRequest) -> None:
        """Prompt token ids as a generation would have them (`token_service`), or text from ids."""

        def served(model: str) -> ServedModel | None:
            loop = self.models.get(model)
            return loop.model if loop is not None else None

        answer = await token_service.answer(served, req.data)
        try:
            await respond(req._msg, answer)  # private: measured, a reply past max_payload is refused here
        except TooLarge as exc:
            error = wire.TokenizeError(status=413, code=ErrorCode.REQUEST_TOO_LARGE,
                                       message=f"The answer ({exc.size} bytes) is larger than the message bus "
                                               f"carries ({exc.limit} bytes).")
            await respond(req._msg, wire.encode(wire.TokenizeReply(model="", error=error)))

    async def _on_control(self, req: ServiceRequest) -> None:
        self._in_background(self._control(req))

    async def _control(self, req: ServiceRequest) -> None:
        try:
            body = json.loads(req.data or b"{}")
            op, model = body.get("op", "list"), body.get("model", "")
        except (ValueError, AttributeError):
            await req.respond(json.dumps({"ok": False, "error": "the body must be a JSON object"}).encode())
            return
        try:
            if op == "load":
                await self.load(model)
            elif op == "unload":
                await self.unload(model)
            elif op != "list":
                raise ServingError(400, ErrorCode.INVALID_REQUEST, f"unknown op {op!r}: use list, load or unload")
            reply: dict[str, Any] = {"ok": True}
        except ServingError as exc:
            reply = {"ok": False, "error": exc.message}
        reply.update(node=self.node, models=[msgspec.to_builtins(model_status(s)) for s in self.models.values()],
                     loading=sorted(self.loading))
        await _answer(req, json.dumps(reply).encode())
