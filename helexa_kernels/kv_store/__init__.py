"""KV store: new keys/values into the paged cache at their slot_mapping (slot -1 skipped)."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.kv_store.naive import naive_kv_store

__all__ = ["kv_store", "naive_kv_store"]

__getattr__ = triton_on_first_use(__name__, {"kv_store"})
