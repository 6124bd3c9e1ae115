"""Optional API keys: a file of `KEY PRINCIPAL` lines named by HELEXA_API_KEYS.

When configured, every /v1 request needs `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
(Anthropic); the principal it maps to rides along on the bus request and into the ledger.
Keys are held only as SHA-256 digests and never logged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from litestar import Request

from apps.bus.codes import ErrorCode, ServingError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, principals_by_digest: dict[bytes, str]) -> None:
        self._principals = principals_by_digest

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        principals: dict[bytes, str] = {}
        for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{number}: expected 'KEY PRINCIPAL'")
            principals[_digest(parts[0])] = parts[1]
        if not principals:
            raise ValueError(f"{path} holds no keys")
        return cls(principals)

    def principal(self, request: Request) -> str:
        key = request.headers.get("x-api-key")
        if key is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else None
        if not key:
            raise ServingError(
                401,
                ErrorCode.MISSING_API_KEY,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                context={"detail": "no key"},
            )
        principal = self._principals.get(_digest(key))
        if principal is None:
            raise ServingError(401, ErrorCode.INVALID_API_KEY, "Invalid API key.", context={"detail": "unknown key"})
        return principal
