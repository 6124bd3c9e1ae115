"""Reply subjects that share messages: a gateway connection's `home`, and bundles of frames for it.

A gateway connection picks one home under its inbox (`_INBOX.gateway.<user>.<id>`) and listens on
`<home>.r.*` with one subscription. A request's reply subject is `<home>.r.<token>`, the token 128
random bits only the worker delivered the request learns. A worker that has several frames for
one home at once (one flush of its frame window, across all its streams) sends them as one
message on `<home>.r.bundle`: a JSON list of `[token, frame]` pairs, the frame embedded as
encoded. A frame on its own still goes to its reply subject, so the gateway reads both.
(Per-request alive probes, on `<reply subject>.alive`, are one level deeper: not frames.)

Alive probes share messages the same way: a worker asks `<home>.alive` once per probe interval for
all its running attempts whose requester listens at that home, a JSON list of `[token, attempt]`
pairs, and the gateway answers a list of verdicts in the same order: `""` (still listening),
`"taken"` (another attempt serves the client) or `"gone"` (no open request holds the token). No
responders there means the whole gateway connection is gone. (The per-request probe on
`<reply subject>.alive` is still answered, for workers that ask that way.)

Knowing a home is not enough to reach a stream: a bundle's frame is dispatched by its token, and
a token the gateway does not know is dropped, as a frame on a guessed reply subject always was.
A reply subject of any other shape (a test's own inbox, an older gateway) is never bundled.
"""

from __future__ import annotations

import msgspec

REPLY = "r"
BUNDLE = "bundle"
# What one pair adds to the bundle's bytes beyond its token and frame: `["` `",` `]` and a comma.
PAIR_OVERHEAD = 6
LIST_OVERHEAD = 2

ALIVE = "alive"
LISTENING, TAKEN, GONE = "", "taken", "gone"

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(list[tuple[str, msgspec.Raw]])
_probe_decoder = msgspec.json.Decoder(list[tuple[str, int]])
_verdicts_decoder = msgspec.json.Decoder(list[str])


def reply_subject(home: str, token: str) -> str:
    return f"{home}.{REPLY}.{token}"


def bundle_subject(home: str) -> str:
    return f"{home}.{REPLY}.{BUNDLE}"


def home_wildcard(home: str) -> str:
    """Every reply subject of `home`, and its bundles (not the alive probes, a level deeper)."""
    return f"{home}.{REPLY}.*"


def split_reply_subject(subject: str) -> tuple[str, str] | None:
    """(home, token) of a reply subject that may be bundled; None for one of any other shape."""
    home, _, token = subject.rpartition(".")
    home, _, marker = home.rpartition(".")
    if marker != REPLY or not home or not token or token == BUNDLE:
        return None
    return home, token


def pair_size(token: str, frame: bytes) -> int:
    return len(token.encode()) + len(frame) + PAIR_OVERHEAD


def encode(pairs: list[tuple[str, bytes]]) -> bytes:
    return _encoder.encode([(token, msgspec.Raw(frame)) for token, frame in pairs])


def decode(data: bytes) -> list[tuple[str, bytes]]:
    """The pairs of a bundle; raises msgspec.DecodeError for anything else."""
    return [(token, bytes(frame)) for token, frame in _decoder.decode(data)]


def home_alive_subject(home: str) -> str:
    """Where a gateway connection answers the alive probes of all its requests at once."""
    return f"{home}.{ALIVE}"


def encode_probe(asks: list[tuple[str, int]]) -> bytes:
    return _encoder.encode(asks)


def decode_probe(data: bytes) -> list[tuple[str, int]]:
    """The (token, attempt) pairs of a home probe; raises msgspec.DecodeError for anything else."""
    return _probe_decoder.decode(data)


def encode_verdicts(verdicts: list[str]) -> bytes:
    return _encoder.encode(verdicts)


def decode_verdicts(data: bytes) -> list[str]:
    return _verdicts_decoder.decode(data)
