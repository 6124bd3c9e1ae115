"""Event ids are UUIDv7: version and variant bits right, the time in front, strictly increasing per process."""

from __future__ import annotations

import threading
import time
import uuid

from apps.bus.events import AdmissionDecided
from apps.bus.uuid7 import Uuid7Generator, uuid7, uuid7_hex


def _unix_ms(value: uuid.UUID) -> int:
    return value.int >> 80


def test_version_variant_and_timestamp() -> None:
    before = time.time_ns() // 1_000_000
    value = uuid7()
    after = time.time_ns() // 1_000_000
    assert value.version == 7
    assert value.variant == uuid.RFC_4122
    assert before <= _unix_ms(value) <= after


def test_ids_sort_as_text_in_creation_order_and_never_repeat() -> None:
    ids = [uuid7_hex() for _ in range(20_000)]
    assert all(len(i) == 32 and i == i.lower() for i in ids)
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_a_clock_that_stands_still_or_steps_back_keeps_ids_increasing() -> None:
    readings = iter([1_000, 1_000, 1_000, 999, 500, 1_001])
    make = Uuid7Generator(clock_ms=lambda: next(readings))
    ids = [make() for _ in range(6)]
    assert [i.int for i in ids] == sorted(i.int for i in ids)
    assert len({i.int for i in ids}) == 6
    # While the clock is behind, ids keep the last timestamp seen instead of going back with it.
    assert [_unix_ms(i) for i in ids[:5]] == [1_000] * 5
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)


def test_random_bits_differ_within_one_millisecond() -> None:
    make = Uuid7Generator(clock_ms=lambda: 42)
    first, second = make(), make()
    assert _unix_ms(first) == _unix_ms(second) == 42
    assert first != second


def test_threads_share_one_increasing_sequence() -> None:
    make = Uuid7Generator()
    out: list[list[int]] = [[] for _ in range(4)]

    def run(slot: list[int]) -> None:
        slot.extend(make().int for _ in range(5_000))

    threads = [threading.Thread(target=run, args=(slot,)) for slot in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for slot in out for i in slot]
    assert len(set(everything)) == len(everything)
    assert all(slot == sorted(slot) for slot in out)


def test_events_get_uuid7_ids_by_default() -> None:
    first = AdmissionDecided(model="m", node="g", request_id="r", principal=None, decision="admitted",
                                  pending=0, in_flight=0)
    second = AdmissionDecided(model="m", node="g", request_id="r", principal=None, decision="admitted",
                                   pending=0, in_flight=0)
    assert uuid.UUID(hex=first.event_id).version == 7
    assert first.event_id < second.event_id
