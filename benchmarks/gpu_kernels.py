"""Kernel benchmark: each Triton op in helexa_kernels/ against its PyTorch reference, at real sizes.

For every case the script first runs the Triton op and each baseline on fresh copies of the same
inputs and compares every output (relative error ‖a − b‖ / ‖b‖ against the first baseline, the
op's naive.py reference). A case whose outputs fail the comparison gets no speed printed: its
timings are withheld and the script exits non-zero. Timings are medians over --runs runs, each
the mean of --iters calls (CUDA events on a GPU). In-place ops (KV store, state slots) are timed
on buffers they keep updating; only the first, checked call starts from the fresh copies.

Sizes are those of Qwen3-8B (attention, MLP, norms), Qwen3-Next-80B-A3B's linear-attention
layers (16 key / 32 value heads of 128, conv width 4) and Qwen3-30B-A3B's experts (128, top 8).

    python -m benchmarks.gpu_kernels --out benchmarks/results/gpu_kernels-h200.json   # on the GPU
    python -m benchmarks.gpu_kernels --tiny                                       # CPU smoke test

--tiny shrinks every shape so the whole set runs in seconds in Triton's CPU interpreter.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Before triton is imported: without a GPU the kernels only run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from benchmarks.lib import emit
from engine.runner import ops
from engine.runner.attention import AttentionMetadata
from engine.runner.attention import paged_attention as engine_paged_attention
from helexa_kernels import (
    causal_conv1d,
    gated_delta_rule,
    gdn_gating,
    kv_store,
    moe,
    paged_attention,
    rmsnorm,
    rotary,
    silu_and_mul,
)

Outputs = tuple[torch.Tensor, ...]


@dataclass
class Case:
    op: str
    name: str
    inputs: dict[str, object]
    triton: Callable[[], Outputs]
    baselines: dict[str, Callable[[], Outputs]]  # the first is the reference for the check
    tolerance: float
    reset: Callable[[], None] = lambda: None  # restore in-place buffers before the checked call
    extra: dict[str, object] = field(default_factory=dict)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


def _cu(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _stateful(buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Working copies of in-place buffers, and a reset back to the originals."""
    work = [b.clone() for b in buffers]

    def reset() -> None:
        for w, b in zip(work, buffers, strict=True):
            w.copy_(b)
    return work, reset


def norm_cases(s: dict, dev: str, dt: torch.dtype) -> list[Case]:
    T, H = s["tokens"], s["hidden"]
    x, res = torch.randn(T, H, device=dev, dtype=dt), torch.randn(T, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt) * 0.1
    (r_t, r_n), reset = _stateful([res, res])
    rows, hd = T * s["v_heads"] // 8, s["head_dim"]
    xg, zg = torch.randn(rows, hd, device=dev, dtype=dt), torch.randn(rows, hd, device=dev, dtype=dt)
    wg = torch.randn(hd, device=dev, dtype=dt)
    return [
        Case("rmsnorm", "fused_add_1+w", {"x": [T, H], "dtype": str(dt)},
             lambda: rmsnorm.fused_add_rms_norm(x, r_t, w, unit_offset=True),
             {"naive": lambda: rmsnorm.naive_fused_add_rms_norm(x, r_n, w, unit_offset=True)},
             _tol(dt), reset),
        Case("rmsnorm", "gated", {"x": [rows, hd], "dtype": str(dt)},
             lambda: (rmsnorm.gated_rms_norm(xg, zg, wg),),
             {"naive": lambda: (rmsnorm.naive_gated_rms_norm(xg, zg, wg),)}, _tol(dt)),
    ]


