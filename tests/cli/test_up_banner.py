"""What `helexa up` prints once it is up: a bounded example, where the URLs are, the worker's dtype."""

from __future__ import annotations

import json
import re
from pathlib import Path

from apps import up


def _curl_body(text: str) -> dict:
    found = re.search(r"-d '(.+)'", text)
    assert found, text
    return json.loads(found.group(1))


def test_the_banner_example_is_greedy_and_bounded_and_points_to_the_env_file(tmp_path: Path) -> None:
    banner = up.banner("http://127.0.0.1:8000", "m", tmp_path / "env", {"model": "m"}, [])
    body = _curl_body(banner)
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("m", 0, up.SAMPLE_MAX_TOKENS)
    assert f"source {tmp_path / 'env'}" in banner
    assert re.search(r"^    \S*helexa bus sub ", banner, re.MULTILINE), banner
    assert "dtype" not in banner  # a worker that does not say


def test_the_banner_shows_the_workers_dtype_choice_and_its_reason(tmp_path: Path) -> None:
    worker = {"model": "m", "dtype": "float32", "dtype_reason": "bf16 unsupported here (no avx512_bf16)"}
    banner = up.banner("http://127.0.0.1:8000", "m", tmp_path / "env", worker, [])
    assert "  dtype: float32 (bf16 unsupported here (no avx512_bf16))\n" in banner


def test_the_banner_keeps_the_reason_short_and_leaves_the_cpu_flags_to_the_log(tmp_path: Path) -> None:
    reason = "measured on this machine: bfloat16 at 0.31x float32's time; CPU: " + "avx512f " * 40
    worker = {"model": "m", "dtype": "bfloat16", "dtype_reason": reason}
    banner = up.banner("http://127.0.0.1:8000", "m", tmp_path / "env", worker, [])
    assert "  dtype: bfloat16 (measured on this machine: bfloat16 at 0.31x float32's time)\n" in banner
    long = {"model": "m", "dtype": "float32", "dtype_reason": "x" * 1000}
    line = next(line for line in up.banner("u", "m", tmp_path / "env", long, []).splitlines() if "dtype" in line)
    assert len(line) < up.BANNER_REASON_CHARS + 40
