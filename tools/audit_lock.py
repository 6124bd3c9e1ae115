"""The dependency audit: requirements.lock's pins and pyproject.toml's floors against known advisories.

`make test` runs it before pytest, so CI fails on a known-vulnerable version. The advisories are the
checked-in table security/minimum_versions.toml: the services pip-audit asks (PyPI's per-release JSON,
OSV) are not reachable from every machine that runs the suite. Where pip-audit is installed and its
service answers, its report is printed as well, its findings fail the audit too, and the advisories
it names that the table lacks are listed, to be added to the table.

A pin fails when an advisory's affected ranges cover it; a floor fails when it is below the highest
release that fixes an advisory of its package, because every lower floor admits an affected version.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"
TABLE = REPO / "security" / "minimum_versions.toml"
# pip-audit asks its service once per package; a machine that cannot reach it should not wait long.
PIP_AUDIT_TIMEOUT_S = 60.0
_COMMENT = re.compile(r"(^|\s)#.*$")


@dataclass(frozen=True, slots=True)
class Advisory:
    """One table entry: the package versions its advisory ids cover, each range ending at a fix."""

    package: str
    ids: tuple[str, ...]
    affected: tuple[SpecifierSet, ...]
    summary: str

    def __post_init__(self) -> None:
        if not self.ids or not self.affected or not self.summary:
            raise ValueError(f"{self.package}: an advisory needs ids, affected ranges and a summary")
        for spec in self.affected:
            if not any(s.operator == "<" for s in spec):
                raise ValueError(f"{self.package} {self.ids}: range {spec} has no fixed release (<X)")

    def covers(self, version: Version) -> bool:
        return any(spec.contains(version, prereleases=True) for spec in self.affected)

    @property
    def fixed_in(self) -> list[Version]:
        """The releases that end the affected ranges, lowest first."""
        return sorted(Version(s.version) for spec in self.affected for s in spec if s.operator == "<")

    @property
    def minimum_safe(self) -> Version:
        """The lowest floor that admits no affected version."""
        return self.fixed_in[-1]

    def describe(self) -> str:
        ranges = " or ".join(",".join(str(s) for s in sorted(spec, key=lambda s: Version(s.version)))
                             for spec in self.affected)
        fixed = ", ".join(str(v) for v in self.fixed_in)
        return f"{', '.join(self.ids)} (affected {ranges}; fixed in {fixed}): {self.summary}"


@dataclass(frozen=True, slots=True)
class Pin:
    """One `name==version` line of the lock (continuations joined); `line` is where it starts."""

    name: str
    version: Version
    line: int


@dataclass(frozen=True, slots=True)
class Finding:
    """A failure of the audit: where, what, and why."""

    where: str
    subject: str
    reason: str

    def __str__(self) -> str:
        return f"FAIL {self.where}: {self.subject}: {self.reason}"


@dataclass(frozen=True, slots=True)
class PipAuditVuln:
    package: str
    version: str
    ids: tuple[str, ...]
    fix_versions: tuple[str, ...]


def load_advisories(path: Path = TABLE) -> list[Advisory]:
    entries = tomllib.loads(path.read_text()).get("advisory", [])
    advisories = []
    for entry in entries:
        try:
            advisories.append(Advisory(
                package=canonicalize_name(entry["package"]),
                ids=tuple(entry["ids"]),
                affected=tuple(SpecifierSet(text) for text in entry["affected"]),
                summary=entry["summary"],
            ))
        except (KeyError, InvalidSpecifier, ValueError) as exc:
            raise SystemExit(f"{path}: a bad entry {entry!r}: {exc}") from exc
    return advisories


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """The lock's requirement lines with comments dropped and backslash continuations joined."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw).rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        if pending.strip():
            lines.append((start, pending.strip()))
        pending = ""
    if pending.strip():
        lines.append((start, pending.strip()))
    return lines


def read_lock(path: Path) -> tuple[list[Pin], list[Finding]]:
    """The lock's pins, and a finding for each line that is not one pinned, hashed requirement."""
    pins: list[Pin] = []
    problems: list[Finding] = []
    for number, line in _logical_lines(path.read_text()):
        where = f"{_shown(path)}:{number}"
        if line.startswith("-"):
            problems.append(Finding(where, line.split()[0], "options are not audited; the lock holds only pins"))
            continue
        text = line.split(" --", 1)[0].strip()
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            problems.append(Finding(where, text, f"not a requirement: {exc}"))
            continue
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            problems.append(Finding(where, text, "not pinned to one release (name==version)"))
            continue
        if "--hash=" not in line:
            problems.append(Finding(where, text, "no --hash: pip --require-hashes would refuse the lock"))
        try:
            pins.append(Pin(canonicalize_name(requirement.name), Version(specs[0].version), number))
        except InvalidVersion as exc:
            problems.append(Finding(where, text, f"not a PEP 440 version: {exc}"))
    return pins, problems