def elementwise_cases(s: dict, dev: str, dt: torch.dtype) -> list[Case]:
    T = s["tokens"]
    x = torch.randn(T, 2 * s["intermediate"], device=dev, dtype=dt)
    q = torch.randn(T, s["heads"], s["head_dim"], device=dev, dtype=dt)
    k = torch.randn(T, s["kv_heads"], s["head_dim"], device=dev, dtype=dt)
    pos = torch.randint(0, s["max_position"], (T,), device=dev)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, s["head_dim"] // 2, 2, device=dev) / (s["head_dim"] // 2))
    cache = rotary.build_cos_sin_cache(inv_freq, s["max_position"])  # partial: half the head
    hv = s["v_heads"]
    A_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    a, b = torch.randn(T, hv, device=dev, dtype=dt), torch.randn(T, hv, device=dev, dtype=dt)
    return [
        Case("silu_and_mul", "mlp", {"x": list(x.shape), "dtype": str(dt)},
             lambda: (silu_and_mul.silu_and_mul(x),),
             {"naive": lambda: (silu_and_mul.naive_silu_and_mul(x),)}, _tol(dt)),
        Case("rotary", "partial_half", {"q": list(q.shape), "k": list(k.shape),
                                        "rotary_dim": cache.shape[1], "dtype": str(dt)},
             lambda: rotary.rotary(q, k, pos, cache),
             {"naive": lambda: rotary.naive_rotary(q, k, pos, cache)}, _tol(dt)),
        Case("gdn_gating", "gates", {"a": [T, hv]},
             lambda: gdn_gating.gdn_gating(A_log, a, b, dt_bias),
             {"naive": lambda: gdn_gating.naive_gdn_gating(A_log, a, b, dt_bias)}, 1e-5),
    ]


