"""Host checking (apps/gateway/auth.py): a keyless gateway on loopback answers only loopback names
at its port (DNS rebinding), a configured list replaces that, and keyed or public gateways take any."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from apps.bus.codes import ServingError
from apps.gateway.app import create_app
from apps.gateway.auth import AllowedHosts
from apps.settings import GatewaySettings


def refused(hosts: AllowedHosts, host: str | None) -> bool:
    try:
        hosts.check(host)
    except ServingError as exc:
        assert (exc.status, exc.param) == (421, "Host")
        return True
    return False


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_keyless_loopback_answers_loopback_names_at_its_port(bind: str) -> None:
    hosts = AllowedHosts.for_gateway("", keyless=True, bind_host=bind, port=8000)
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST:8000"):
        assert not refused(hosts, host), host
    for host in ("evil.example", "evil.example:8000", "localhost:8001", "localhost", "127.0.0.1.evil.example:8000",
                 "", None, "[::1]"):
        assert refused(hosts, host), host


def test_keyed_or_public_gateways_answer_any_host() -> None:
    assert not refused(AllowedHosts.for_gateway("", keyless=False, bind_host="127.0.0.1", port=8000), "evil.example")
    assert not refused(AllowedHosts.for_gateway("", keyless=True, bind_host="0.0.0.0", port=8000), "evil.example")
    assert not refused(AllowedHosts.for_gateway("*", keyless=True, bind_host="127.0.0.1", port=8000), "x")


def test_a_configured_list_replaces_the_default() -> None:
    hosts = AllowedHosts.for_gateway("api.example.com, *.internal, proxy:9000", keyless=True,
                                     bind_host="127.0.0.1", port=8000)
    for host in ("api.example.com", "api.example.com:443", "gw.internal:8000", "proxy:9000"):
        assert not refused(hosts, host), host
    for host in ("localhost:8000", "example.com", "internal", "proxy:9001", "evil.example"):
        assert refused(hosts, host), host


@pytest.mark.parametrize(("bind", "keys", "warned"), [
    ("0.0.0.0", False, True), ("10.1.2.3", False, True), ("127.0.0.1", False, False), ("0.0.0.0", True, False),
], ids=["keyless-any", "keyless-lan", "keyless-loopback", "keyed-any"])
def test_a_keyless_gateway_others_can_reach_warns_at_start(bind: str, keys: bool, warned: bool, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    settings = GatewaySettings(host=bind)
    if keys:
        (tmp_path / "keys.txt").write_text("sk-test-0123456789 alice\n", encoding="utf-8")
        settings.api_keys_file = str(tmp_path / "keys.txt")
    with caplog.at_level(logging.WARNING, logger="helexa.gateway"):
        create_app(settings)
    said = [r.getMessage() for r in caplog.records if "HELEXA_API_KEYS" in r.getMessage()]
    assert bool(said) == warned
