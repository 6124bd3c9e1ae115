"""An attention layer's prologue in one pass: per-head RMSNorm of q and k, RoPE, the KV store."""

from helexa_kernels.rotary_kv_store.naive import naive_rotary_kv_store

__all__ = ["naive_rotary_kv_store", "rotary_kv_store"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"rotary_kv_store"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.rotary_kv_store import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