def attention_cases(s: dict, dev: str, dt: torch.dtype) -> list[Case]:
    """Paged attention against its reference and the engine's SDPA path. Decode at batch 1 is
    timed with the key split (split-K) and without it; the chunk continuations and the mixed
    step also as `engine.runner.ops` routes them on the Triton path (long chunks through SDPA)."""
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], 16
    decodes, context, prefill = s["decode_seqs"], s["context"], s["prefill_len"]
    cases = []
    for name, q_lens, seq_lens in (("decode", [1] * decodes, [context] * decodes),
                                   ("decode_batch1", [1], [context]),
                                   ("prefill", [prefill] * 4, [prefill] * 4),
                                   ("chunked", [prefill // 2] * 2, [context] * 2),
                                   ("mixed", [1] * decodes + [prefill // 2],
                                    [context] * decodes + [context])):
        blocks = [-(-n // bs) for n in seq_lens]
        ids = torch.randperm(sum(blocks)).tolist()
        tables = [ids[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(blocks))]
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs, dev)
        k_cache = torch.randn(sum(blocks), bs, hk, d, device=dev, dtype=dt)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=dt)
        args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, d ** -0.5)
        baselines = {"naive": lambda q=q, k=k_cache, v=v_cache, a=args:
                     (paged_attention.naive_paged_attention(q, k, v, *a),),
                     "engine_sdpa": lambda q=q, k=k_cache, v=v_cache, m=meta:
                     (engine_paged_attention(q, k, v, m, d ** -0.5),)}
        if name == "decode_batch1":
            baselines["triton_one_split"] = lambda q=q, k=k_cache, v=v_cache, a=args: (
                paged_attention.paged_attention(q, k, v, *a, num_splits=1),)
        if name in ("chunked", "mixed"):
            baselines["engine_routed"] = lambda q=q, k=k_cache, v=v_cache, m=meta: (
                ops.paged_attention(q, k, v, m, d ** -0.5),)
        cases.append(Case(
            "paged_attention", name, {"q_lens": _summary(q_lens), "seq_lens": _summary(seq_lens),
                                      "heads": hq, "kv_heads": hk, "head_dim": d, "dtype": str(dt)},
            lambda q=q, k=k_cache, v=v_cache, a=args: (paged_attention.paged_attention(q, k, v, *a),),
            baselines, _tol(dt)))
    T = s["tokens"]
    kn, vn = torch.randn(T, hk, d, device=dev, dtype=dt), torch.randn(T, hk, d, device=dev, dtype=dt)
    slots = torch.randperm(T * 2, device=dev)[:T]
    caches = [torch.zeros(T * 2 // bs, bs, hk, d, device=dev, dtype=dt) for _ in range(4)]

    def store(fn, kc, vc):
        fn(kn, vn, kc, vc, slots)
        return kc, vc
    cases.append(Case("kv_store", "prefill", {"k": [T, hk, d], "dtype": str(dt)},
                      lambda: store(kv_store.kv_store, *caches[:2]),
                      {"naive": lambda: store(kv_store.naive_kv_store, *caches[2:])}, 0.0))
    return cases


def _summary(lens: list[int]) -> str:
    return f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else str(lens)


def _gdn_case(name: str, lens: list[int], s: dict, dev: str, dt: torch.dtype) -> Case:
    hk, hv, dk, dv, slots = s["k_heads"], s["v_heads"], s["head_dim"], s["head_dim"], s["slots"]
    T, chunked = sum(lens), name == "chunk_prefill"
    q, k = (torch.randn(T, hk, dk, device=dev, dtype=dt) for _ in range(2))
    v = torch.randn(T, hv, dv, device=dev, dtype=dt)
    g = -torch.rand(T, hv, device=dev) * 0.1
    beta = torch.rand(T, hv, device=dev)
    state = torch.randn(slots, hv, dk, dv, device=dev) * 0.05
    idx = torch.randperm(slots, device=dev)[:len(lens)]
    cu = _cu(lens, dev) if chunked else None
    (s_t, s_n), reset = _stateful([state, state])
    op = gated_delta_rule.chunk_gated_delta_rule if chunked else gated_delta_rule.recurrent_gated_delta_rule
    ref = (gated_delta_rule.naive_chunk_gated_delta_rule if chunked
           else gated_delta_rule.naive_recurrent_gated_delta_rule)
    baselines = {"naive": lambda: (ref(q, k, v, g, beta, s_n, idx, cu), s_n[idx])}
    fla = _fla(q, k, v, g, beta, state, idx, cu if chunked else _cu([1] * len(lens), dev), chunked)
    if fla is not None:
        baselines["fla_core"] = fla
    if chunked:  # the other chunked form (`triton` is wy with V tiles of 64, which beat 32 on the H200:
        # 0.78 against 0.88 ms, benchmarks/results/gpu-h200-2026-12-04-third)
        baselines["triton_inline"] = lambda: (op(q, k, v, g, beta, s_t, idx, cu, form="inline"),
                                              s_t[idx])
    return Case("gated_delta_rule", name, {"seqs": _summary(lens), "k_heads": hk, "v_heads": hv,
                                           "head_dim": dk, "dtype": str(dt)},
                lambda: (op(q, k, v, g, beta, s_t, idx, cu), s_t[idx]), baselines, _tol(dt), reset)


def gdn_cases(s: dict, dev: str, dt: torch.dtype) -> list[Case]:
    hk, hv, dk, dv, slots = s["k_heads"], s["v_heads"], s["head_dim"], s["head_dim"], s["slots"]
    cases = [_gdn_case("chunk_prefill", [s["gdn_len"]] * 4, s, dev, dt),
             _gdn_case("recurrent_decode", [1] * s["decode_seqs"], s, dev, dt)]
    D, W = 2 * hk * dk + hv * dv, 4
    lens = [s["gdn_len"]] * 4
    x = torch.randn(sum(lens), D, device=dev, dtype=dt)
    w = torch.randn(D, W, device=dev, dtype=dt)
    conv = torch.randn(slots, D, W - 1, device=dev, dtype=dt)
    idx = torch.randperm(slots, device=dev)[:len(lens)]
    (c_t, c_n), reset = _stateful([conv, conv])
    cases.append(Case("causal_conv1d", "prefill", {"x": list(x.shape), "width": W, "dtype": str(dt)},
                      lambda: (causal_conv1d.causal_conv1d(x, w, None, c_t, idx, _cu(lens, dev)), c_t),
                      {"naive": lambda: (causal_conv1d.naive_causal_conv1d(
                          x, w, None, c_n, idx, _cu(lens, dev)), c_n)}, _tol(dt), reset))
    xd = torch.randn(s["decode_seqs"], D, device=dev, dtype=dt)
    idx_d = torch.randperm(slots, device=dev)[:s["decode_seqs"]]
    (d_t, d_n), reset_d = _stateful([conv, conv])
    cases.append(Case("causal_conv1d", "update", {"x": list(xd.shape), "width": W, "dtype": str(dt)},
                      lambda: (causal_conv1d.causal_conv1d_update(xd, w, None, d_t, idx_d), d_t),
                      {"naive": lambda: (causal_conv1d.naive_causal_conv1d_update(
                          xd, w, None, d_n, idx_d), d_n)}, _tol(dt), reset_d))
    return cases


def _fla(q, k, v, g, beta, state, idx, cu, chunked: bool) -> Callable[[], Outputs] | None:
    """fla-core's chunked (prefill) or fused recurrent (decode) gated delta rule on the same
    problem, when it is installed (GPU only; benchmarks/gpu_run.sh says how to carry the wheel)."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    fla_op = chunk_gated_delta_rule if chunked else fused_recurrent_gated_delta_rule
    group = v.shape[1] // q.shape[1]
    # fla-core takes [1, T, H, D] with cu_seqlens, and q/k on every value head.
    qf, kf = (t.repeat_interleave(group, dim=1)[None] for t in (q, k))
    init = state[idx].clone()

    def run() -> Outputs:
        # Keywords: the two ops order their optional gates differently.
        o, final = fla_op(qf, kf, v[None], g=g[None], beta=beta[None], initial_state=init,
                          output_final_state=True, cu_seqlens=cu.long(),
                          use_qk_l2norm_in_kernel=True)
        return o[0], final
    return run


def moe_cases(s: dict, dev: str, dt: torch.dtype) -> list[Case]:
    T, E, K, H, inter = s["moe_tokens"], s["experts"], s["top_k"], s["moe_hidden"], s["moe_inter"]
    logits = torch.randn(T, E, device=dev)
    x = torch.randn(T, H, device=dev, dtype=dt)
    w13 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * H ** -0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt) * inter ** -0.5
    weights, ids = moe.naive_moe_routing(logits, K, True)
    return [
        Case("moe", "routing", {"logits": [T, E], "top_k": K},
             lambda: moe.moe_routing(logits, K, True),
             {"naive": lambda: moe.naive_moe_routing(logits, K, True)}, 1e-5),
        Case("moe", "fused_moe", {"x": [T, H], "experts": E, "top_k": K, "intermediate": inter,
                                  "dtype": str(dt)},
             lambda: (moe.fused_moe(x, w13, w2, weights, ids),),
             {"naive": lambda: (moe.naive_fused_moe(x, w13, w2, weights, ids),)}, _tol(dt)),
    ]


FULL = {"tokens": 4096, "hidden": 4096, "intermediate": 12288, "heads": 32, "kv_heads": 8,
        "head_dim": 128, "max_position": 32768, "decode_seqs": 64, "context": 4096,
        "prefill_len": 1024, "k_heads": 16, "v_heads": 32, "slots": 256, "gdn_len": 2048,
        "moe_tokens": 512, "experts": 128, "top_k": 8, "moe_hidden": 2048, "moe_inter": 768}
TINY = {"tokens": 16, "hidden": 64, "intermediate": 48, "heads": 4, "kv_heads": 2,
        "head_dim": 16, "max_position": 64, "decode_seqs": 3, "context": 40, "prefill_len": 24,
        "k_heads": 1, "v_heads": 2, "slots": 8, "gdn_len": 20, "moe_tokens": 8, "experts": 6,
        "top_k": 2, "moe_hidden": 32, "moe_inter": 16}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], Outputs], runs: int, iters: int) -> float:
    fn()  # warm-up (and Triton's compile)
    samples = []
    for _ in range(runs):
        _sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def run_case(case: Case, runs: int, iters: int) -> dict[str, object]:
    entry: dict[str, object] = {"op": case.op, "case": case.name, "inputs": case.inputs,
                                "tolerance": case.tolerance}
    reference = next(iter(case.baselines))
    try:
        case.reset()
        outputs = {"triton": [t.clone() for t in case.triton()]}
        case.reset()
        outputs[reference] = [t.clone() for t in case.baselines[reference]()]
        _sync()
    except Exception as exc:  # report the failure, keep benchmarking the rest
        entry.update(passed=False, error=f"{type(exc).__name__}: {exc}")
        return entry
    errors = {f"out{i}": _rel_err(a, b) for i, (a, b) in
              enumerate(zip(outputs["triton"], outputs[reference], strict=True))}
    entry["rel_err_vs_" + reference] = errors
    entry["passed"] = passed = all(e <= case.tolerance for e in errors.values())
    if not passed:
        entry["median_ms"] = None
        entry["speed_withheld"] = "output failed its comparison with " + reference
        return entry
    baselines = {reference: case.baselines[reference]}
    for name, fn in list(case.baselines.items())[1:]:
        # Other baselines (fla-core) are compared for the record; one that fails is left out.
        try:
            case.reset()
            theirs = [t.clone() for t in fn()]
            entry["rel_err_vs_" + name] = {f"out{i}": _rel_err(a, b) for i, (a, b) in
                                           enumerate(zip(outputs["triton"], theirs, strict=True))}
            baselines[name] = fn
        except Exception as exc:
            entry.setdefault("baseline_errors", {})[name] = f"{type(exc).__name__}: {exc}"
    timings = {"triton": _time_ms(case.triton, runs, iters)}
    for name, fn in baselines.items():
        timings[name] = _time_ms(fn, runs, iters)
    entry["median_ms"] = timings
    entry["speedup_vs"] = {name: timings[name] / timings["triton"] for name in baselines}
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke test)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated ops to run (default: all)")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        parser.error("full sizes need a GPU; use --tiny for the CPU smoke test")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = TINY if args.tiny else FULL
    runs, iters = (1, 1) if args.tiny else (args.runs, args.iters)
    # engine.runner.ops as a GPU engine runs it (the Triton path), here in the interpreter too.
    ops.use_backend("triton")
    torch.manual_seed(0)
    cases: list[Case] = []
    # Attention and the delta rule first: what a run cut short by its time limit still measures.
    for build in (attention_cases, gdn_cases, norm_cases, elementwise_cases, moe_cases):
        cases += build(sizes, dev, torch.bfloat16)
    if args.tiny:  # fp32 too: the interpreter's cheap, and it checks the exact-precision path
        cases += gdn_cases(sizes, dev, torch.float32)
    only = {o for o in args.only.split(",") if o}
    results: list[dict[str, object]] = []
    report = {
        "benchmark": "gpu_kernels", "tiny": args.tiny, "runs": runs, "iters": iters,
        "machine": {
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)",
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "cpu_count": os.cpu_count(),
        },
        "sizes": sizes, "results": results,
    }
    for case in cases:
        if only and case.op not in only:
            continue
        entry = run_case(case, runs, iters)
        print(f"{case.op}/{case.name}: {'ok' if entry['passed'] else 'FAILED'} "
              f"{entry.get('speedup_vs', entry.get('error', entry.get('speed_withheld')))}",
              file=sys.stderr, flush=True)
        results.append(entry)
        if args.out:  # after each case: a run cut off by a time limit keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report | {"complete": False}, indent=2) + "\n")
    report["all_passed"] = all(r["passed"] for r in results)
    emit(report, args.out)
    sys.exit(0 if report["all_passed"] else 1)


if __name__ == "__main__":
    main()
