"""Remembered dtype measurements: one per (CPU, torch build, threads, model shapes, batch shapes).

Timing the model's shapes takes seconds, and the answer only changes with the machine or the
model, so `engine.cpu.dtype_choice` keeps it in a small JSON file (default
`$XDG_CACHE_HOME/helexa/dtype-choice.json`). Each entry records when and under what load it was
measured; delete the file (or set `HELEXA_DTYPE`) to measure again or to override. No torch here
beyond its version string.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from helexa_kernels.machine import cache_dir, cpu_identity

CACHE_FILE = "dtype-choice.json"


def default_cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def cache_key(*parts: Any) -> str:
    blob = json.dumps([cpu_identity(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load(path: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None  # missing or unreadable: measure again
    return entry if isinstance(entry, dict) and "dtype" in entry else None


def store(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add an entry; a cache that cannot be written only costs a measurement next time."""
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    entries[key] = {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "load_average_1m": load_1m}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # atomic: two workers starting at once never see half a file
    except OSError:
        pass
