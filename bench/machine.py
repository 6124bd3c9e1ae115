"""What machine a benchmark ran on: CPU model, the flags that decide matmul speed, cores, load.

Every CPU benchmark records this beside its numbers, because bf16 is 3× slower than fp32 on one
x86 part and 6× faster on another; the load average says whether others shared the cores.
"""

from __future__ import annotations

import os
import platform

import torch

from helexa_kernels.machine import cpu_identity

# The instruction sets that change which dtype is fastest for a linear layer.
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def machine_info() -> dict:
    cpu = cpu_identity()
    flags = set(cpu["flags"])
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu_model": cpu["model"] or platform.processor() or platform.machine(),
        "cpu_family": cpu["family"], "cpu_model_number": cpu["model_number"],
        "cpu_flags": [flag for flag in MATMUL_FLAGS if flag in flags],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": round(load[0], 2),
    }
