"""What grammar masks cost per engine step: constrained and unconstrained rows in one batch, in process.

Workload (fixed): a batch of --rows requests on the default model (SmolLM2-135M), all decoding
for --tokens tokens (greedy; free rows ignore EOS, constrained rows follow a JSON schema of 40
digits that cannot close within that budget, so the batch never shrinks). Three batches:
  - free: every row unconstrained
  - mixed: half the rows constrained
  - constrained: every row constrained
Reported per batch, each the median over --runs runs: the median decode-step time (prefill steps
left out), the median time the masks took within a step (llguidance filling the bitmasks, then
torch applying them to the logits) and that per constrained row; ratios of step times to the free
batch, and of the masks' own time to a free step (the robust figure on a busy machine). Also the
grammar's compile time and the one-off llguidance tokenizer build.

Correctness gate, before any speed is printed: the free rows of the mixed batch produce the same
greedy tokens as in the free batch, and constrained requests run to completion produce JSON that
validates against their schema (jsonschema), for the digits schema and a nested object schema.

    python -m benchmarks.structured_outputs --runs 3 --out benchmarks/results/structured_outputs-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import torch

from benchmarks.lib import emit
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRequest, FinishReason, SamplingParams, StructuredOutput
from engine.frontend.protocol import StructuredOutputKind as Kind
from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint

DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40, "maxItems": 40}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
TOPICS = ["the sea", "owls", "bread", "a red bicycle", "prime numbers", "winter", "trains", "tea",
          "volcanoes", "chess", "rain", "bees", "maps", "clocks", "salt", "bridges"]


def json_constraint(schema: dict) -> StructuredOutput:
    return StructuredOutput(kind=Kind.JSON_SCHEMA, spec=json.dumps(schema))


def chat(checkpoint: Checkpoint, question: str) -> list[int]:
    tokenizer = checkpoint.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]),
                            add_special_tokens=False)


class TimedMasks:
    """Wraps the core's mask hook to time it (the device is synced so the time is the mask's)."""

    def __init__(self, core: EngineCore, sync: Callable[[], None]) -> None:
        self.inner, self.sync, self.structured = core.runner.mask_logits, sync, core.structured
        self.last_s = self.last_fill_s = 0.0
        core.runner.mask_logits = self

    def __call__(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        self.sync()
        start, fill_before = time.perf_counter(), self.structured.fill_s
        self.inner(logits, request_ids)
        self.sync()
        self.last_s = time.perf_counter() - start
        self.last_fill_s = self.structured.fill_s - fill_before


def run_batch(core: EngineCore, requests: list[EngineRequest], sync: Callable[[], None]) -> dict:
    """Step until done; per decode step its wall time and the time its masks took."""
    timer = core.runner.mask_logits if isinstance(core.runner.mask_logits, TimedMasks) else TimedMasks(core, sync)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: dict[str, FinishReason | None] = {}
    for request in requests:
        core.add_request(request)
    step_s, mask_s, fill_s = [], [], []
    first = True
    while core.has_work():
        timer.last_s = timer.last_fill_s = 0.0
        sync()
        start = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - start
        if not first and len(core.scheduler.running) == len(requests):
            step_s.append(elapsed)
            mask_s.append(timer.last_s)
            fill_s.append(timer.last_fill_s)
        first = False
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
    return {"tokens": tokens, "finals": finals, "step_s": step_s, "mask_s": mask_s, "fill_s": fill_s}


def batch(checkpoint: Checkpoint, rows: int, constrained_rows: int, max_tokens: int) -> list[EngineRequest]:
    """`rows` requests, `constrained_rows` of them (odd positions first) held to the digits schema."""
    order = list(range(1, rows, 2)) + list(range(0, rows, 2))
    constrained = set(order[:constrained_rows])
    requests = []
    for i in range(rows):
        topic = TOPICS[i % len(TOPICS)]
        if i in constrained:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=json_constraint(DIGITS))
            requests.append(EngineRequest(f"c{i}", chat(checkpoint, f"Forty digits about {topic}."), sampling))
        else:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            requests.append(EngineRequest(f"f{i}", chat(checkpoint, f"Write about {topic}."), sampling))
    return requests


def completion_check(core: EngineCore, checkpoint: Checkpoint, sync: Callable[[], None]) -> list[str]:
    """Constrained requests run to the end: every output must validate against its schema."""
    failures = []
    cases = [("digits", DIGITS, "Forty digits, please."), ("person", PERSON, "Describe a person as JSON.")]
    requests, schemas = [], {}
    for name, schema, question in cases:
        for i, temperature in enumerate((0.0, 1.0)):
            request_id = f"{name}-{i}"
            schemas[request_id] = schema
            requests.append(EngineRequest(request_id, chat(checkpoint, question), SamplingParams(
                max_tokens=256, temperature=temperature, seed=i, structured=json_constraint(schema))))
    result = run_batch(core, requests, sync)
    for request_id, schema in schemas.items():
        text = checkpoint.tokenizer.decode(result["tokens"][request_id], skip_special_tokens=True)
        try:
            if result["finals"][request_id] is not FinishReason.STOP:
                raise ValueError(f"finished with {result['finals'][request_id]}")
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{request_id}: {exc}: {text[:120]!r}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    checkpoint = load_checkpoint(default_model_path(), dtype=dtype, device=device)
    config = EngineConfig(model="in-memory", max_num_seqs=args.rows, max_num_batched_tokens=4096,
                          enable_prefix_caching=False, device=device.type)
    core = EngineCore(checkpoint, config)

    start = time.perf_counter()
    ll_tokenizer = core.structured.ll_tokenizer
    tokenizer_ms = (time.perf_counter() - start) * 1000.0
    compile_ms = []
    for _ in range(20):
        start = time.perf_counter()
        compiled = core.structured.compile(json_constraint(PERSON))  # uncached: the compile itself
        compile_ms.append((time.perf_counter() - start) * 1000.0)
        assert not isinstance(compiled, str), compiled

    failures = completion_check(core, checkpoint, sync)
    shapes = {"free": 0, "mixed": args.rows // 2, "constrained": args.rows}
    runs: dict[str, list[dict]] = {name: [] for name in shapes}
    run_batch(core, batch(checkpoint, args.rows, 0, 4), sync)  # warm-up
    for _ in range(args.runs):
        for name, constrained_rows in shapes.items():
            runs[name].append(run_batch(core, batch(checkpoint, args.rows, constrained_rows, args.tokens), sync))
    free_tokens = runs["free"][0]["tokens"]
    for result in runs["mixed"]:
        for request_id, tokens in result["tokens"].items():
            if request_id.startswith("f") and tokens != free_tokens[request_id]:
                failures.append(f"{request_id}: free row's greedy tokens changed beside constrained rows")
    for name, results in runs.items():
        if any(len(r["step_s"]) < args.tokens // 2 for r in results):
            failures.append(f"{name}: the batch shrank before {args.tokens // 2} decode steps")

    report: dict = {
        "benchmark": "structured_outputs",
        "inputs": {"model": checkpoint.model_id, "rows": args.rows, "decode_tokens": args.tokens, "runs": args.runs,
                   "schema_timed": "40 digits (JSON array)", "constrained_rows": shapes,
                   "llguidance_vocab": ll_tokenizer.vocab_size},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype)},
    }
    if failures:
        report["correctness"] = {"ok": False, "failures": failures}
        print(json.dumps(report, indent=2))
        sys.exit(1)
    report["correctness"] = {"ok": True, "checks": ["free rows' greedy tokens unchanged in the mixed batch",
                                                    "completed constrained outputs validate (digits, person)"]}
    medians = {}
    for name, results in runs.items():
        step_ms = statistics.median(statistics.median(r["step_s"]) * 1000.0 for r in results)
        mask_ms = statistics.median(statistics.median(r["mask_s"]) * 1000.0 for r in results)
        fill_ms = statistics.median(statistics.median(r["fill_s"]) * 1000.0 for r in results)
        rows = shapes[name]
        medians[name] = {"step_ms": round(step_ms, 3), "mask_ms": round(mask_ms, 4),
                         "llguidance_fill_ms": round(fill_ms, 4),
                         "mask_ms_per_constrained_row": round(mask_ms / rows, 4) if rows else None,
                         "fill_us_per_constrained_row": round(fill_ms * 1000.0 / rows, 2) if rows else None,
                         "mask_share_of_step": round(mask_ms / step_ms, 4)}
    report["medians"] = {**medians, "grammar_compile_ms": round(statistics.median(compile_ms), 3),
                         "llguidance_tokenizer_ms": round(tokenizer_ms, 1)}
    free = medians["free"]["step_ms"]
    # Step-time ratios carry the machine's noise; the masks' own time against a free step does not.
    report["ratios"] = {"mixed_vs_free_step": round(medians["mixed"]["step_ms"] / free, 3),
                        "constrained_vs_free_step": round(medians["constrained"]["step_ms"] / free, 3),
                        "mixed_masks_vs_free_step": round(medians["mixed"]["mask_ms"] / free, 4),
                        "constrained_masks_vs_free_step": round(medians["constrained"]["mask_ms"] / free, 4)}
    emit(report, args.out)


if __name__ == "__main__":
    main()
