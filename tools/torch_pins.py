"""The requirements that `make setup` installs apart from requirements.lock: torch and triton.

torch is pinned in pyproject.toml and installed by its own `pip install`, because the file pip takes
may be a local build (a CPU wheel on disk) whose hash is not PyPI's; triton comes with it. Their
own dependencies are in the lock. This prints their pyproject.toml lines, one a line, markers kept,
so the Makefile names no version of its own.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

UNLOCKED = ("torch", "triton")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def unlocked_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The project's torch and triton requirements, as written in pyproject.toml."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = [line for line in dependencies if canonicalize_name(Requirement(line).name) in UNLOCKED]
    names = sorted(canonicalize_name(Requirement(line).name) for line in found)
    if names != sorted(UNLOCKED):
        raise SystemExit(f"{pyproject}: expected one requirement each for {', '.join(UNLOCKED)}, found {names}")
    for line in found:
        if not any(spec.operator == "==" for spec in Requirement(line).specifier):
            raise SystemExit(f"{pyproject}: {line!r} must pin one release (==) to be installed apart from the lock")
    return found


def main() -> None:
    sys.stdout.write("".join(line + "\n" for line in unlocked_requirements()))


if __name__ == "__main__":
    main()
