"""The CPUs a process may use: cgroup v1 and v2 quotas read from a process's mounts and cgroup path
(a tree under tmp_path standing for /sys/fs/cgroup), the thread count they allow, torch's count
lowered to it and never raised; and once against the kernel, a child in a real cgroup with a quota."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.lib import cpu_quota_cgroup, in_cgroup
from engine.cpu.thread_governor import fit_torch_threads
from helexa_kernels.machine import CpuBudget, cgroup_quota

REPO = Path(__file__).resolve().parents[2]


def _proc(tmp_path: Path, mounts: list[str], cgroup: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mounts))
    (proc / "cgroup").write_text("".join(line + "\n" for line in cgroup))
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def _v2_mount(point: Path, root: str = "/") -> str:
    return f"41 31 0:38 {root} {point} rw,relatime - cgroup2 cgroup2 rw"


def _v1_mount(point: Path, controllers: str = "cpu,cpuacct", root: str = "/") -> str:
    return f"32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,{controllers}"


def test_v2_the_smallest_quota_from_the_own_cgroup_up_to_the_root_holds(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root, cpu_max="max 100000")
    _write(root / "kubepods", cpu_max="150000 100000")
    _write(root / "kubepods" / "pod1", cpu_max="400000 100000")
    _write(root / "kubepods" / "pod1" / "app", cpu_max="max 100000")
    proc = _proc(tmp_path, [_v2_mount(root)], ["0::/kubepods/pod1/app"])
    assert cgroup_quota(proc) == 1.5
    # An own cgroup with its own, tighter limit.
    _write(root / "kubepods" / "pod1" / "app", cpu_max="50000 100000")
    assert cgroup_quota(proc) == 0.5


def test_v1_cpu_hierarchy_mounted_at_the_containers_own_cgroup(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: the container's cgroup is what is mounted, and
    # /proc/self/cgroup still names it from the host's root.
    point = tmp_path / "cpu,cpuacct"
    _write(point, cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")
    mounts = [_v1_mount(tmp_path / "memory", "memory", "/docker/abc"), _v1_mount(point, root="/docker/abc")]
    proc = _proc(tmp_path, mounts, ["5:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"])
    assert cgroup_quota(proc) == 2.0


def test_no_quota_anywhere_and_unreadable_files_count_as_no_limit(tmp_path: Path) -> None:
    v1, v2 = tmp_path / "cpu", tmp_path / "unified"
    _write(v1, cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    _write(v2)  # a hybrid host's unified hierarchy carries no cpu controller
    _write(v2 / "broken", cpu_max="garbage")
    proc = _proc(tmp_path, [_v1_mount(v1, "cpu"), _v2_mount(v2)], ["1:cpu:/", "0::/broken"])
    assert cgroup_quota(proc) is None
    assert cgroup_quota(tmp_path / "no-such-proc") is None


def test_mount_points_with_escaped_spaces(tmp_path: Path) -> None:
    root = tmp_path / "cgroup root"
    _write(root / "a", cpu_max="300000 100000")
    line = _v2_mount(root).replace("cgroup root", "cgroup\\040root")
    assert cgroup_quota(_proc(tmp_path, [line], ["0::/a"])) == 3.0


def test_threads_the_budget_allows() -> None:
    assert CpuBudget(8, None).threads == 8
    assert CpuBudget(8, 0.5).threads == 1
    assert CpuBudget(8, 1.5).threads == 2  # a fraction rounds up; the governor measures whether 1 is faster
    assert CpuBudget(4, 64.0).threads == 4
    assert CpuBudget(8, 1.5).describe() == "8 cores in the affinity mask, a CPU quota of 1.5 CPUs"
    assert CpuBudget(1, 1.0).describe() == "1 core in the affinity mask, a CPU quota of 1 CPU"


def test_torchs_count_is_lowered_to_the_budget_and_never_raised() -> None:
    torch.set_num_threads(2)
    assert fit_torch_threads(CpuBudget(2, 0.5)) == 1
    assert torch.get_num_threads() == 1
    assert fit_torch_threads(CpuBudget(8, None)) == 1  # a count set lower on purpose stays


def test_an_engine_core_built_in_a_real_cgroup_with_one_cpu_runs_one_thread() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a quota cannot lower the count")
    # What the engine core's process does at start (`build_core`), in a process whose cgroup allows
    # one CPU of this machine's cores.
    child = ("import json, torch; from helexa_kernels.machine import cpu_budget; "
             "from engine.core.core_process import build_core; from engine.frontend.engine_config import EngineConfig; "
             "from engine.loading.default_model import default_model_path; "
             "before = torch.get_num_threads(); quota = cpu_budget().quota; "
             "core = build_core(EngineConfig(model=str(default_model_path()), max_num_seqs=1)); core.step(); "
             "print(json.dumps({'before': before, 'quota': quota, 'after': core.stats.cpu_threads}))")
    with cpu_quota_cgroup(1.0) as directory:
        if directory is None:
            pytest.skip("this machine lets no one make a cgroup with a CPU quota (needs root and cgroup v1's cpu)")
        result = subprocess.run(in_cgroup(directory, [sys.executable, "-c", child]), cwd=REPO, capture_output=True,
                                text=True, timeout=300, check=True)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["quota"] == 1.0
    assert seen["before"] >= 2 and seen["after"] == 1