def read_floors(path: Path) -> list[tuple[str, Requirement]]:
    """Every requirement pyproject.toml states (build system, dependencies, extras), with its table."""
    data = tomllib.loads(path.read_text())
    found: list[tuple[str, Requirement]] = []
    found += [("build-system.requires", Requirement(r)) for r in data.get("build-system", {}).get("requires", [])]
    project = data.get("project", {})
    found += [("project.dependencies", Requirement(r)) for r in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        found += [(f"project.optional-dependencies.{extra}", Requirement(r)) for r in requirements]
    return found


def lowest_admitted(spec: SpecifierSet) -> Version | None:
    """The lowest bound a specifier set puts on versions (`>X` counts as X), None when it has none."""
    bounds = []
    for s in spec:
        if s.operator in (">=", ">", "~=", "==", "==="):
            try:
                bounds.append(Version(s.version.removesuffix(".*")))
            except InvalidVersion:
                continue
    return max(bounds) if bounds else None


def audit_pins(pins: list[Pin], advisories: list[Advisory], lock: Path) -> list[Finding]:
    findings = []
    for pin in pins:
        for advisory in advisories:
            if advisory.package == pin.name and advisory.covers(pin.version):
                where = f"{_shown(lock)}:{pin.line}"
                findings.append(Finding(where, f"{pin.name}=={pin.version}", advisory.describe()))
    return findings


def audit_floors(floors: list[tuple[str, Requirement]], advisories: list[Advisory], pyproject: Path) -> list[Finding]:
    findings = []
    for table, requirement in floors:
        name = canonicalize_name(requirement.name)
        floor = lowest_admitted(requirement.specifier)
        for advisory in advisories:
            if advisory.package != name or (floor is not None and floor >= advisory.minimum_safe):
                continue
            admits = "every version" if floor is None else f"versions from {floor}"
            findings.append(Finding(
                f"{_shown(pyproject)} [{table}]", str(requirement),
                f"admits {admits}; raise the floor to >={advisory.minimum_safe}: {advisory.describe()}",
            ))
    return findings


def _pip_audit_command() -> list[str] | None:
    if importlib.util.find_spec("pip_audit") is not None:
        return [sys.executable, "-m", "pip_audit"]
    found = shutil.which("pip-audit")
    return [found] if found else None


def run_pip_audit(lock: Path, timeout_s: float) -> list[PipAuditVuln] | str:
    """pip-audit's findings on the lock, or why there are none to trust (a sentence)."""
    command = _pip_audit_command()
    if command is None:
        return "not installed"
    command += ["-r", str(lock), "--disable-pip", "--no-deps", "--format", "json",
                "--progress-spinner", "off", "--timeout", "10"]
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s:.0f} s"
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed (exit {result.returncode}): {tail[:300]}"
    dependencies = report.get("dependencies", [])
    skipped = [d for d in dependencies if d.get("skip_reason")]
    if not dependencies or len(skipped) == len(dependencies):
        reason = skipped[0]["skip_reason"] if skipped else "no dependencies audited"
        return f"its service audited no package ({reason[:200]})"
    if skipped:
        print(f"pip-audit: {len(skipped)} of {len(dependencies)} packages not audited, e.g. "
              f"{skipped[0]['name']}: {skipped[0]['skip_reason'][:200]}")
    return [
        PipAuditVuln(
            package=canonicalize_name(d["name"]), version=d["version"],
            ids=(vuln["id"], *vuln.get("aliases", [])), fix_versions=tuple(vuln.get("fix_versions", [])),
        )
        for d in dependencies if not d.get("skip_reason") for vuln in d.get("vulns", [])
    ]


def _shown(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def audit(lock: Path = LOCK, pyproject: Path = PYPROJECT, table: Path = TABLE,
          use_pip_audit: bool = True, pip_audit_timeout_s: float = PIP_AUDIT_TIMEOUT_S) -> int:
    """Runs the audit and prints its report; the exit status: 0 clean, 1 findings."""
    advisories = load_advisories(table)
    pins, findings = read_lock(lock)
    floors = read_floors(pyproject)
    print(f"audit: {len(pins)} pins in {_shown(lock)}, {len(floors)} requirements in {_shown(pyproject)}, "
          f"{len(advisories)} advisories in {_shown(table)}")
    findings += audit_pins(pins, advisories, lock) + audit_floors(floors, advisories, pyproject)

    if use_pip_audit:
        outcome = run_pip_audit(lock, pip_audit_timeout_s)
        if isinstance(outcome, str):
            print(f"pip-audit: {outcome}; the table decides alone")
        else:
            print(f"pip-audit: {len(outcome)} known vulnerabilities in the lock")
            known = {(a.package, i) for a in advisories for i in a.ids}
            for vuln in outcome:
                fixes = ", ".join(vuln.fix_versions) or "none yet"
                findings.append(Finding("pip-audit", f"{vuln.package}=={vuln.version}",
                                        f"{', '.join(vuln.ids)} (fixed in {fixes})"))
                if not any((vuln.package, i) in known for i in vuln.ids):
                    print(f"pip-audit: the table lacks {vuln.package} {', '.join(vuln.ids)} "
                          f"(fixed in {fixes}): add it to {_shown(table)}")

    for finding in findings:
        print(finding)
    if findings:
        print(f"audit: {len(findings)} findings")
        return 1
    print("audit: no pin or floor is covered by a known advisory")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.audit_lock", description=__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, default=LOCK)
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--no-pip-audit", action="store_true",
                        help="use the table alone, even where pip-audit is installed")
    parser.add_argument("--pip-audit-timeout", type=float, default=PIP_AUDIT_TIMEOUT_S, metavar="SECONDS")
    args = parser.parse_args(argv)
    sys.exit(audit(args.lock, args.pyproject, args.table, not args.no_pip_audit, args.pip_audit_timeout))


if __name__ == "__main__":
    main()
