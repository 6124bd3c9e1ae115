"""Events EVENTS did not take survive their process: a process killed while holding one leaves it
in its role's spool, and the next process of that role publishes it once EVENTS has room (a real
nats-server, a real SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from apps.bus import event_publish, topology
from apps.bus.events import AdmissionDecided, AdmissionDecision
from apps.bus.held_spool import HeldSpool
from apps.embedded.nats_server import NatsServer
from tests.bus.test_publish_bounds import KINDS, LATE_DETAIL, connected, fill_events, read_events, stock_server
from tests.support import eventually_async

__all__ = ["stock_server"]  # the fixture, used here by name

REPO = Path(__file__).resolve().parents[2]

# A process of the gateway role: it keeps held events on disk, publishes one that a full EVENTS
# refuses, says its id once the spool has it, and waits to be killed.
_HOLDER = """
import asyncio, sys
from pathlib import Path
from apps.bus import connection, event_publish
from apps.bus.events import AdmissionDecided, AdmissionDecision

async def main():
    data_dir = Path(sys.argv[2])
    nc = await connection.connect(sys.argv[1], "held-spool-holder", max_reconnect_attempts=0)
    js = nc.jetstream()
    await event_publish.keep_held_on_disk(js, data_dir, "gateway")
    event = AdmissionDecided(model="m", node="gateway", request_id="r", principal=None,
                             decision=AdmissionDecision.ADMITTED, detail=sys.argv[3], pending=0, in_flight=0)
    assert not await event_publish.publish_event(js, event)
    for _ in range(600):  # 30 s at most; a holder that gives up prints nothing
        if list(data_dir.glob(f"held-events/*/gateway/{event.event_id}.json")):
            break
        await asyncio.sleep(0.05)
    else:
        sys.exit(1)
    print(event.event_id, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _admission(detail: str) -> AdmissionDecided:
    return AdmissionDecided(model="m", node="gateway", request_id="r", principal=None,
                            decision=AdmissionDecision.ADMITTED, detail=detail, pending=0, in_flight=0)


async def test_an_event_held_by_a_killed_process_is_published_by_the_next_one(
        stock_server: NatsServer, tmp_path: Path) -> None:
    nc = await connected(stock_server.url, topology.BusLimits(event_max_bytes=64 << 10))
    try:
        js = nc.jetstream()
        stored = await fill_events(js)
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, stock_server.url, str(tmp_path), LATE_DETAIL],
                                  cwd=REPO, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert holder.stdout is not None
            event_id = holder.stdout.readline().strip()
            assert event_id, "the holder ended before its event was spooled"
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(30)
        [spooled] = list(tmp_path.glob("held-events/*/gateway/*.json"))
        assert spooled.name == f"{event_id}.json"
        # Nothing of it reached EVENTS: it lives only on disk now.
        assert (await js.stream_info(topology.EVENTS_STREAM)).state.messages == stored

        # Room again, and the role's next process starts: it publishes what the dead one held.
        await js.purge_stream(topology.EVENTS_STREAM, seq=stored + 1)
        await event_publish.keep_held_on_disk(js, tmp_path, "gateway")
        await eventually_async(lambda: _stored_and_removed(spooled), 20.0, message="the spooled event stored")
        [(_, event)] = await read_events(nc, 1)
        assert (event.event_id, getattr(event, "detail", None)) == (event_id, LATE_DETAIL)
        # Another role's spool is its own: a worker starting here finds nothing to publish.
        await event_publish.keep_held_on_disk(js, tmp_path, "worker")
        assert event_publish.held_events() == 0
    finally:
        await nc.close()


