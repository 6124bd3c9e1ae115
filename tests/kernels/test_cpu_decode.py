"""The CPU decode attention kernel (helexa_kernels/paged_attention/cpu_decode.cpp) against the naive loop.

It must build wherever the suite runs (CI has a compiler): a machine where it cannot is served by
the SDPA path, but then these tests fail rather than pass on the fallback. On a CPU with AMX, bf16
rows go through its tiles (helexa_kernels/paged_attention/amx_decode.h) where the shapes fit; every case
runs both as the kernel picks (`picked`) and with AMX switched off (`avx512`), so both forms are
checked there (`tests.kernels.helpers.AMX_FORMS`).
"""

from __future__ import annotations

import pytest
import torch

from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.paged_attention import naive_paged_attention
from tests.engine.helpers import random_block_tables
from tests.kernels.helpers import AMX_FORMS

DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 1e-2, id="bf16"),
          pytest.param(torch.float16, 2e-3, id="fp16")]
# (num_heads, num_kv_heads, head_dim): the default model's shape, MHA, odd head_dim (vector tail),
# a wide head_dim with 8 heads a kv head (AMX: query tiles reloaded, values in two calls), and more
# query heads than an AMX tile has columns (the AVX-512 form serves it).
SHAPES = [pytest.param((9, 3, 64), id="smollm2"), pytest.param((4, 4, 32), id="mha"),
          pytest.param((6, 2, 20), id="gqa3-tail"), pytest.param((16, 2, 128), id="wide-heads"),
          pytest.param((20, 4, 64), id="20-heads")]
SEQ_LENS = [1, 15, 16, 17, 150, 64]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load(), "the CPU decode kernel did not build on this machine"


def decode_case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                block_size: int = 16) -> tuple:
    generator = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // block_size) for s in SEQ_LENS) + 4
    tables = random_block_tables(SEQ_LENS, block_size, num_blocks, generator)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(SEQ_LENS, dtype=torch.int32)


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    starts = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)
    return naive_paged_attention(q, k_cache, v_cache, starts, seq_lens, block_tables, 1, scale)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("form", AMX_FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_decode_kernel_matches_the_naive_loop(shape: tuple[int, int, int], dtype: torch.dtype,
                                              tolerance: float, form) -> None:
    q, k_cache, v_cache, tables, lens = decode_case(*shape, dtype)
    scale = shape[2] ** -0.5
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(SEQ_LENS))
    with form():
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, rows, rows, scale)
    assert rel_error(out, reference(q, k_cache, v_cache, tables, lens, scale)) < tolerance


@pytest.mark.parametrize("form", AMX_FORMS)
@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_kernel_with_other_block_sizes(block_size: int, form) -> None:
    """Blocks of 32 slots hold two AMX key tiles; blocks of 8 are not a whole tile (AVX-512 form)."""
    q, k_cache, v_cache, tables, lens = decode_case(9, 3, 64, torch.bfloat16, block_size)
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(SEQ_LENS))
    with form():
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, rows, rows, 0.125)
    assert rel_error(out, reference(q, k_cache, v_cache, tables, lens, 0.125)) < 1e-2


@pytest.mark.parametrize("form", AMX_FORMS)
def test_decode_kernel_when_later_keys_score_far_higher(form) -> None:
    """Scores that grow along the sequence: each tile of keys raises the running max the AMX
    form's one-pass softmax keeps, so the sums it holds are rescaled at every tile."""
    q, k_cache, v_cache, tables, lens = decode_case(9, 3, 64, torch.bfloat16)
    positions = torch.zeros(k_cache.shape[0], k_cache.shape[1])
    for seq, table in enumerate(tables.tolist()):
        for slot in range(int(lens[seq])):
            positions[table[slot // 16], slot % 16] = slot
    k_cache = (k_cache.float().abs() * (1 + positions / 10)[:, :, None, None]).bfloat16()
    q = q.float().abs().bfloat16()
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(SEQ_LENS))
    with form():
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, rows, rows, 0.125)
    assert rel_error(out, reference(q, k_cache, v_cache, tables, lens, 0.125)) < 1e-2


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_kernel_writes_only_its_rows_and_reads_strided_queries(dtype: torch.dtype,
                                                                      tolerance: float) -> None:
    """Rows of a mixed step: q is a view into a wider projection, two rows in another order."""
    q, k_cache, v_cache, tables, lens = decode_case(9, 3, 64, dtype)
    wide = torch.randn(len(SEQ_LENS), 9 * 64 + 7).to(dtype)
    wide[:, :9 * 64] = q.view(len(SEQ_LENS), -1)
    strided_q = wide[:, :9 * 64].view(len(SEQ_LENS), 9, 64)
    assert not strided_q.is_contiguous()
    out = torch.zeros(len(SEQ_LENS) + 2, 9, 64, dtype=dtype)
    token_rows, seq_rows = torch.tensor([7, 1]), torch.tensor([4, 2])
    padded_q = torch.zeros(len(SEQ_LENS) + 2, 9, 64, dtype=dtype)
    padded_q[7], padded_q[1] = strided_q[4], strided_q[2]
    cpu_kernels.paged_decode_attention(out, padded_q, k_cache, v_cache, tables, lens, token_rows,
                                      seq_rows, 0.125)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert rel_error(out[7], expected[4]) < tolerance and rel_error(out[1], expected[2]) < tolerance
    untouched = [r for r in range(out.shape[0]) if r not in (7, 1)]
    assert (out[untouched] == 0).all()
    # A strided q straight from a projection, rows in order.
    out = torch.empty_like(q)
    rows = torch.arange(len(SEQ_LENS))
    cpu_kernels.paged_decode_attention(out, strided_q, k_cache, v_cache, tables, lens, rows, rows, 0.125)
    assert rel_error(out, expected) < tolerance


@pytest.mark.parametrize("damage", ["block-id", "seq-len", "token-row", "seq-row"])
def test_decode_kernel_refuses_reads_outside_the_cache(damage: str) -> None:
    """It reads through raw pointers: bad metadata is an error, never a read out of bounds."""
    q, k_cache, v_cache, tables, lens = decode_case(9, 3, 64, torch.float32)
    token_rows = seq_rows = torch.arange(len(SEQ_LENS))
    if damage == "block-id":
        tables[4, 3] = k_cache.shape[0]
    elif damage == "seq-len":
        lens[0] = tables.shape[1] * k_cache.shape[1] + 1
    elif damage == "token-row":
        token_rows = torch.tensor([0, len(SEQ_LENS)])
        seq_rows = torch.tensor([0, 1])
    else:
        token_rows = torch.tensor([0, 1])
        seq_rows = torch.tensor([0, len(SEQ_LENS)])
    with pytest.raises(RuntimeError):
        cpu_kernels.paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables, lens,
                                          token_rows, seq_rows, 0.125)


def test_build_is_cached_per_cpu_environment_and_source() -> None:
    """The build folder names the CPU (its flags pick the instruction set), the environment and the
    source; a finished build is marked, so later starts load it as it is."""
    directory = cpu_kernels.build_directory()
    assert directory.name.startswith("cpu-")
    assert (directory / f"{cpu_kernels.NAME}.so").is_file() and (directory / cpu_kernels.BUILT_MARKER).is_file()
