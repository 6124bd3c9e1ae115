"""Which sequence owns which state slot of a hybrid model's linear-attention layers. No torch here.

Linear (gated DeltaNet) layers keep a fixed-size state per sequence instead of per-token K/V, so a
running sequence needs exactly one slot for its whole life, whatever its length. The scheduler takes
a slot when it first schedules a request and gives it back on finish, abort or preemption; the model
runner owns the tensors the slot indexes (`engine.runner.state_cache`).
"""

from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        # Lowest slot first, so a lightly loaded engine touches the same few slots.
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, request_id: str) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self._owner[slot] = request_id
        return slot

    def free(self, slot: int) -> None:
        if self._owner.pop(slot, None) is None:
            raise ValueError(f"state slot {slot} is not in use")
        self._free.append(slot)
