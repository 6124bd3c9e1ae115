"""KV store: new keys/values into the paged cache at their slot_mapping (slot -1 skipped)."""

from kernels.kv_store.naive import naive_kv_store
from kernels.kv_store.triton import kv_store

__all__ = ["kv_store", "naive_kv_store"]
