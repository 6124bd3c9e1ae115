"""Only the engine core's process imports torch: the bus, the gateway, the worker's asyncio side
and the engine's client and protocol never do (each import would cost seconds and memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

TORCH_FREE = [
    "apps.bus.wire", "apps.bus.topology", "apps.bus.publish", "apps.bus.codes", "apps.bus.pull",
    "engine.protocol", "engine.core_client", "engine.model_source", "engine.scripted", "engine.grammars",
    "apps.worker.process", "apps.worker.model_loop", "apps.worker.run", "apps.worker.liveness",
    "apps.worker.loading", "apps.worker.tool_grammar", "apps.worker.tokenizing", "apps.gateway.structured",
    "apps.gateway.app", "apps.recorder.app",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module: str) -> None:
    check = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
