"""What the engine benchmarks share: a timed greedy run of an `EngineCore` and a clock for HF
`generate`, both recording time to first token and inter-token gaps the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.engine_core import EngineCore
from engine.frontend.protocol import EngineRequest, SamplingParams


@dataclass
class RunResult:
    wall_s: float = 0.0
    tokens: dict[str, list[int]] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


def _no_sync() -> None:
    pass


def run_greedy(core: EngineCore, requests: list[tuple[str, list[int], int]],
               sync: Callable[[], None] = _no_sync) -> RunResult:
    """Submit every (request id, prompt, max_tokens) at once, greedy and ignoring EOS, and step the
    core until all finish. `sync` waits for the device before the clock starts (a step's sampled
    ids already wait for it)."""
    result = RunResult(tokens={request_id: [] for request_id, _, _ in requests})
    last: dict[str, float] = {}
    sync()
    start = time.perf_counter()
    for request_id, prompt, max_tokens in requests:
        core.add_request(EngineRequest(request_id, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            previous = last.get(out.request_id)
            if previous is None:
                result.ttft_s.append(now - start)
            else:
                result.itl_s.append(now - previous)
            last[out.request_id] = now
            result.tokens[out.request_id].extend(out.new_token_ids)
    result.wall_s = time.perf_counter() - start
    return result


class StepClock:
    """A logits processor for HF `generate` that records when each step's logits are ready."""

    def __init__(self, sync: Callable[[], None] = _no_sync) -> None:
        self.sync, self.times = sync, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.sync()
        self.times.append(time.perf_counter())
        return scores
