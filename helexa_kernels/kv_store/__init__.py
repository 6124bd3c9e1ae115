"""KV store: new keys/values into the paged cache at their slot_mapping (slot -1 skipped)."""

from helexa_kernels.kv_store.naive import naive_kv_store

__all__ = ["kv_store", "naive_kv_store"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"kv_store"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.kv_store import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
