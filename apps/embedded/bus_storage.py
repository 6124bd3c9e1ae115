"""How much disk `helexa up`'s own NATS server lets the bus reserve (runs in `up`'s process).

JetStream reserves each stream's and bucket's `max_bytes` up front and refuses one past its store's
limit (by default three quarters of the disk free when the server starts). The default sizes
reserve 18 GiB (REQUESTS and the large-requests bucket at `HELEXA_REQUESTS_MAX_BYTES`, EVENTS and
the large-events bucket at `HELEXA_EVENTS_MAX_BYTES`, the files bucket at `HELEXA_FILES_MAX_BYTES`),
so on a small disk the first `helexa up` could not declare the bus at all. At the first start of a
data directory (no JetStream store there yet) the sizes not set in the environment are scaled to
`DISK_SHARE` of the free disk, each at least its floor, and written to `bus-storage.json` beside the
store; later starts reuse what was chosen, so a stream never shrinks under the events it holds. A
disk too small even for the floors is a start failure naming what to do.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from apps.bus.topology import BusLimits

log = logging.getLogger("helexa.up")

# Of the disk free at the first start, what the bus may reserve: the rest is PostgreSQL's, the
# model's and everything else on the machine.
DISK_SHARE = 0.5
RECORD = "bus-storage.json"


@dataclass(slots=True, frozen=True)
class Sized:
    variable: str
    default: int
    floor: int
    # Streams and buckets reserving this size each.
    copies: int


_DEFAULTS = BusLimits()
SIZED = (
    Sized("HELEXA_REQUESTS_MAX_BYTES", _DEFAULTS.request_max_bytes, 64 << 20, 2),
    Sized("HELEXA_EVENTS_MAX_BYTES", _DEFAULTS.event_max_bytes, 256 << 20, 2),
    Sized("HELEXA_FILES_MAX_BYTES", _DEFAULTS.files_max_bytes, 256 << 20, 1),
)


class BusStorageRefused(Exception):
    """The bus cannot be sized here (the disk too small, its record unreadable): one line saying
    what to do."""


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def _size(raw: str) -> int:
    """A size set in the environment; one that is not a number counts as none here (the app's own
    settings refuse it by name)."""
    try:
        return max(int(raw), 0)
    except ValueError:
        return 0


def size_to_disk(free_bytes: int, environ: Mapping[str, str]) -> dict[str, int]:
    """The size of each of `SIZED` not set in `environ`: its default where the bus's share of
    `free_bytes` holds every default, else scaled down alike to fit the share left by the sizes
    set, each at least its floor. Sizes set by hand are the operator's to judge (JetStream refuses
    what its store cannot hold): beside them the others take their floors at least. Raises
    BusStorageRefused when nothing is set and even the floors do not fit."""
    budget = int(free_bytes * DISK_SHARE)
    fixed = [s for s in SIZED if environ.get(s.variable, "").strip()]
    scaled = [s for s in SIZED if s not in fixed]
    budget = max(budget - sum(_size(environ[s.variable]) * s.copies for s in fixed), 0)
    wanted = sum(s.default * s.copies for s in scaled)
    floors = sum(s.floor * s.copies for s in scaled)
    if floors > budget and not fixed:
        raise BusStorageRefused(
            f"the disk has {_gib(free_bytes)} free; the bus needs at least {_gib(int(floors / DISK_SHARE))} "
            f"free at its first start (it reserves {DISK_SHARE:.0%} of it for its streams). Free some space, "
            "or give --data-dir a larger disk")
    share = min(1.0, budget / wanted) if wanted else 1.0
    return {s.variable: max(s.floor, int(s.default * share)) for s in scaled}


def store_bytes(environ: Mapping[str, str]) -> int:
    """The limit `up` gives its NATS server's store: twice what the bus reserves with the sizes
    `environ` gives (the defaults for the others; JetStream counts a stream being updated twice
    while it converges) and a GiB for the node registry, the batch claims and its own files, so that
    JetStream's default (three quarters of the disk free when it starts, less as the store fills)
    never refuses streams it took before."""
    reserved = sum((_size(environ.get(s.variable, "")) or s.default) * s.copies for s in SIZED)
    return 2 * reserved + (1 << 30)


def _free_bytes(folder: Path) -> int:
    existing = folder
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def storage_limits(nats_dir: Path, environ: Mapping[str, str], free_bytes: int | None = None) -> dict[str, str]:
    """The bus sizes `up` gives every app of its NATS server (only those `environ` does not set):
    chosen at the data directory's first start (`size_to_disk`) and read back after; none for a
    store made before sizes were chosen (its streams keep theirs)."""
    record = nats_dir / RECORD
    if record.exists():
        try:
            chosen = {str(k): int(v) for k, v in json.loads(record.read_text(encoding="utf-8")).items()}
        except (OSError, ValueError, AttributeError) as exc:
            raise BusStorageRefused(f"{record} cannot be read ({exc}): delete it to size the bus again "
                                    "from the disk free now") from None
    elif (nats_dir / "jetstream").exists():
        return {}
    else:
        free = _free_bytes(nats_dir) if free_bytes is None else free_bytes
        chosen = size_to_disk(free, environ)
        nats_dir.mkdir(parents=True, exist_ok=True)
        written = record.with_name(f".{RECORD}.tmp")  # whole or not at all, even on a full disk
        written.write_text(json.dumps(chosen, indent=1) + "\n", encoding="utf-8")
        os.replace(written, record)
        if any(chosen[s.variable] < s.default for s in SIZED if s.variable in chosen):
            log.warning("the bus is sized to the disk: set these to choose otherwise",
                        extra={"free": _gib(free), **{k: _gib(v) for k, v in chosen.items()}})
    return {k: str(v) for k, v in chosen.items() if not environ.get(k, "").strip()}
