"""Reading a generation request's body, and counting the bodies still on their way.

How many other requests were still being read when a body was in goes to its worker with it
(`GenerateRequest.arriving`, stamped by `GenerationPipeline.serve`): a client's burst sends its
headers first and its bodies together, so each but the last sees the rest still on their way,
and an idle engine waits for a burst it was told of.
"""

from __future__ import annotations

from typing import TypeVar

from litestar import Request

from apps.gateway.api.validate import decode_request

T = TypeVar("T")


class BodyReader:
    def __init__(self) -> None:
        # Generation requests whose handler has begun (their headers are in) reading the body.
        self._reading = 0

    async def read(self, client: Request, kind: type[T]) -> T:
        """The request's JSON body as `kind` (`validate.decode_request`); the count of the others
        still being read when it was in lands in `client.state.arriving`."""
        self._reading += 1
        try:
            body = await decode_request(client, kind)
            client.state.arriving = self._reading - 1
            return body
        finally:
            self._reading -= 1


def arriving(client: Request) -> int:
    """How many other requests were still being read when `client`'s body was in."""
    return int(client.state.get("arriving", 0))
