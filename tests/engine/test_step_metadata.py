"""The step builder's upload: every field in one buffer (one copy on CUDA), each view equal to
its host list, in its dtype and shape."""

from __future__ import annotations

import torch

from engine.step_metadata import SequenceChunk, build_step_inputs, pack


def test_pack_lays_every_tensor_out_aligned_in_one_buffer() -> None:
    tensors = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([7, -1], dtype=torch.int64),
               torch.tensor([[4, 5], [6, 0]], dtype=torch.int32), torch.tensor([], dtype=torch.int64)]
    packed, spans = pack(tensors)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * 4 + 2 * 8 + 4 * 4
    for tensor, (start, end, dtype, shape) in zip(tensors, spans, strict=True):
        assert start % tensor.element_size() == 0  # int64 first: every view is aligned
        view = packed[start:end].view(dtype).view(shape)
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)
    assert spans[1][0] == 0  # the widest dtype leads


def test_step_inputs_carry_the_state_slots() -> None:
    chunks = [SequenceChunk([5, 6, 7], 0, [2], sample_id="a"), SequenceChunk([9], 4, [0, 1])]
    inputs = build_step_inputs(chunks, 4, "cpu", state_slots=[3, 0])
    assert inputs.input_ids.tolist() == [5, 6, 7, 9] and inputs.positions.tolist() == [0, 1, 2, 4]
    assert inputs.meta.slot_mapping.tolist() == [8, 9, 10, 4]
    assert inputs.meta.block_tables.tolist() == [[2, 0], [0, 1]]
    assert inputs.state_slots is not None and inputs.state_slots.dtype == torch.int32
    assert inputs.state_slots.tolist() == [3, 0]
    assert build_step_inputs(chunks, 4).state_slots is None
