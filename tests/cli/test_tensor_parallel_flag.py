"""`--tensor-parallel N` on `helexa worker` and `helexa up` is HELEXA_TENSOR_PARALLEL: checked the same
way, and handed to the worker `up` starts."""

from __future__ import annotations

import subprocess
import sys

from apps.cli import build_parser


def test_a_bad_rank_count_is_refused_in_one_line_before_anything_starts() -> None:
    done = subprocess.run([sys.executable, "-m", "apps.cli", "worker", "--tensor-parallel", "0"],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                            "NATS_URL": "nats://127.0.0.1:1"})
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == "helexa worker: HELEXA_TENSOR_PARALLEL must be between 1 and 64"


def test_both_commands_take_the_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["worker", "--tensor-parallel", "3"]).tensor_parallel == 3
    assert parser.parse_args(["up", "--tensor-parallel", "3"]).tensor_parallel == 3
    assert parser.parse_args(["up"]).tensor_parallel is None
