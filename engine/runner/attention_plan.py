"""How the PyTorch paged attention splits one step's batch so it computes the batch, not its padding.

A step mixes decodes (one query each) with prefills and prefill chunks (many queries). One dense
call padded to the longest query and the longest context does ~18× the real work for a 512-token
chunk beside 15 decodes, so the step is split once (on its first attention layer) and every
layer reuses the split:

- decode rows go in **buckets**: rows of similar context length share one gather of their blocks
  and one folded-GQA SDPA call, padded only to the bucket's longest row. Buckets are chosen by
  a small dynamic program over the sorted lengths: a bucket costs a fixed overhead (a gather and
  a call, `BUCKET_COST_KEYS` keys' worth) plus its padded keys, so near-equal lengths share one
  call and a 40-token row never pads to 600;
- each prefill or chunk row gets its own SDPA call: a whole prefill over the step's own keys
  (contiguous, nothing gathered, `is_causal`), a chunk continuation over its own gathered blocks
  with a bottom-right causal mask.

Where the CPU decode kernel is built (helexa_kernels/cpu.py) there are no buckets: the
kernel reads every decode row's keys through its block table in one call (`KernelRows`). The
rows of a short chunk continuation go into the same call, each query as a row of its own over
its causal prefix: a prompt whose first blocks the prefix cache holds is such a continuation
(its last block is recomputed), and for a handful of queries the gather, the mask and the SDPA
call cost more than the attention (16 such prompts of 128 tokens, each 16 new queries: 480 SDPA
calls and 960 gathers a step, which took 317 ms that way against 253 ms through the kernel,
benchmarks/results/step_profile-cpu-cached-prompts.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A bucket's fixed cost (index_select x2, SDPA, index_copy on each layer) in keys of attention
# work: ~60 us against ~0.25 us per key and layer, measured on the default model's shape on CPU.
BUCKET_COST_KEYS = 256
# On the Triton path (CUDA), a chunk continuation of at least this many queries is attended by
# SDPA over its gathered keys (`sdpa_chunk_seqs`), the rest of the step by the Triton kernel:
# measured on an H200 at Qwen3-8B's heads, 2 chunks of 512 queries over 4096 keys took 0.61 ms
# in the Triton kernel against 0.28 through SDPA (its query tiles walk the whole context one
# after the other, one program per multiprocessor), while whole prefills, which attend over their
# own new keys, took 0.37 against 0.42 (benchmarks/gpu_kernels.py, paged_attention chunked/prefill).
# A few queries (a prompt whose first blocks the prefix cache held) stay in the kernel: for them
# the gather and the mask cost more than the attention.
SDPA_CHUNK_MIN_QUERIES = 128
# A chunk continuation whose rows read at most this many keys in all goes through the CPU decode
# kernel row by row. The kernel costs ~43 ns a key read, SDPA ~28 ns a key of its rectangle plus
# ~75 us a call for the gather, the mask and the call itself (one layer of the default model in
# bf16 on a 2-core Zen 4: 16 queries over 128 keys 0.087 ms against 0.131, 32 over 512 0.68
# against 0.46), so the kernel wins up to some 5000 keys.
KERNEL_CHUNK_KEYS = 4096


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows attended in one call, each over keys padded to `max_len`."""

    token_rows: torch.Tensor | None  # [n] int64 rows of q/out; None: rows 0..n-1 in order
    block_ids: torch.Tensor  # [n * num_blocks] int32, each row's first num_blocks blocks
    num_seqs: int
    num_blocks: int
    max_len: int
    mask: torch.Tensor | None  # [n, 1, 1, max_len] bool; None when every row has max_len keys


@dataclass(slots=True)
class KernelRows:
    """The query rows the CPU decode kernel attends, one query each: row i of q/out is
    `token_rows[i]`, over the first `key_lens[i]` keys through `block_tables[i]` (its sequence's
    table): every decode row, and each row of a short chunk continuation over its causal prefix."""

    token_rows: torch.Tensor  # [n] int64, rows of q/out
    block_tables: torch.Tensor  # [n, max_blocks] int32
    key_lens: torch.Tensor  # [n] int32
    seq_rows: torch.Tensor  # [n] int64, 0..n-1: row i reads block_tables[i], key_lens[i]


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with several new queries: rows start:end of q, its last (end - start)
    positions of seq_len."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int32, the sequence's blocks up to seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] bool, bottom-right causal; None: no past


@dataclass(slots=True)
class AttentionPlan:
    num_tokens: int
    decode: list[DecodeBucket]  # empty when `kernel_rows` is set
    kernel_rows: KernelRows | None  # set when the CPU decode kernel takes the decode and short-chunk rows
    prefill: list[PrefillSeq]
    slots_valid: bool  # no token of the step has slot -1 (padding), so KV stores need no mask


