"""Where a decode step's time goes on the device: kernels against the step's wall time, launches, syncs.

`profile_decode_steps` runs an `EngineCore` past its prompts' prefill, then profiles a few pure
decode steps with torch.profiler (CUDA activity where there is a GPU) and reports per step:

- `wall_ms`: the median step as the profiler saw it (its tracing adds host time: the unprofiled
  inter-token latency of the timed runs is the figure to quote);
- `kernel_ms` (the kernels' summed durations), `busy_ms` (the union of their intervals: time the
  device was doing anything) and `idle_ms` = wall - busy, the device waiting on the host;
- `kernels` (copies and memsets counted in), and the CUDA runtime/driver calls by name
  (`cudaLaunchKernel`, `cuLaunchKernel`, `cudaGraphLaunch`, `cudaMemcpyAsync`, `cudaStreamSynchronize`, ...):
  launches and syncs;
- the kernels and the host-side ATen ops that take the most time.

Kernels replayed from a CUDA graph are traced like any other (CUPTI reports graph kernels), so a
step served by `engine.runner.cuda_graphs` shows its graph's kernels beside one `cudaGraphLaunch`.

On a GPU, as many decode steps again run without the profiler, timed by CUDA events around the
runner's forward (a graph replay, or the eager forward) and the LM head, against the step's wall
time (`events`): what the device spends on the model, on the logits, and what is left for the
host (scheduling, step inputs, sampling, output). These need no profiler support at all.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine.core.engine_core import EngineCore
from engine.frontend.protocol import EngineRequest, SamplingParams

# CUDA runtime (cuda*) and driver (cu* then a capital) API calls: launches, copies, syncs.
_API_CALL = re.compile(r"^(cuda[A-Z]|cu[A-Z])")
TOP = 12


def profile_decode_steps(core: EngineCore, prompts: list[list[int]], new: int, steps: int,
                         sync: Callable[[], None], device: str) -> dict[str, object]:
    """Submit `prompts` (greedy, `new` tokens each), step until every request has its first
    token, profile up to `steps` decode steps, then finish the requests."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"profile-{i}", prompt, SamplingParams(
            max_tokens=new, temperature=0.0, ignore_eos=True)))
    started: set[str] = set()
    while len(started) < len(prompts) and core.has_work():
        started.update(out.request_id for out in core.step() if out.new_token_ids)
    steps = min(steps, (new - 2) // 2)  # every profiled and event-timed step decodes every request
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    walls: list[float] = []
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            sync()
            walls.append(time.perf_counter() - start)
    report = summarize(prof, walls, len(prompts))
    if device == "cuda":
        report["events"] = event_timings(core, steps)
    while core.has_work():
        core.step()
    return report


def event_timings(core: EngineCore, steps: int) -> dict[str, object]:
    """Median ms per decode step: the step's wall time, and the device time of the runner's
    forward and of the LM head, between CUDA events recorded around them."""
    runner, model = core.runner, core.runner.model
    spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"forward": [], "logits": []}

    def timed(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            spans[name].append((start, end))
            return out
        return run

    # Instance attributes shadow the methods for these steps only.
    runner.forward = timed("forward", runner.forward)
    model.compute_logits = timed("logits", model.compute_logits)
    walls = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            core.step()  # its sampled ids are read back: the device is done when it returns
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    finally:
        del runner.forward, model.compute_logits
    wall_ms = statistics.median(walls) * 1e3
    gpu = {name: statistics.median(s.elapsed_time(e) for s, e in pairs) if pairs else 0.0
           for name, pairs in spans.items()}
    return {"steps": len(walls), "wall_ms": round(wall_ms, 3),
            "forward_gpu_ms": round(gpu["forward"], 3), "logits_gpu_ms": round(gpu["logits"], 3),
            "rest_ms": round(wall_ms - gpu["forward"] - gpu["logits"], 3),
            "note": "medians, no profiler; rest: the step's wall time outside the forward and "
                    "the LM head on the device (host work, sampling, gaps)"}


def summarize(prof: profile, walls: list[float], num_seqs: int) -> dict[str, object]:
    steps = len(walls)
    if not steps:
        return {"error": "no decode step to profile"}
    events = prof.events()
    # Device activity: kernels, copies and memsets (not the GPU-side copies of annotated ranges).
    kernels = [e for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, reach = 0.0, float("-inf")
    for start, end in intervals:  # the union of the kernels' intervals
        if end > reach:
            busy_us += end - max(start, reach)
            reach = end
    by_kernel: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_kernel[e.name].append(e.time_range.elapsed_us())
    api_calls = Counter(e.name for e in events
                        if e.device_type == DeviceType.CPU and _API_CALL.match(e.name))
    host_ops = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")),
                      key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    wall_ms = statistics.median(walls) * 1e3
    busy_ms = busy_us / 1e3 / steps
    report: dict[str, object] = {
        "steps": steps, "sequences": num_seqs,
        "wall_ms": round(wall_ms, 3),
        "kernel_ms": round(sum(sum(v) for v in by_kernel.values()) / 1e3 / steps, 3),
        "busy_ms": round(busy_ms, 3),
        "idle_ms": round(wall_ms - busy_ms, 3),
        "kernels": round(len(kernels) / steps, 1),
        "api_calls": {name: round(count / steps, 1) for name, count in api_calls.most_common(TOP)},
        "top_kernels": [
            {"name": name[:120], "calls": round(len(times) / steps, 1),
             "ms": round(sum(times) / 1e3 / steps, 4)}
            for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:TOP]],
        "top_host_ops": [
            {"name": e.key, "calls": round(e.count / steps, 1),
             "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / steps, 4)} for e in host_ops],
        "note": "per decode step, under the profiler (which adds host time); busy: the union of "
                "the kernels' intervals; idle = wall - busy",
    }
    if not kernels and torch.cuda.is_available():
        report["warning"] = "no kernel events were recorded"
    return report
