"""What this CPU can run (engine.cpu.cpu_support): oneDNN's own answer, the test override, and the
reason a dtype is refused, worded with the CPU features it lacks."""

from __future__ import annotations

import pytest
import torch

from engine.cpu import cpu_support
from engine.cpu.cpu_support import FORCE_UNSUPPORTED_ENV, UnsupportedDtype

# A Zen 3 (the machine where the default start crashed): AVX2, no AVX-512 of any kind.
ZEN3_FLAGS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "sha_ni"}


def test_the_answer_is_onednns_own() -> None:
    assert cpu_support.dtype_supported("float32")
    assert cpu_support.dtype_supported(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_support.dtype_supported("float16") == torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert cpu_support.dtype_supported("bfloat16", device="cuda")


def test_the_test_override_makes_a_dtype_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16, float16")
    assert not cpu_support.dtype_supported("bfloat16") and not cpu_support.dtype_supported(torch.float16)
    assert cpu_support.dtype_supported("float32")


def test_a_refusal_names_the_features_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16,float16")
    monkeypatch.setattr(cpu_support, "cpu_flags", lambda: ZEN3_FLAGS)
    monkeypatch.setattr(cpu_support.platform, "machine", lambda: "x86_64")
    assert (cpu_support.unsupported_reason("bfloat16")
            == "bf16 unsupported here (oneDNN: no avx512bw/avx512vl/avx512dq or avx_ne_convert)")
    assert (cpu_support.unsupported_reason("float16")
            == "fp16 unsupported here (oneDNN: no avx512_fp16 or avx_ne_convert)")
    with pytest.raises(UnsupportedDtype) as refused:
        cpu_support.require("bfloat16")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("dtype bfloat16 cannot run on this CPU")
    assert "avx512bw" in message and "float32" in message
    # Only what is missing is named: a part with AVX-512 BW/VL but no DQ.
    monkeypatch.setattr(cpu_support, "cpu_flags", lambda: ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl"})
    assert cpu_support.missing("bfloat16") == "avx512dq or avx_ne_convert"


def test_on_arm_the_refusal_names_arms_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16")
    monkeypatch.setattr(cpu_support, "cpu_flags", lambda: {"fp", "asimd", "sve"})
    monkeypatch.setattr(cpu_support.platform, "machine", lambda: "aarch64")
    assert cpu_support.unsupported_reason("bfloat16") == "bf16 unsupported here (oneDNN: no bf16)"


def test_a_forced_refusal_on_a_cpu_that_has_the_features_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_UNSUPPORTED_ENV, "bfloat16")
    monkeypatch.setattr(cpu_support, "cpu_flags", lambda: {"avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setattr(cpu_support.platform, "machine", lambda: "x86_64")
    assert cpu_support.missing("bfloat16") == ""
    assert (cpu_support.unsupported_reason("bfloat16") == f"bf16 unsupported here (forced by {FORCE_UNSUPPORTED_ENV}; "
            "oneDNN needs avx512bw/avx512vl/avx512dq or avx_ne_convert)")
