"""The model catalogue and the choice of which worker loads a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.bus import wire
from apps.fleet.catalogue import CatalogueEntry, CatalogueError, load_catalogue
from apps.fleet.control_client import choose_node


def test_catalogue_entries(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[models."a/b"]\nsource = "default"\nmin_memory_mb = 5\n[models.c]\nsource = "/m/c"\n')
    assert load_catalogue(path) == {"a/b": CatalogueEntry("a/b", "default", 5), "c": CatalogueEntry("c", "/m/c", 0)}
    assert load_catalogue("") == {}


@pytest.mark.parametrize("text, message", [
    ('[models.a]\nmin_memory_mb = 1\n', "needs a `source`"),
    ('[models.a]\nsource = "x"\nmin_memory_mb = -1\n', "min_memory_mb"),
    ('[models.a\n', "cannot read"),
])
def test_bad_catalogues_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(CatalogueError, match=message):
        load_catalogue(path)
    with pytest.raises(CatalogueError, match="cannot read"):
        load_catalogue(tmp_path / "missing.toml")


def node(name: str, free_mb: int, models: dict[str, str] | None = None) -> wire.NodeStatus:
    return wire.NodeStatus(node=name, version="t", memory_mb=free_mb, free_memory_mb=free_mb,
                           models=[wire.ModelStatus(model=m, state=s) for m, s in (models or {}).items()])


def test_the_worker_with_most_free_memory_that_fits_loads() -> None:
    entry = CatalogueEntry("m", "default", 500)
    nodes = [node("small", 400), node("big", 2000), node("mid", 900)]
    assert choose_node(nodes, "m", entry).node == "big"  # type: ignore[union-attr]
    assert choose_node([node("small", 400)], "m", entry) is None


def test_a_poisoned_copy_is_reloaded_where_it_is() -> None:
    nodes = [node("big", 9000), node("sick", 10, {"m": "poisoned"})]
    assert choose_node(nodes, "m", CatalogueEntry("m", "default", 500)).node == "sick"  # type: ignore[union-attr]
