"""Every frame this gateway connection waits on arrives through one subscription, on
`<home>.r.*` (`apps.bus.bundles`): frames on a request's reply subject and bundles of frames from
a worker's flush. Each goes to its request's `ReplyStream` by the reply subject's token; a token
no open request holds (a finished request, a guess) is dropped.

A migrated request's stream moves to a new token (`follow`): frames on the old one are dropped
from then on. A worker's alive probes for all its requests here come as one message on
`<home>.alive` and are answered by token: still listening, `taken` (another attempt serves the
client; a migrated stream's old tokens answer so until it closes) or `gone` (no open request holds
the token). Per-request probes are still answered per request (`apps.gateway.liveness.answer_probes`).
"""

from __future__ import annotations

import logging
import secrets

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus import bundles
from apps.bus.publish import respond
from apps.gateway.liveness import is_taken
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
        # Every token a stream has had (its current one and those it migrated from), until it closes.
        self._probed: dict[str, ReplyStream] = {}
        self._tokens_of: dict[ReplyStream, list[str]] = {}

    async def start(self) -> None:
        await self._nc.subscribe(bundles.home_wildcard(self.home), cb=self._on_message)
        await self._nc.subscribe(bundles.home_alive_subject(self.home), cb=self._on_probe)

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
        self._stop_routing(stream)
        self._frames[token] = stream
        self._token_of[stream] = token
        self._probed[token] = stream
        self._tokens_of.setdefault(stream, []).append(token)

    def forget(self, stream: ReplyStream) -> None:
        """The stream closed: its frames are dropped and probes for any of its tokens say `gone`."""
        self._stop_routing(stream)
        for token in self._tokens_of.pop(stream, ()):
            self._probed.pop(token, None)

    def _stop_routing(self, stream: ReplyStream) -> None:
        token = self._token_of.pop(stream, None)
        if token is not None:
            self._frames.pop(token, None)

    async def _on_probe(self, msg: Msg) -> None:
        try:
            asks = bundles.decode_probe(msg.data)
        except msgspec.DecodeError:
            log.warning("undecodable alive probe dropped")
            return
        verdicts = []
        for token, attempt in asks:
            stream = self._probed.get(token)
            if stream is None:
                verdicts.append(bundles.GONE)
            elif is_taken(attempt, stream.locked_attempt, stream.base_attempt):
                verdicts.append(bundles.TAKEN)
            else:
                verdicts.append(bundles.LISTENING)
        if msg.reply:
            # No longer than the probe, so it fits whatever the probe's size: a verdict is at most
            # as long as the pair it answers (`"gone"` as `["",0]`; only a token held here, 22
            # characters, can be `"taken"`). `respond` measures it all the same.
            await respond(msg, bundles.encode_verdicts(verdicts))

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