def decode_buckets(lengths: list[int], cost_keys: int = BUCKET_COST_KEYS) -> list[list[int]]:
    """Group indices of `lengths` into buckets minimizing Σ(cost_keys + size × longest).

    Optimal over contiguous runs of the sorted lengths (an optimal grouping never interleaves),
    by an O(n²) dynamic program; run once per step, not per layer.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lens = [lengths[i] for i in order]
    n = len(order)
    best = [0] * (n + 1)  # best[j]: cheapest cover of the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = sorted_lens[j - 1]
        best[j], cut[j] = min((best[i] + cost_keys + (j - i) * longest, i) for i in range(j))
    buckets = []
    j = n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


def build_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
               slot_mapping: torch.Tensor, block_size: int, device: torch.device,
               decode_kernel: bool = False) -> AttentionPlan:
    """Split a step's sequences into decode buckets (or, with `decode_kernel`, `KernelRows`)
    and per-sequence prefills (see module doc)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    decode = []
    kernel_rows = None
    in_kernel: set[int] = set()
    if decode_kernel:
        in_kernel = {i for i in range(len(lens)) if _kernel_takes(starts[i + 1] - starts[i], lens[i])}
        kernel_rows = _kernel_rows(sorted(in_kernel), starts, lens, block_tables, device) if in_kernel else None
    elif decode_seqs:
        groups = decode_buckets([lens[i] for i in decode_seqs])
        if len(groups) == 1:  # keep batch order: a pure decode step then needs no scatter
            groups = [list(range(len(decode_seqs)))]
        in_order = len(groups) == 1 and len(decode_seqs) == len(lens)
        for group in groups:
            decode.append(_decode_bucket([decode_seqs[g] for g in group], starts, lens, block_tables,
                                         block_size, device, in_order))
    prefill = []
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end - start == 1 or i in in_kernel:
            continue
        prefill.append(_prefill_seq(i, start, end, seq_len, block_tables, block_size, device))
    slots_valid = bool((slot_mapping >= 0).all()) if slot_mapping.numel() else True
    return AttentionPlan(num_tokens=starts[-1], decode=decode, kernel_rows=kernel_rows, prefill=prefill,
                         slots_valid=slots_valid)


def sdpa_chunk_seqs(query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                    block_size: int, device: torch.device, min_queries: int) -> list[PrefillSeq]:
    """The chunk continuations (queries after a cached context) of at least `min_queries`
    queries, in step order: what the Triton path leaves to SDPA. From host lengths only."""
    seqs, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if min_queries <= q_len < seq_len:
            seqs.append(_prefill_seq(i, start, start + q_len, seq_len, block_tables, block_size,
                                     device))
        start += q_len
    return seqs


def _prefill_seq(i: int, start: int, end: int, seq_len: int, block_tables: torch.Tensor,
                 block_size: int, device: torch.device) -> PrefillSeq:
    """Sequence i's rows start:end, the last of its seq_len positions."""
    q_len = end - start
    mask = None
    if q_len < seq_len:  # a chunk continuation: query i sits at seq_len - q_len + i
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    block_ids = block_tables[i, :-(-seq_len // block_size)]
    return PrefillSeq(start, end, seq_len, block_ids, mask)


def _kernel_takes(q_len: int, seq_len: int) -> bool:
    """A decode, or a short chunk continuation (whole prefills attend over their own new keys)."""
    if q_len == 1:
        return True
    keys_read = q_len * seq_len - q_len * (q_len - 1) // 2  # query j sees seq_len - q_len + 1 + j
    return q_len < seq_len and keys_read <= KERNEL_CHUNK_KEYS


def _kernel_rows(seqs: list[int], starts: list[int], lens: list[int], block_tables: torch.Tensor,
                 device: torch.device) -> KernelRows:
    """Every query row of `seqs`: query j of a sequence with q_len new tokens of seq_len sits at
    position seq_len - q_len + j and sees the keys up to it."""
    token_rows, owners, key_lens = [], [], []
    for i in seqs:
        q_len = starts[i + 1] - starts[i]
        token_rows.extend(range(starts[i], starts[i + 1]))
        owners.extend([i] * q_len)
        key_lens.extend(range(lens[i] - q_len + 1, lens[i] + 1))
    owner_rows = torch.tensor(owners, dtype=torch.int64, device=device)
    return KernelRows(token_rows=torch.tensor(token_rows, dtype=torch.int64, device=device),
                      block_tables=block_tables.index_select(0, owner_rows),
                      key_lens=torch.tensor(key_lens, dtype=torch.int32, device=device),
                      seq_rows=torch.arange(len(token_rows), dtype=torch.int64, device=device))


def _decode_bucket(seqs: list[int], starts: list[int], lens: list[int], block_tables: torch.Tensor,
                   block_size: int, device: torch.device, in_order: bool) -> DecodeBucket:
    bucket_lens = [lens[i] for i in seqs]
    max_len = max(bucket_lens)
    num_blocks = -(-max_len // block_size)
    rows = torch.tensor(seqs, dtype=torch.int64, device=device)
    # Rows past a short sequence's last block read block 0 (table padding); the mask hides them.
    block_ids = block_tables.index_select(0, rows)[:, :num_blocks].reshape(-1)
    mask = None
    if min(bucket_lens) != max_len:
        key_pos = torch.arange(max_len, device=device)
        lengths = torch.tensor(bucket_lens, device=device)
        mask = (key_pos[None, :] < lengths[:, None])[:, None, None, :]
    token_rows = None if in_order else torch.tensor([starts[i] for i in seqs], dtype=torch.int64,
                                                    device=device)
    return DecodeBucket(token_rows, block_ids, len(seqs), num_blocks, max_len, mask)
