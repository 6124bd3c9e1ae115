"""Every frame this gateway connection waits on arrives through one subscription, on
`<home>.r.*` (`apps.bus.bundles`): frames on a request's reply subject and bundles of frames from
a worker's flush. Each goes to its request's `ReplyStream` by the reply subject's token; a token
no open request holds (a finished request, a guess) is dropped.

A migrated request's stream moves to a new token (`follow`): frames on the old one are dropped
from then on. Alive probes are answered per request (`apps.gateway.liveness.answer_probes`), so a
request nobody waits on any more has no responder, as before.
"""

from __future__ import annotations

import logging
import secrets

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus import bundles
from apps.gateway.reply_stream import ReplyStream

log = logging.getLogger("helexa.gateway")


class ReplyRouter:
    def __init__(self, nc: NatsClient) -> None:
        self.home = nc.new_inbox()
        self._nc = nc
        self._prefix = bundles.reply_subject(self.home, "")
        # Token -> the stream its frames go to (the current token of each open stream only).
        self._frames: dict[str, ReplyStream] = {}
        self._token_of: dict[ReplyStream, str] = {}

    async def start(self) -> None:
        await self._nc.subscribe(bundles.home_wildcard(self.home), cb=self._on_message)

    def new_reply_subject(self) -> str:
        """A reply subject for one request: this connection's home and 128 random bits."""
        return bundles.reply_subject(self.home, secrets.token_urlsafe(16))

    def owns(self, reply_subject: str) -> bool:
        split = bundles.split_reply_subject(reply_subject)
        return split is not None and split[0] == self.home

    def follow(self, stream: ReplyStream, reply_subject: str) -> None:
        """Frames on `reply_subject` (one of `new_reply_subject`'s) go to `stream` from now, and no
        longer those on the stream's previous subject."""
        if not self.owns(reply_subject):
            raise ValueError(f"not a reply subject of this connection: {reply_subject!r}")
        token = reply_subject.rpartition(".")[2]
        self.forget(stream)
        self._frames[token] = stream
        self._token_of[stream] = token

    def forget(self, stream: ReplyStream) -> None:
        token = self._token_of.pop(stream, None)
        if token is not None:
            self._frames.pop(token, None)

    async def _on_message(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix):]
        if token != bundles.BUNDLE:
            stream = self._frames.get(token)
            if stream is not None:
                stream.on_frame(msg.data)
            return
        try:
            pairs = bundles.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("undecodable bundle of reply frames dropped")
            return
        for token, frame in pairs:
            stream = self._frames.get(token)
            if stream is not None:
                stream.on_frame(frame)
