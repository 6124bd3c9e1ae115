"""The prepared GPU scripts run end to end in their --tiny CPU mode, so a GPU session finds them
working: every correctness check passes and speeds are printed; without a GPU, benchmarks/gpu_run.sh
stops at once and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO


def _run(module: str, tmp_path: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OUT"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--tiny", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_gpu_engine_tiny(tmp_path: Path) -> None:
    report = _run("gpu_engine", tmp_path, "--profile", "1", "--peer-concurrency", "4")
    assert report["all_passed"] and report["tiny"]
    assert json.loads((tmp_path / "gpu_engine.json").read_text()) == report
    # The dense model and the hybrid one (its linear-attention state slots beside the KV cache).
    assert [model["model"] for model in report["models"]] == ["tiny-qwen3", "tiny-qwen3.5-hybrid"]
    for model in report["models"]:
        assert model["check"]["passed"]
        assert model["check"]["greedy_cuda_graphs_off"]["matched_tokens"] == 24
        assert set(model["ours"]) == {"1", "4"} and set(model["hf_generate"]) == {"4"}
        for side in ("ours", "hf_generate"):
            assert all(v["output_tokens_per_s"] > 0 for v in model[side].values())
        assert all(v["decode_tokens_per_s"] > 0 for v in model["ours"].values())
        assert model["batch1_decode_roofline"]["fraction_of_roofline"] > 0
        assert model["headline"]["batch1_fraction_of_roofline"] > 0
        assert model["headline"]["c4_ttft_ms_p50"] > 0
        assert model["cuda_graphs"] == "not used on CPU"
        # Each level's bound: prefill and decode one after the other can only be slower.
        assert set(model["bounds"]) == {"1", "4"}
        for bound in model["bounds"].values():
            assert 0 < bound["output_tokens_per_s_serial"] <= bound["output_tokens_per_s_overlapped"]
        assert set(model["headline"]["c4_output_tokens_per_s_bound"]) == {"overlapped", "serial"}
        # Profiled decode steps at batch 1 (no kernels on CPU: the host ops are there).
        profile = model["step_profile"]["1"]
        assert profile["steps"] > 0 and profile["wall_ms"] > 0 and profile["top_host_ops"]


def test_time_bounds_count_every_weight_read_and_every_matmul() -> None:
    """The memory bound is `new` reads of the weights plus each decode's K/V, at the bandwidth; the
    compute bound 2 FLOPs per weight per token (the LM head at sampled rows only): each checked
    alone by making the other resource free, against sums taken from the model's own tensors."""
    from benchmarks.gpu_engine import time_bounds
    from benchmarks.gpu_models import TINY_QWEN3, build_pair

    _, checkpoint = build_pair("qwen3", TINY_QWEN3, "cpu", torch.float32)
    params = dict(checkpoint.model.named_parameters())
    embedding = params["model.embed_tokens.weight"].numel()
    head = params["lm_head.weight"].numel()
    read = sum(p.numel() for p in params.values()) - embedding  # floats one forward reads
    config = checkpoint.config
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    c, prompt, new, free = 3, 10, 5, 1e30
    contexts = sum(prompt + j for j in range(1, new))  # each decode's context, one sequence
    memory = time_bounds(checkpoint, c, prompt, new, bandwidth=1e9, flops=free)
    assert memory["overlapped_s"] == round((new * read * 4 + c * contexts * kv_per_token) / 1e9, 6)
    compute = time_bounds(checkpoint, c, prompt, new, bandwidth=free, flops=1e6)
    assert compute["overlapped_s"] == round(2 * c * ((read - head) * (prompt + new - 1) + head * new) / 1e6, 6)
    # One after the other, nothing hides: the same total either way when one resource is free.
    assert compute["serial_s"] == compute["overlapped_s"] and memory["serial_s"] == memory["overlapped_s"]
    assert memory["output_tokens_per_s_overlapped"] == pytest.approx(c * new / memory["overlapped_s"], rel=1e-3)
    # A compute-bound prefill and memory-bound decodes (5 FLOPs per byte lies between the two):
    # one after the other is longer by what the overlap would hide.
    both = time_bounds(checkpoint, c, prompt, new, bandwidth=1e9, flops=5e9)
    assert both["serial_s"] > both["overlapped_s"]


def test_gpu_kernels_tiny(tmp_path: Path) -> None:
    report = _run("gpu_kernels", tmp_path, "--only", "paged_attention,gated_delta_rule,kv_store")
    assert report["all_passed"]
    ops = {(r["op"], r["case"]) for r in report["results"]}
    assert ("paged_attention", "decode") in ops and ("gated_delta_rule", "chunk_prefill") in ops
    assert all(r["median_ms"]["triton"] > 0 for r in report["results"])


def test_gpu_run_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    """benchmarks/gpu_run.sh says why in one line and starts nothing (no install, no stage)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.strip().splitlines() == [
        f"gpu_run: no CUDA device for {sys.executable} (torch.cuda.is_available() is False): nothing run"]
    assert not (tmp_path / "out").exists()
