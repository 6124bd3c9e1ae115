"""The model catalogue: which models a worker may load on request, from where, and what they need.

A TOML file (HELEXA_CATALOGUE), one table per served model id:

    [models."smollm2"]
    source = "default"        # an HF model directory, a .gguf file, or `default` (SmolLM2-135M)
    min_memory_mb = 600       # a worker must offer this much free memory to be asked to load it

Gateways read it to cold-start a model on its first request; workers read it to resolve a load.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SOURCE = "default"


@dataclass(slots=True, frozen=True)
class CatalogueEntry:
    model: str
    source: str
    min_memory_mb: int = 0


class CatalogueError(ValueError):
    """The catalogue file is missing or malformed; the message names the file and the entry."""


def load_catalogue(path: str | Path) -> dict[str, CatalogueEntry]:
    if not path:
        return {}
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CatalogueError(f"cannot read the catalogue {path}: {exc}") from None
    entries: dict[str, CatalogueEntry] = {}
    for model, table in raw.get("models", {}).items():
        if not isinstance(table, dict) or not isinstance(table.get("source"), str) or not table["source"]:
            raise CatalogueError(f"{path}: model {model!r} needs a `source` string")
        memory = table.get("min_memory_mb", 0)
        if not isinstance(memory, int) or memory < 0:
            raise CatalogueError(f"{path}: model {model!r}: min_memory_mb must be a non-negative integer")
        entries[model] = CatalogueEntry(model=model, source=table["source"], min_memory_mb=memory)
    return entries
