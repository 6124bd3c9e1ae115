"""How a benchmark hands its result over: the JSON printed, and written to `--out` when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
