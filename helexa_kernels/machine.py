"""The machine a build or a measurement is for: the CPU's identity, the CPUs this process may use,
and helexa's cache folder.

Kernel builds (`helexa_kernels.cpu`) and the engine's remembered measurements
(`engine.cpu.dtype_cache`) are both keyed by the CPU and kept under the same cache folder, so
both read them here, at the bottom of the import order. No torch here.

The CPUs this process may use (`cpu_budget`) are the cores in its affinity mask, capped by its
cgroup's CPU quota: a container limited to fewer CPUs than its host has cores (Kubernetes'
`limits.cpu`, `docker run --cpus`) keeps every core in its mask, and the kernel stops the whole
process for the rest of each period once it has used its quota. The quota is read the way the
kernel applies it: every cgroup from the process's own up to the hierarchy's root may limit it, so
the smallest limit on that path holds. Both cgroup v2 (`cpu.max`, "$QUOTA $PERIOD" or "max") and v1
(`cpu.cfs_quota_us` over `cpu.cfs_period_us`, -1 for none) are read, where `/proc/self/mountinfo`
says they are mounted; anything unreadable counts as no limit. A fractional quota rounds up: 1.5
CPUs may run two threads, each a share of the time (the engine's thread governor measures whether
one is faster).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class CpuBudget:
    affinity: int  # cores the process may run on
    quota: float | None  # CPUs' worth of time per period the cgroups allow; None: no limit

    @property
    def threads(self) -> int:
        """Threads worth running: no more than the cores, nor the quota rounded up."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.quota)))

    def describe(self) -> str:
        cores = f"{self.affinity} core{'s' if self.affinity != 1 else ''} in the affinity mask"
        if self.quota is None:
            return f"{cores}, no CPU quota"
        return f"{cores}, a CPU quota of {self.quota:g} CPU{'s' if self.quota != 1 else ''}"


@dataclass(frozen=True, slots=True)
class CgroupMount:
    root: str  # the part of the hierarchy mounted here
    point: Path
    version: int  # 1 or 2


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), field)


def cgroup_cpu_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup mounts that carry the cpu controller (v1) and the unified hierarchies (v2)."""
    mounts = []
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, after = fields.split(), tail.split()
        if len(parts) < 5 or len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if fstype == "cgroup2":
            mounts.append(CgroupMount(_unescape(parts[3]), Path(_unescape(parts[4])), 2))
        elif fstype == "cgroup" and "cpu" in options:
            mounts.append(CgroupMount(_unescape(parts[3]), Path(_unescape(parts[4])), 1))
    return mounts


def own_cgroup_paths(proc_cgroup: str) -> dict[int, str]:
    """The process's cgroup in the v2 hierarchy and in v1's cpu hierarchy, by version."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    return paths


def _limit(directory: Path, version: int) -> float | None:
    """The CPUs' worth of time this one cgroup allows, or None."""
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def _chain(mount: CgroupMount, path: str) -> list[Path]:
    """The process's cgroup directory under `mount` and each one above it, up to the mount point.
    In a cgroup namespace the path is already relative to the mounted root."""
    relative = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        relative = path[len(mount.root):]
    directory = mount.point / relative.lstrip("/")
    chain = [directory]
    while directory != mount.point and mount.point in directory.parents:
        directory = directory.parent
        chain.append(directory)
    return chain


def cgroup_quota(proc: Path = Path("/proc/self")) -> float | None:
    """The smallest CPU quota on the path from this process's cgroups to their roots, or None."""
    try:
        mountinfo = (proc / "mountinfo").read_text()
        own = own_cgroup_paths((proc / "cgroup").read_text())
    except OSError:
        return None
    limits = [limit for mount in cgroup_cpu_mounts(mountinfo) if mount.version in own
              for directory in _chain(mount, own[mount.version])
              if (limit := _limit(directory, mount.version)) is not None]
    return min(limits, default=None)


def cpu_budget(proc: Path = Path("/proc/self")) -> CpuBudget:
    """The cores this process may run on (every core where the OS has no affinity masks) and its quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CpuBudget(affinity, cgroup_quota(proc))