async def test_each_role_spools_its_own_events_and_a_spool_past_the_held_cap_is_published_whole(
        stock_server: NatsServer, tmp_path: Path, monkeypatch) -> None:
    nc = await connected(stock_server.url, topology.BusLimits(event_max_bytes=64 << 10))
    try:
        js = nc.jetstream()
        stored = await fill_events(js)
        # One loop keeping both roles' spools (as a test process may): each event goes to the
        # spool of the role that publishes its subject.
        await event_publish.keep_held_on_disk(js, tmp_path / "both", "gateway")
        await event_publish.keep_held_on_disk(js, tmp_path / "both", "worker")
        admission, run = KINDS["admission"]("a" * 1000), KINDS["run.finished"]("r" * 1000)
        assert not await event_publish.publish_event(js, admission)
        assert not await event_publish.publish_event(js, run)
        await eventually_async(lambda: len(list((tmp_path / "both").glob("held-events/*/*/*.json"))) == 2, 20.0,
                               message="both held events spooled")
        assert [p.parent.name for p in (tmp_path / "both").glob(f"held-events/*/*/{admission.event_id}.json")] \
            == ["gateway"]
        assert [p.parent.name for p in (tmp_path / "both").glob(f"held-events/*/*/{run.event_id}.json")] \
            == ["worker"]

        # A dead gateway left more events than a process holds at once: the next one holds what
        # it may and the rest in turn, as those are stored, until every one is.
        [gateway_spool] = (tmp_path / "both").glob("held-events/*/gateway")
        left = HeldSpool(tmp_path / "next" / gateway_spool.relative_to(tmp_path / "both"))
        events = [_admission(f"left {i}") for i in range(5)]
        assert all(left.write(topology.event_subject("admission", "m"), e) for e in events)
        monkeypatch.setattr(event_publish, "MAX_HELD_EVENTS", 4)  # two held already, two more
        await event_publish.keep_held_on_disk(js, tmp_path / "next", "gateway")
        assert event_publish.held_events() == 7
        # A fresh event refused meanwhile waits on disk too, not lost to the backlog.
        fresh = _admission("fresh")
        assert not await event_publish.publish_event(js, fresh)
        await eventually_async(lambda: (left.folder / f"{fresh.event_id}.json").exists(), 20.0,
                               message="the fresh event spooled")
        assert event_publish.held_events() == 8
        await js.purge_stream(topology.EVENTS_STREAM, seq=stored + 1)
        await eventually_async(lambda: event_publish.held_events() == 0, 30.0, message="every held event stored")
        assert not list(left.folder.glob("*.json")) and not list((tmp_path / "both").glob("held-events/*/*/*.json"))
        ids = {event.event_id for _, event in await read_events(nc, 8)}
        assert ids == {admission.event_id, run.event_id, fresh.event_id, *(e.event_id for e in events)}
    finally:
        await nc.close()


async def _stored_and_removed(spooled: Path) -> bool:
    return event_publish.held_events() == 0 and not spooled.exists()


def test_the_spool_is_private_bounded_and_leaves_an_unreadable_file_for_an_operator(tmp_path: Path) -> None:
    spool = HeldSpool(tmp_path / "spool", max_bytes=2_000)
    kept = [e for e in (_admission("x" * 600) for _ in range(5)) if spool.write("helexa.events.admission.m", e)]
    assert 1 <= len(kept) < 5 and spool.bytes <= 2_000
    # An event may hold a client's text: this user's only.
    assert (tmp_path / "spool").stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "spool").glob("*.json")} == {0o600}
    (tmp_path / "spool" / f".{kept[0].event_id}.tmp").write_bytes(b"half of a write")
    (tmp_path / "spool" / "0-not-an-event.json").write_bytes(b"{not json")
    again = HeldSpool(tmp_path / "spool")
    assert [event for _, event in again.load()] == kept
    assert (tmp_path / "spool" / "0-not-an-event.bad").exists()
    assert not list((tmp_path / "spool").glob(".*.tmp"))
    spool.remove(kept[0].event_id)
    assert not (tmp_path / "spool" / f"{kept[0].event_id}.json").exists()
    assert spool.write("helexa.events.admission.m", _admission("x" * 600))  # its room came back
