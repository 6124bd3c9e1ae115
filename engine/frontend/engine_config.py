"""How an engine is sized and run: batch limits, KV pool, device, kernels. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

# A core with work sends StepOutputs at least this often by default (`EngineConfig.pulse_s`),
# outputs or none: its client tells a hung core (a device or a kernel that never returns) from a
# busy one by that.
CORE_PULSE_S = 1.0

# auto: Triton kernels on CUDA, the C++ CPU kernels on CPU; torch (the PyTorch forms), triton or
# cpu force one (engine.runner.ops).
KERNEL_CHOICES = ("auto", "torch", "triton", "cpu")


@dataclass(slots=True)
class EngineConfig:
    # A .gguf file or an HF model directory.
    model: str
    # "auto": CUDA when the core process finds a GPU, else the CPU (resolved there, with torch).
    device: str = "cpu"
    # "auto": measured on CPU (engine.cpu.dtype_choice: the faster of fp32 / bf16 / fp16 for this
    # model's shapes, among those this CPU runs), bfloat16 on CUDA. Workers ask for "auto" (HELEXA_DTYPE's
    # default); an engine built directly (tests, in-process benchmarks) is fp32 unless told.
    dtype: str = "float32"
    block_size: int = 16
    # 0 sizes the pool from kv_cache_bytes.
    num_kv_blocks: int = 0
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    # 0: the model's own limit (also capped by what the KV pool can hold for one sequence).
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    # Decode steps replay CUDA graphs (engine.runner.cuda_graphs); only ever on CUDA.
    cuda_graphs: bool = True
    # Which implementation of the hot ops runs (KERNEL_CHOICES); the core resolves it once at build.
    kernels: str = "auto"
    # An idle engine that receives a request waits up to this long for the rest of a burst before
    # its first step (engine.core.batch_window); 0 steps at once.
    batch_window_ms: float = 0.0
    # Model-runner ranks the model is sharded across (engine.runner.tensor_parallel); 1: one process.
    tensor_parallel: int = 1
    # Steps a batch-class request may wait in all before the scheduler admits it as interactive
    # work (engine.core.scheduler's aging bound).
    batch_aging_steps: int = 512
    # While interactive work runs or waits, running batch requests are computed in one step of this
    # many (engine.core.scheduler's batch turns); 1: in every step.
    batch_step_interval: int = 8
    # Prompt tokens of batch-class requests one step computes at most (engine.core.scheduler).
    batch_prefill_tokens: int = 64
    # For this long after interactive work last ran or waited (0: never), a step computes at most
    # batch_narrow_tokens batch tokens (engine.core.scheduler's narrow batch steps).
    batch_narrow_s: float = 10.0
    batch_narrow_tokens: int = 16
    # A core that holds unfinished requests and is not heard from (it sends at least every
    # `pulse_s` while it has work, between steps) for this long is hung, not busy: the client kills
    # it, and the worker restarts it like any core that dies; 0: never.
    stall_s: float = 600.0
    pulse_s: float = CORE_PULSE_S

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks < 0 or self.kv_cache_bytes < 0:
            raise ValueError("num_kv_blocks and kv_cache_bytes must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.stall_s < 0 or self.pulse_s <= 0 or (self.stall_s and self.stall_s < 4 * self.pulse_s):
            raise ValueError("stall_s must be 0 (never) or at least 4 x pulse_s, and pulse_s positive")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError("batch_window_ms must be between 0 and 1000")
        if not 1 <= self.tensor_parallel <= 64:
            raise ValueError("tensor_parallel must be between 1 and 64")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.batch_aging_steps < 1:
            raise ValueError("batch_aging_steps must be >= 1")
        if self.batch_step_interval < 1:
            raise ValueError("batch_step_interval must be >= 1")
        if self.batch_prefill_tokens < 1:
            raise ValueError("batch_prefill_tokens must be >= 1")
        if not 0 <= self.batch_narrow_s <= 3600:
            raise ValueError("batch_narrow_s must be between 0 and 3600")
        if self.batch_narrow_tokens < 1:
            raise ValueError("batch_narrow_tokens must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")

