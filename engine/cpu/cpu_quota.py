"""How many CPUs this process may use: the cores it may run on and its cgroup's CPU quota.

torch starts with one thread per core in the process's affinity mask, and knows nothing of a CPU
quota. A container limited to a few CPUs on a large host (Kubernetes' `resources.limits.cpu`,
`docker run --cpus`) keeps every core in its mask, so torch starts a thread per host core, and the
kernel stops the whole process for the rest of each period once the threads have used its quota
(the default model's decode step under a one-CPU quota on a 2-core EPYC: `docs/benchmarks.md`,
"Threads under a CPU quota"). `fit_torch_threads` lowers torch's count to what the process may use
before anything is measured (the dtype choice times linears at this count); the thread governor
(`engine.cpu.thread_governor`) goes on from there by measurement.

The quota is read the way the kernel applies it: every cgroup from the process's own up to the
hierarchy's root may limit it, so the smallest limit on that path holds. Both cgroup v2 (`cpu.max`,
"$QUOTA $PERIOD" or "max") and v1 (`cpu.cfs_quota_us` over `cpu.cfs_period_us`, -1 for none) are read,
where `/proc/self/mountinfo` says they are mounted. A fractional quota rounds up: 1.5 CPUs may run
two threads, each a share of the time, and the governor measures whether one is faster. Anything
unreadable counts as no limit.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("helexa.engine")


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
        limit = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g} CPUs"
        return f"{self.affinity} cores in the affinity mask, {limit}"


@dataclass(frozen=True, slots=True)
class _Mount:
    root: str  # the part of the hierarchy mounted here
    point: Path
    version: int  # 1 or 2


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), field)


def _cpu_mounts(mountinfo: str) -> list[_Mount]:
    """The cgroup mounts that carry the cpu controller (v1) and the unified hierarchies (v2)."""
    mounts = []
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, after = fields.split(), tail.split()
        if len(parts) < 5 or len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if fstype == "cgroup2":
            mounts.append(_Mount(_unescape(parts[3]), Path(_unescape(parts[4])), 2))
        elif fstype == "cgroup" and "cpu" in options:
            mounts.append(_Mount(_unescape(parts[3]), Path(_unescape(parts[4])), 1))
    return mounts


def _own_paths(proc_cgroup: str) -> dict[int, str]:
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


def _chain(mount: _Mount, path: str) -> list[Path]:
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
        own = _own_paths((proc / "cgroup").read_text())
    except OSError:
        return None
    limits = [limit for mount in _cpu_mounts(mountinfo) if mount.version in own
              for directory in _chain(mount, own[mount.version])
              if (limit := _limit(directory, mount.version)) is not None]
    return min(limits, default=None)


def cpu_budget(proc: Path = Path("/proc/self")) -> CpuBudget:
    return CpuBudget(len(os.sched_getaffinity(0)), cgroup_quota(proc))


def fit_torch_threads(budget: CpuBudget | None = None) -> int:
    """Lower torch's thread count to what this process may use (never raise it: a count set on
    purpose, `OMP_NUM_THREADS` or `torch.set_num_threads`, stays when it fits), and return it."""
    import torch

    budget = budget or cpu_budget()
    threads = torch.get_num_threads()
    if threads > budget.threads:
        log.info("CPU steps on %d threads, not torch's %d: %s", budget.threads, threads, budget.describe())
        torch.set_num_threads(budget.threads)
    return torch.get_num_threads()
