"""requirements.lock against pyproject.toml: `make setup` installs the lock with --no-deps, so the lock
alone must satisfy every requirement but torch's and triton's (installed apart, see tools.torch_pins),
including torch's own dependencies; and it must hold nothing of torch's CUDA stack."""

from __future__ import annotations

import tomllib
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO
from tools.audit_lock import read_lock
from tools.torch_pins import UNLOCKED, unlocked_requirements

LOCK = REPO / "requirements.lock"


def locked_versions() -> dict[str, list[str]]:
    pins, problems = read_lock(LOCK)
    assert not problems, [str(p) for p in problems]
    versions: dict[str, list[str]] = {}
    for pin in pins:
        versions.setdefault(pin.name, []).append(str(pin.version))
    return versions


def unmet(requirements: list[Requirement], versions: dict[str, list[str]]) -> list[str]:
    """The requirements that apply here and that no locked version of theirs satisfies."""
    return [
        str(r) for r in requirements
        if (r.marker is None or r.marker.evaluate({"extra": ""}))
        and not any(r.specifier.contains(v, prereleases=True) for v in versions.get(canonicalize_name(r.name), []))
    ]


def test_every_project_requirement_but_torch_and_triton_is_locked() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stated = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    locked = [r for r in stated if canonicalize_name(r.name) not in UNLOCKED]
    assert len(locked) == len(stated) - len(UNLOCKED)
    assert unmet(locked, locked_versions()) == []


def test_torch_dependencies_are_locked() -> None:
    torch_requires = [Requirement(r) for r in requires("torch") or []]
    assert torch_requires, "torch declares no dependencies here"
    assert unmet(torch_requires, locked_versions()) == []


def test_lock_holds_no_torch_triton_or_cuda_wheels() -> None:
    names = locked_versions()
    assert [n for n in names if n in UNLOCKED or n.startswith(("nvidia-", "cuda-"))] == []


def test_torch_and_triton_are_installed_at_their_pyproject_pins() -> None:
    assert [Requirement(r).name for r in unlocked_requirements()] == ["torch", "triton"]
    assert all("==" in r for r in unlocked_requirements())
