"""Who may call: optional API keys, and the `Host` headers a gateway answers.

API keys are a file of `KEY PRINCIPAL` lines named by HELEXA_API_KEYS. When configured, every /v1
request needs `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic); the principal
it maps to rides along on the bus request and into the ledger. Keys are held only as SHA-256
digests and never logged.
"""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

from litestar.datastructures import Headers

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

    def principal(self, headers: Headers) -> str:
        key = headers.get("x-api-key")
        if key is None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
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


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class AllowedHosts:
    """The `Host` headers this gateway answers. A keyless gateway on a loopback address trusts
    whoever can reach it, and a web page can reach it too: DNS rebinding points the page's own
    name (evil.example) at 127.0.0.1, and the browser then sends the page's requests, with
    `Host: evil.example`, to this machine. So by default such a gateway answers only the names of
    loopback at its port; `HELEXA_ALLOWED_HOSTS` (comma-separated: `name`, `name:port`,
    `*.domain`, or `*`) replaces that list, e.g. for a proxy in front. Anything else is a 421."""

    def __init__(self, hosts: frozenset[str] | None) -> None:
        self.hosts = hosts  # None: any host

    @classmethod
    def for_gateway(cls, allowed: str, keyless: bool, bind_host: str, port: int) -> AllowedHosts:
        names = frozenset(h.strip().lower() for h in allowed.split(",") if h.strip())
        if "*" in names:
            return cls(None)
        if names:
            return cls(names)
        if keyless and _is_loopback(bind_host):
            loopback = {f"{name}:{port}" for name in LOOPBACK_NAMES}
            return cls(frozenset(loopback | (set(LOOPBACK_NAMES) if port == 80 else set())))
        return cls(None)

    def check(self, host: str | None) -> None:
        if self.hosts is None:
            return
        host = (host or "").strip().lower()
        name = _name_of(host)
        allowed = host in self.hosts or name in self.hosts or any(
            pattern.startswith("*.") and name.endswith(pattern[1:]) for pattern in self.hosts)
        if not allowed:
            raise ServingError(421, ErrorCode.INVALID_REQUEST,
                               "This server does not answer for that Host header (HELEXA_ALLOWED_HOSTS).",
                               param="Host", context={"detail": f"host not allowed: {host[:256]!r}"})


def exposed_without_keys(keyless: bool, bind_host: str) -> bool:
    """A keyless gateway others can reach: every caller is then one principal, who lists, reads,
    deletes and cancels every stored response, file and batch (worth a warning at start)."""
    return keyless and not _is_loopback(bind_host)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _name_of(host: str) -> str:
    """`Host` without its port: `[::1]:8000` → `[::1]`, `localhost:8000` → `localhost`."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0]
