"""Only the engine core's process imports torch: the bus, the gateway, the worker's asyncio side
and the engine's frontend (`engine/frontend`: every module in it, found by walking the package)
never do (each import would cost seconds and memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

FRONTEND = REPO / "engine" / "frontend"


def frontend_modules() -> list[str]:
    return sorted(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for path in FRONTEND.rglob("*.py"))


TORCH_FREE = [
    *frontend_modules(),
    "apps.bus.wire", "apps.bus.topology", "apps.bus.publish", "apps.bus.codes", "apps.bus.pull",
    "apps.worker.process", "apps.worker.model_loop", "apps.worker.run", "apps.worker.liveness",
    "apps.worker.loading", "apps.worker.tool_grammar", "apps.worker.tokenizing", "apps.gateway.api.structured",
    "apps.gateway.app", "apps.recorder.app",
]


def test_the_frontend_is_walked() -> None:
    assert {"engine.frontend", "engine.frontend.protocol", "engine.frontend.core_client"} <= set(frontend_modules())


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module: str) -> None:
    check = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
