"""Which reduced-precision dtypes this CPU can run: the one place that asks.

oneDNN runs bf16 and fp16 linears only on CPUs with the instructions for them, and it fails
(`mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw,
avx512vl and avx512dq`) rather than fall back. So a dtype is a candidate (`engine.cpu.dtype_choice`),
and a weight of that dtype is packed for oneDNN or the bf16 C++ linear (`engine.cpu.cpu_linear`), only
where `dtype_supported` says so. It asks oneDNN's own checks (`_is_mkldnn_bf16_supported`,
`_is_mkldnn_fp16_supported`), not x86 flag names, so arm64 (Graviton 3's bf16) is judged the same
way; the flag names only word the reason a dtype is refused (`missing`).

Tests make a CPU that can run bf16 behave as one that cannot: `HELEXA_TEST_UNSUPPORTED_DTYPES`
(`bfloat16`, `float16`, comma-separated) is read on every call, in the engine core's process too,
so a worker started with it takes the path of a Zen 3 or any AVX2-only part. It is for tests only.
"""

from __future__ import annotations

import os
import platform

import torch

from engine.frontend.protocol import EngineRefused
from helexa_kernels.machine import cpu_identity

# Tests only: dtypes to report unsupported whatever the CPU can do.
FORCE_UNSUPPORTED_ENV = "HELEXA_TEST_UNSUPPORTED_DTYPES"

SHORT = {"bfloat16": "bf16", "float16": "fp16"}

# What oneDNN needs for each dtype (its own error messages, torch 2.13), to word a refusal: one
# tuple of flags that together suffice per alternative. /proc/cpuinfo names.
_X86_NEEDS = {"bfloat16": (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",)),
              "float16": (("avx512_fp16",), ("avx_ne_convert",))}
_ARM_NEEDS = {"bfloat16": (("bf16",),), "float16": (("fphp", "asimdhp"),)}

# The flags worth naming in a log line about dtypes (present ones are listed).
_SUMMARY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16",
                  "avx_ne_convert", "amx_bf16", "amx_fp16", "asimd", "sve", "sve2", "bf16", "fphp", "i8mm")


class UnsupportedDtype(EngineRefused):
    """A dtype asked for that this CPU cannot run: the message is the one line an operator reads."""


def _name(dtype: str | torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def forced_unsupported() -> set[str]:
    """Dtypes `HELEXA_TEST_UNSUPPORTED_DTYPES` reports unsupported (tests only)."""
    return {_name(d.strip()) for d in os.environ.get(FORCE_UNSUPPORTED_ENV, "").split(",") if d.strip()}


def dtype_supported(dtype: str | torch.dtype, device: str = "cpu") -> bool:
    """Whether this machine's oneDNN runs `dtype` (fp32 always; anything on a non-CPU device)."""
    name = _name(dtype)
    if device != "cpu" or name == "float32":
        return True
    if name in forced_unsupported():
        return False
    check = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}.get(name)
    if check is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: do not guess yes
        return False


def cpu_flags() -> set[str]:
    return set(cpu_identity()["flags"])


def flags_summary() -> str:
    """The CPU's instruction-set flags that bear on dtypes, e.g. "avx2 fma avx512f ... amx_bf16"."""
    flags = cpu_flags()
    present = [flag for flag in _SUMMARY_FLAGS if flag in flags]
    return " ".join(present) if present else "none of " + ", ".join(_SUMMARY_FLAGS[:3]) + "..."


def _needs(dtype: str) -> tuple[tuple[str, ...], ...]:
    arm = platform.machine().lower() in ("aarch64", "arm64")
    return (_ARM_NEEDS if arm else _X86_NEEDS).get(dtype, ())


def needed(dtype: str | torch.dtype) -> str:
    """What oneDNN needs for `dtype` on this architecture, e.g. "avx512bw/avx512vl/avx512dq or
    avx_ne_convert"."""
    return " or ".join("/".join(alternative) for alternative in _needs(_name(dtype)))


def missing(dtype: str | torch.dtype) -> str:
    """The CPU features oneDNN wants for `dtype` that this CPU lacks, in the same form as `needed`;
    "" where it lacks none of some alternative."""
    flags = cpu_flags()
    lacking = [[f for f in alternative if f not in flags] for alternative in _needs(_name(dtype))]
    if lacking and all(lacking):
        return " or ".join("/".join(alternative) for alternative in lacking)
    return ""


def unsupported_reason(dtype: str | torch.dtype) -> str:
    """Why `dtype` is no candidate here: "bf16 unsupported here (oneDNN: no avx512bw/... or ...)"."""
    name = _name(dtype)
    lacking = missing(name)
    if lacking:
        why = f"oneDNN: no {lacking}"
    elif name in forced_unsupported():  # the CPU has what oneDNN needs: say what a real one lacks
        why = f"forced by {FORCE_UNSUPPORTED_ENV}; oneDNN needs {needed(name)}"
    else:
        why = f"by oneDNN's own check; it needs {needed(name)}"
    return f"{SHORT.get(name, name)} unsupported here ({why})"


def require(dtype: str, device: str = "cpu") -> None:
    """Raise `UnsupportedDtype` (one line naming the missing CPU feature) unless `dtype` runs here."""
    if dtype_supported(dtype, device):
        return
    raise UnsupportedDtype(f"dtype {dtype} cannot run on this CPU: {unsupported_reason(dtype)}; "
                           "use float32, or auto to pick what runs here")
