"""The machine a build or a measurement is for: the CPU's identity and helexa's cache folder.

Kernel builds (`helexa_kernels.cpu`) and the engine's remembered measurements
(`engine.cpu.dtype_cache`) are both keyed by the CPU and kept under the same cache folder, so
both read them here, at the bottom of the import order. No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/helexa` (`~/.cache/helexa` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "helexa"


def cpu_identity() -> dict[str, Any]:
    """The CPU's model name, family and model numbers and instruction-set flags (from
    /proc/cpuinfo; empty off Linux). Virtual machines often name every part alike ("AMD EPYC"):
    the family and model numbers still tell them apart."""
    fields: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough: they are all alike
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return {"model": fields.get("model name", ""), "family": fields.get("cpu family", ""),
            "model_number": fields.get("model", ""), "flags": sorted(fields.get("flags", "").split()),
            "cpus": os.cpu_count()}
