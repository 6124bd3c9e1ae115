"""A grammar whose rules chain deeply, inside every bound (a JSON schema of 1,500 `$ref`s, 113 KB of
the 128 KB allowed), compiles in the threads that compile grammars (the gateway's and worker's
checker, the engine core's compiles) instead of overflowing the thread's stack: at 8 MiB a chain of
1,000 took the whole process down with SIGSEGV. Run in a child process, so that a regression fails
this test, not the test session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import asyncio, json, torch
from engine.core.structured_output import StructuredOutputs
from engine.frontend.grammars import GrammarChecker, bounds_error
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import StructuredOutput, StructuredOutputKind
from engine.loading.default_model import default_model_path

links = 1500
defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
defs[f"d{links}"] = {"type": "string"}
chain = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=json.dumps({"$ref": "#/$defs/d0", "$defs": defs}))
assert bounds_error(chain) is None, bounds_error(chain)
print("checked:", asyncio.run(GrammarChecker(deadline_s=120).error(chain)), flush=True)
tokenizer = load_tokenizer(default_model_path())[0]
outputs = StructuredOutputs(tokenizer, tokenizer.vocab_size, [0], 4, torch.device("cpu"), compile_budget_s=120)
compiled = outputs._pool.submit(outputs.compile, chain).result()
print("compiled:", type(compiled).__name__, flush=True)
"""


def test_a_deep_chain_of_rules_compiles_in_the_grammar_threads_without_killing_the_process() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["checked: None", "compiled: LLMatcher"]
