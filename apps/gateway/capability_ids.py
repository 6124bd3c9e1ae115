"""Ids that are capabilities, as at OpenAI: whoever holds one may use it (a stored response's
`previous_response_id`, a file's id), so nobody may guess one from another or from a time.

An id is its prefix, 12 hex digits of the Unix milliseconds it was made (not secret: the stores
use it to tell a just-made id, which the ledger may not have projected yet, from an old unknown
one) and 32 hex digits (128 bits) drawn fresh from `secrets`.
"""

from __future__ import annotations

import re
import secrets
import time


class CapabilityIds:
    def __init__(self, prefix: str, also_valid: str = "") -> None:
        """`also_valid`: a regex of older id forms still accepted after the prefix (alternatives)."""
        self.prefix = prefix
        forms = "[0-9a-f]{44}" + (f"|{also_valid}" if also_valid else "")
        self._pattern = re.compile(f"{re.escape(prefix)}(?:{forms})")
        self._current = re.compile(f"{re.escape(prefix)}[0-9a-f]{{44}}")

    def new(self) -> str:
        return f"{self.prefix}{time.time_ns() // 1_000_000:012x}{secrets.token_hex(16)}"

    def valid(self, capability_id: str) -> bool:
        return self._pattern.fullmatch(capability_id) is not None

    def unguessable(self, capability_id: str) -> bool:
        """Whether the id has today's form, 128 fresh random bits. An older form may be one more
        than an id its holder has (a UUIDv7 of the same millisecond): usable only where the store
        checks the owner too, never as the only key."""
        return self._current.fullmatch(capability_id) is not None

    def made_at_s(self, capability_id: str) -> float | None:
        """When an id was made (its first 48 bits are Unix milliseconds); None for a malformed id."""
        if not self.valid(capability_id):
            return None
        start = len(self.prefix)
        return int(capability_id[start:start + 12], 16) / 1000.0
