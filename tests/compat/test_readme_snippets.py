"""The README's Anthropic SDK example, run unchanged with the installed `anthropic` SDK (only its
URL and model pointed at the test system): the SDK no longer takes `temperature=` as a keyword,
so the example passes it through `extra_body`."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.system import System

README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(heading: str) -> str:
    section = README.read_text(encoding="utf-8").split(f"### {heading}\n", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, f"no python block under '{heading}'"
    return found.group(1)


def test_the_anthropic_example_runs_unchanged(system: System) -> None:
    code = snippet("Anthropic SDK")
    assert "http://127.0.0.1:8000" in code and "SmolLM2-135M-Instruct" in code
    code = code.replace("http://127.0.0.1:8000", system.base_url).replace("SmolLM2-135M-Instruct", system.model)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})  # the project's own example
    assert printed.getvalue().strip()
