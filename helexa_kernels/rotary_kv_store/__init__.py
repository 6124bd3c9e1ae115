"""An attention layer's prologue in one pass: per-head RMSNorm of q and k, RoPE, the KV store."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.rotary_kv_store.naive import naive_rotary_kv_store

__all__ = ["naive_rotary_kv_store", "rotary_kv_store"]

__getattr__ = triton_on_first_use(__name__, {"rotary_kv_store"})
