"""The apps' event loop (HELEXA_EVENT_LOOP): uvloop unless asyncio's own is asked for."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from apps.cli import event_loop_factory


def test_apps_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HELEXA_EVENT_LOOP", raising=False)
    factory = event_loop_factory()
    assert factory is not None
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_asyncio_own_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELEXA_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None


def test_an_unknown_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELEXA_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="HELEXA_EVENT_LOOP"):
        event_loop_factory()
