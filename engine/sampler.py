"""Pick the next token from logits: greedy at temperature 0, else temperature / top-k / top-p.

Randomness comes only from the caller's `torch.Generator`, so a request with a seed replays
exactly whatever else runs in the process.
"""

from __future__ import annotations

import torch

from engine.api import SamplingOptions


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # fresh entropy: unseeded requests must not share a stream
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator) -> int:
    """logits: [vocab] for one sequence. Returns the chosen token id."""
    if options.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / options.temperature
    if 0 < options.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, sorted_ids = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the more likely ones already cover top_p; the first always stays.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = mass_before >= options.top_p
        logits = logits.index_fill(0, sorted_ids[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
