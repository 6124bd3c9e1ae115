"""What machine a benchmark ran on: CPU model, the flags that decide matmul speed, cores, load.

Every CPU benchmark records this beside its numbers, because bf16 is 3× slower than fp32 on one
x86 part and 6× faster on another; the load average says whether others shared the cores.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# The instruction sets that change which dtype is fastest for a linear layer.
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty off Linux)."""
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return {}
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def machine_info() -> dict:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu_model": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": [flag for flag in MATMUL_FLAGS if flag in flags],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": round(load[0], 2),
    }
