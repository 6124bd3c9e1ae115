"""The settings the apps read, from the environment (the table with defaults: docs/operations.md).

CLI flags override these. A few settings belong to the one module that uses them and are read
there: the GPU kernels' HELEXA_GEMV (engine/runner/gpu_linear.py) and HELEXA_GDN_CHUNK
(helexa_kernels/gated_delta_rule/triton.py), the batches CLI's HELEXA_URL and HELEXA_API_KEY
(apps/fleet/batches.py), and the tests' HELEXA_TEST_UNSUPPORTED_DTYPES (engine/cpu/cpu_support.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.frontend.engine_config import CORE_PULSE_S, KERNEL_CHOICES, EngineConfig

if TYPE_CHECKING:
    from apps.bus.topology import BusLimits

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Each app's NATS_URL and DATABASE_URL are its own role's (`apps.bus.roles`, migrations/0007):
# `helexa up` hands each child only its own. The bench publishes as a role of its own, so where
# NATS_URL is the operator's (the env file of `helexa up`), its URL comes from this variable.
BENCH_NATS_URL = "HELEXA_BENCH_NATS_URL"


class SettingError(ValueError):
    """A setting that cannot be used as given: the message names it (the CLI prints it alone)."""


def _env(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SettingError(f"{name} must be a number, got {raw!r}") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise SettingError(f"{name} must be an integer, got {raw!r}") from None


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def bus_limits() -> BusLimits:
    """The bus shape every app of one fleet must agree on (TTL, replicas, redelivery)."""
    try:
        return _bus_limits()
    except SettingError:
        raise
    except ValueError as exc:  # BusLimits' own checks, which name the limits
        raise SettingError(f"bus limits: {exc}") from None


def _bus_limits() -> BusLimits:
    from apps.bus.topology import BusLimits

    return BusLimits(
        # Past this many queued requests REQUESTS refuses new ones (503 queue_full), dropping none.
        request_max_msgs=_env_int("HELEXA_REQUESTS_MAX_MSGS", 100_000),
        # REQUESTS' bytes, and the bucket of requests too large for one message.
        request_max_bytes=_env_int("HELEXA_REQUESTS_MAX_BYTES", 1 << 30),
        # EVENTS refuses new events past these (new requests get 503 events_full); the recorder
        # trims events it has recorded as the stream nears them.
        event_max_age_s=_env_float("HELEXA_EVENTS_MAX_AGE_S", 7 * 24 * 3600.0),
        event_max_bytes=_env_int("HELEXA_EVENTS_MAX_BYTES", 4 << 30),
        node_ttl_s=_env_float("HELEXA_NODE_TTL_S", 15.0),
        # 3 on a NATS cluster: streams and the node registry survive losing a server.
        replicas=_env_int("HELEXA_REPLICAS", 1),
        request_ack_wait_s=_env_float("HELEXA_REQUEST_ACK_WAIT_S", 10.0),
        max_deliver=_env_int("HELEXA_MAX_DELIVER", 3),
        # Every uploaded file's content together (the `helexa_files` bucket).
        files_max_bytes=_env_int("HELEXA_FILES_MAX_BYTES", 8 << 30),
        batch_ack_wait_s=_env_float("HELEXA_BATCH_ACK_WAIT_S", 60.0),
    )


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """HELEXA_LOG_LEVEL: the apps' log threshold (the CLI's --log-level overrides it)."""
    level = _env("HELEXA_LOG_LEVEL", "INFO").upper()
    if level not in _LOG_LEVELS:
        raise SettingError(f"HELEXA_LOG_LEVEL must be one of {', '.join(_LOG_LEVELS)}, got {level!r}")
    return level


def event_loop() -> str:
    """HELEXA_EVENT_LOOP: the apps' asyncio event loop, `uvloop` (the default) or `asyncio`."""
    loop = _env("HELEXA_EVENT_LOOP", "uvloop").lower()
    if loop not in ("uvloop", "asyncio"):
        raise SettingError(f"HELEXA_EVENT_LOOP must be uvloop or asyncio, got {loop!r}")
    return loop


def postgres_fsync() -> bool:
    """HELEXA_PG_FSYNC=off runs the embedded PostgreSQL without fsync (benchmarks, throwaway data)."""
    value = _env("HELEXA_PG_FSYNC", "on").lower()
    if value not in ("on", "off"):
        raise SettingError(f"HELEXA_PG_FSYNC must be on or off, got {value!r}")
    return value == "on"


def catalogue_file() -> str:
    """A TOML file of models workers may load on demand: [models."<id>"] source, min_memory_mb."""
    return _env("HELEXA_CATALOGUE", "")


@dataclass(slots=True)
class GatewaySettings:
    nats_url: str = field(default_factory=lambda: _env("NATS_URL", DEFAULT_NATS_URL))
    host: str = field(default_factory=lambda: _env("HELEXA_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: _env_int("HELEXA_PORT", 8000))
    # How long a request may wait in the queue for a worker to accept it before a 503.
    accept_timeout_s: float = field(default_factory=lambda: _env_float("HELEXA_ACCEPT_TIMEOUT_S", 60.0))
    # Silence longer than this from the worker serving a request means it is gone.
    stream_idle_timeout_s: float = field(default_factory=lambda: _env_float("HELEXA_STREAM_IDLE_TIMEOUT_S", 30.0))
    max_request_bytes: int = field(default_factory=lambda: _env_int("HELEXA_MAX_REQUEST_BYTES", 8 << 20))
    # How many times one request may move to another worker after the worker serving its
    # answer was lost mid-stream (0: the client gets a `worker_lost` error instead).
    max_migrations: int = field(default_factory=lambda: _env_int("HELEXA_MAX_MIGRATIONS", 2))
    # A file of `KEY PRINCIPAL` lines; empty means no authentication.
    api_keys_file: str = field(default_factory=lambda: _env("HELEXA_API_KEYS", ""))
    # Admission per model (SPEC §5); 0 turns a limit off.
    max_in_flight: int = field(default_factory=lambda: _env_int("HELEXA_MAX_IN_FLIGHT", 0))
    max_queue_depth: int = field(default_factory=lambda: _env_int("HELEXA_MAX_QUEUE_DEPTH", 0))
    max_wait_s: float = field(default_factory=lambda: _env_float("HELEXA_MAX_WAIT_S", 60.0))
    max_per_principal: int = field(default_factory=lambda: _env_int("HELEXA_MAX_PER_PRINCIPAL", 0))
    # A TOML file of per-model overrides: [models."<model id>"] max_in_flight = 4, ...
    admission_file: str = field(default_factory=lambda: _env("HELEXA_ADMISSION_FILE", ""))
    # How long a request for a catalogued model no worker has loaded waits for a load (then 503).
    cold_start_wait_s: float = field(default_factory=lambda: _env_float("HELEXA_COLD_START_WAIT_S", 120.0))
    # Reply frames held for one streaming client that reads slower than its worker writes; past
    # this the request is cancelled (an error event, then [DONE]).
    stream_buffer_frames: int = field(default_factory=lambda: _env_int("HELEXA_STREAM_BUFFER_FRAMES", 4096))
    # PostgreSQL, where stored responses (`previous_response_id`, GET /v1/responses/{id}) are read.
    database_url: str = field(default_factory=lambda: _env("DATABASE_URL", DEFAULT_DATABASE_URL))
    # How long after its id was made a response this gateway does not know yet (made through
    # another gateway, maybe still generating) is waited for, until the recorder announces it; an
    # unknown older id is a 404 at once. A wait costs no queries (PostgreSQL LISTEN).
    response_wait_s: float = field(default_factory=lambda: _env_float("HELEXA_RESPONSE_WAIT_S", 30.0))
    # A stored response's input items and echoed settings (413 above, before it runs).
    max_stored_response_bytes: int = field(
        default_factory=lambda: _env_int("HELEXA_MAX_STORED_RESPONSE_BYTES", 4 << 20))
    # A `previous_response_id` conversation (400 above, before it runs).
    max_chain_responses: int = field(default_factory=lambda: _env_int("HELEXA_MAX_CHAIN_RESPONSES", 1024))
    max_chain_bytes: int = field(default_factory=lambda: _env_int("HELEXA_MAX_CHAIN_BYTES", 16 << 20))
    # This gateway's cache of its own recent responses, until the ledger has them.
    response_cache_bytes: int = field(default_factory=lambda: _env_int("HELEXA_RESPONSE_CACHE_BYTES", 64 << 20))
    response_cache_ttl_s: float = field(default_factory=lambda: _env_float("HELEXA_RESPONSE_CACHE_TTL_S", 600.0))
    # Uploaded files (/v1/files): one file's bytes (413 above), for purpose=batch its lines and each
    # line's bytes (400 above), a principal's files and their bytes together (413 above), and how
    # long an upload's body may take to arrive (the edge's body timeout for POST /v1/files).
    max_file_bytes: int = field(default_factory=lambda: _env_int("HELEXA_MAX_FILE_BYTES", 200 << 20))
    max_batch_lines: int = field(default_factory=lambda: _env_int("HELEXA_MAX_BATCH_LINES", 50_000))
    max_batch_line_bytes: int = field(default_factory=lambda: _env_int("HELEXA_MAX_BATCH_LINE_BYTES", 8 << 20))
    max_files_per_principal: int = field(default_factory=lambda: _env_int("HELEXA_MAX_FILES_PER_PRINCIPAL", 1000))
    max_file_bytes_per_principal: int = field(
        default_factory=lambda: _env_int("HELEXA_MAX_FILE_BYTES_PER_PRINCIPAL", 1 << 30))
    # Batches (/v1/batches): how many of a batch's lines this gateway's runner has in flight at once;
    # 0: this gateway runs no batches (it still takes them, and another gateway's runner runs them).
    batch_concurrency: int = field(default_factory=lambda: _env_int("HELEXA_BATCH_CONCURRENCY", 8))
    # How many of a principal's batches may be live (not yet completed, failed, expired or cancelled):
    # a new one past it is a 429 naming max_live_batches_per_principal.
    max_live_batches_per_principal: int = field(
        default_factory=lambda: _env_int("HELEXA_MAX_LIVE_BATCHES_PER_PRINCIPAL", 100))
    upload_timeout_s: float = field(default_factory=lambda: _env_float("HELEXA_UPLOAD_TIMEOUT_S", 600.0))
    # On SIGTERM, how long answers in flight get to finish (then an error event ends each).
    stop_grace_s: float = field(default_factory=lambda: _env_float("HELEXA_STOP_GRACE_S", 10.0))
    # The HTTP edge, enforced before authentication (`apps/gateway/http_edge.py`): open sockets,
    # header count and bytes (request line included), the time a header block and a body may take
    # to arrive, and how long an idle keep-alive connection stays open.
    max_connections: int = field(default_factory=lambda: _env_int("HELEXA_MAX_CONNECTIONS", 1024))
    max_headers: int = field(default_factory=lambda: _env_int("HELEXA_MAX_HEADERS", 100))
    max_header_bytes: int = field(default_factory=lambda: _env_int("HELEXA_MAX_HEADER_BYTES", 32 << 10))
    header_timeout_s: float = field(default_factory=lambda: _env_float("HELEXA_HEADER_TIMEOUT_S", 10.0))
    body_timeout_s: float = field(default_factory=lambda: _env_float("HELEXA_BODY_TIMEOUT_S", 60.0))
    keep_alive_s: float = field(default_factory=lambda: _env_float("HELEXA_KEEP_ALIVE_S", 5.0))
    # Host headers served, comma-separated (`*`: any). Empty: any, except that a keyless gateway on a
    # loopback address serves only localhost, 127.0.0.1 and [::1] at its port (DNS rebinding).
    allowed_hosts: str = field(default_factory=lambda: _env("HELEXA_ALLOWED_HOSTS", ""))
    # Requests per second per principal (anonymous callers: per client address), with bursts of up
    # to `rate_limit_burst`; 0 turns the limit off.
    rate_limit_rps: float = field(default_factory=lambda: _env_float("HELEXA_RATE_LIMIT_RPS", 100.0))
    rate_limit_burst: int = field(default_factory=lambda: _env_int("HELEXA_RATE_LIMIT_BURST", 400))

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_headers, self.max_header_bytes) < 1:
            raise SettingError("HELEXA_MAX_CONNECTIONS, HELEXA_MAX_HEADERS and HELEXA_MAX_HEADER_BYTES must be >= 1")
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_s) <= 0:
            raise SettingError("HELEXA_HEADER_TIMEOUT_S, HELEXA_BODY_TIMEOUT_S and HELEXA_KEEP_ALIVE_S must be > 0")
        if self.rate_limit_rps < 0 or (self.rate_limit_rps and self.rate_limit_burst < 1):
            raise SettingError("HELEXA_RATE_LIMIT_RPS must be >= 0 (0: off) and HELEXA_RATE_LIMIT_BURST >= 1")
        if self.response_wait_s < 0:
            raise SettingError("HELEXA_RESPONSE_WAIT_S must be >= 0")
        if self.batch_concurrency < 0:
            raise SettingError("HELEXA_BATCH_CONCURRENCY must be >= 0")
        if self.max_live_batches_per_principal < 1:
            raise SettingError("HELEXA_MAX_LIVE_BATCHES_PER_PRINCIPAL must be >= 1")
        if self.stop_grace_s < 0:
            raise SettingError("HELEXA_STOP_GRACE_S must be >= 0")
        if min(self.max_stored_response_bytes, self.max_chain_responses, self.max_chain_bytes,
               self.response_cache_bytes) < 1 or self.response_cache_ttl_s <= 0:
            raise SettingError("the stored-response limits (HELEXA_MAX_STORED_RESPONSE_BYTES, HELEXA_MAX_CHAIN_*, "
                               "HELEXA_RESPONSE_CACHE_*) must be positive")
        if min(self.max_file_bytes, self.max_batch_lines, self.max_batch_line_bytes, self.max_files_per_principal,
               self.max_file_bytes_per_principal) < 1 or self.upload_timeout_s <= 0:
            raise SettingError("the file limits (HELEXA_MAX_FILE_*, HELEXA_MAX_BATCH_*, "
                               "HELEXA_MAX_FILES_PER_PRINCIPAL, HELEXA_UPLOAD_TIMEOUT_S) must be positive")
        if self.max_migrations < 0:
            raise SettingError("HELEXA_MAX_MIGRATIONS must be >= 0")
        if self.stream_buffer_frames < 1:
            raise SettingError("HELEXA_STREAM_BUFFER_FRAMES must be at least 1")
        if not 0 < self.port < 65536:
            raise SettingError("HELEXA_PORT must be a TCP port")
        if self.accept_timeout_s <= 0 or self.stream_idle_timeout_s <= 0:
            raise SettingError("timeouts must be positive")
        if min(self.max_in_flight, self.max_queue_depth, self.max_per_principal) < 0 or self.max_wait_s <= 0:
            raise SettingError("admission limits must be >= 0, and HELEXA_MAX_WAIT_S positive")


@dataclass(slots=True)
class WorkerSettings:
    nats_url: str = field(default_factory=lambda: _env("NATS_URL", DEFAULT_NATS_URL))
    # A .gguf file or an HF model directory; empty means the default model from its wheel.
    model: str = field(default_factory=lambda: _env("HELEXA_MODEL", ""))
    served_model_name: str = field(default_factory=lambda: _env("HELEXA_SERVED_MODEL_NAME", ""))
    node_id: str = field(default_factory=lambda: _env("HELEXA_NODE_ID", default_node_id()))
    max_model_len: int = field(default_factory=lambda: _env_int("HELEXA_MAX_MODEL_LEN", 0))
    status_interval_s: float = field(default_factory=lambda: _env_float("HELEXA_STATUS_INTERVAL_S", 5.0))
    device: str = field(default_factory=lambda: _env("HELEXA_DEVICE", "auto"))
    # auto: measured at start on CPU (the faster of float32 / bfloat16 / float16 for the model's
    # own shapes), bfloat16 on CUDA; or float32, bfloat16, float16.
    dtype: str = field(default_factory=lambda: _env("HELEXA_DTYPE", "auto"))
    max_num_seqs: int = field(default_factory=lambda: _env_int("HELEXA_MAX_NUM_SEQS", 16))
    max_num_batched_tokens: int = field(default_factory=lambda: _env_int("HELEXA_MAX_NUM_BATCHED_TOKENS", 2048))
    kv_cache_mb: int = field(default_factory=lambda: _env_int("HELEXA_KV_CACHE_MB", 1024))
    # Engine steps a batch-class request waits at most before it is admitted as interactive work.
    batch_aging_steps: int = field(default_factory=lambda: _env_int("HELEXA_BATCH_AGING_STEPS", 512))
    # While interactive work runs or waits, running batch requests are computed in one engine step
    # of this many (1: every step, where a step costs little more with more rows, as on a GPU).
    batch_step_interval: int = field(default_factory=lambda: _env_int("HELEXA_BATCH_STEP_INTERVAL", 8))
    # Prompt tokens of batch-class requests one engine step computes at most.
    batch_prefill_tokens: int = field(default_factory=lambda: _env_int("HELEXA_BATCH_PREFILL_TOKENS", 64))
    # For this long after interactive work last ran or waited (0: never), one engine step computes at
    # most batch_narrow_tokens tokens of batch-class requests (decodes and prompt tokens alike).
    batch_narrow_s: float = field(default_factory=lambda: _env_float("HELEXA_BATCH_NARROW_S", 10.0))
    batch_narrow_tokens: int = field(default_factory=lambda: _env_int("HELEXA_BATCH_NARROW_TOKENS", 16))
    # Free slots a worker never pulls batch-class requests into, kept for interactive work; -1: a
    # quarter of max_num_seqs, at least 1 (apps.worker.intake.interactive_reserve).
    interactive_reserve: int = field(default_factory=lambda: _env_int("HELEXA_INTERACTIVE_RESERVE", -1))
    # How long an idle engine gathers a burst of requests before its first step (0: not at all).
    batch_window_ms: float = field(default_factory=lambda: _env_float("HELEXA_BATCH_WINDOW_MS", 30.0))
    enable_prefix_caching: bool = field(default_factory=lambda: _env("HELEXA_PREFIX_CACHING", "on") != "off")
    # Decode steps replay CUDA graphs on a GPU; "off" runs every step eagerly.
    cuda_graphs: bool = field(default_factory=lambda: _env("HELEXA_CUDA_GRAPHS", "on") != "off")
    # auto: split <think> when the chat template uses it; on/off force it (like a reasoning parser flag).
    reasoning_parser: str = field(default_factory=lambda: _env("HELEXA_REASONING_PARSER", "auto"))
    # Heartbeat frames and in-progress acks while a request is held; well under the request ack wait.
    heartbeat_s: float = field(default_factory=lambda: _env_float("HELEXA_HEARTBEAT_S", 2.0))
    # A stream's tokens within a window after a frame go out together as one frame (its first
    # token never waits): at least frame_window_ms, or frame_window_steps of the engine's steps at
    # its pace (apps/worker/frame_window.py); both 0 send every delta as it comes.
    frame_window_ms: float = field(default_factory=lambda: _env_float("HELEXA_FRAME_WINDOW_MS", 20.0))
    frame_window_steps: float = field(default_factory=lambda: _env_float("HELEXA_FRAME_WINDOW_STEPS", 3.0))
    # Memory this worker offers for models loaded on request (0: what the machine has).
    memory_mb: int = field(default_factory=lambda: _env_int("HELEXA_WORKER_MEMORY_MB", 0))
    # Hot-op implementation: auto (Triton on CUDA, the C++ CPU kernels on CPU), torch, triton or cpu.
    kernels: str = field(default_factory=lambda: _env("HELEXA_KERNELS", "auto").lower())
    # How long a requester may not listen (no responders to the alive probe) before its run is
    # aborted as abandoned: long enough for a gateway to reconnect through a NATS outage.
    requester_grace_s: float = field(default_factory=lambda: _env_float("HELEXA_REQUESTER_GRACE_S", 10.0))
    # On SIGTERM, how long streams that have sent text get to finish (then a worker_stopping error).
    stop_grace_s: float = field(default_factory=lambda: _env_float("HELEXA_STOP_GRACE_S", 10.0))
    # Processes per model that template and tokenize long prompts (the worker's bound on that work).
    tokenize_processes: int = field(default_factory=lambda: _env_int("HELEXA_TOKENIZE_PROCESSES", 1))
    # A JSON script to reply from instead of running the model (`helexa worker --script`), for
    # testing clients and `helexa up` itself without a model's generation time.
    script: str = field(default_factory=lambda: _env("HELEXA_WORKER_SCRIPT", ""))
    # An engine core process that dies is started again, at most this many times per window (then
    # the model is out of service until reloaded); 0 never restarts one.
    core_restarts: int = field(default_factory=lambda: _env_int("HELEXA_CORE_RESTARTS", 3))
    core_restart_window_s: float = field(default_factory=lambda: _env_float("HELEXA_CORE_RESTART_WINDOW_S", 600.0))
    # An engine core that holds unfinished requests and is not heard from this long is hung (a
    # device or kernel that never returns): killed, and restarted as above; 0: never.
    core_stall_s: float = field(default_factory=lambda: _env_float("HELEXA_CORE_STALL_S", 600.0))
    # Model-runner ranks each model is sharded across (torch.distributed; engine.runner.tensor_parallel).
    tensor_parallel: int = field(default_factory=lambda: _env_int("HELEXA_TENSOR_PARALLEL", 1))

    def __post_init__(self) -> None:
        if self.core_restarts < 0 or self.core_restart_window_s <= 0:
            raise SettingError("HELEXA_CORE_RESTARTS must be >= 0 and HELEXA_CORE_RESTART_WINDOW_S positive")
        if self.core_stall_s < 0 or 0 < self.core_stall_s < 4 * CORE_PULSE_S:
            raise SettingError(f"HELEXA_CORE_STALL_S must be 0 (never) or at least {4 * CORE_PULSE_S:g} "
                               "(four of the core's pulses)")
        if self.kernels not in KERNEL_CHOICES:
            raise SettingError(f"HELEXA_KERNELS must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.heartbeat_s <= 0:
            raise SettingError("HELEXA_HEARTBEAT_S must be positive")
        if not 0 <= self.frame_window_ms <= 1000:
            raise SettingError("HELEXA_FRAME_WINDOW_MS must be between 0 and 1000")
        if not 0 <= self.frame_window_steps <= 100:
            raise SettingError("HELEXA_FRAME_WINDOW_STEPS must be between 0 and 100")
        if self.max_model_len < 0:
            raise SettingError("HELEXA_MAX_MODEL_LEN must be >= 0 (0 = the model's own limit)")
        if self.interactive_reserve < -1:
            raise SettingError("HELEXA_INTERACTIVE_RESERVE must be >= 0 (or -1: a quarter of max_num_seqs)")
        if self.status_interval_s <= 0:
            raise SettingError("HELEXA_STATUS_INTERVAL_S must be positive")
        if self.kv_cache_mb < 1:
            raise SettingError("HELEXA_KV_CACHE_MB must be at least 1")
        if self.reasoning_parser not in ("auto", "on", "off"):
            raise SettingError("HELEXA_REASONING_PARSER must be auto, on or off")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SettingError("HELEXA_DTYPE must be auto, float32, bfloat16 or float16")
        if not 0 <= self.batch_window_ms <= 1000:
            raise SettingError("HELEXA_BATCH_WINDOW_MS must be between 0 and 1000")
        if self.requester_grace_s < 0 or self.stop_grace_s < 0:
            raise SettingError("HELEXA_REQUESTER_GRACE_S and HELEXA_STOP_GRACE_S must be >= 0")
        if self.tokenize_processes < 1:
            raise SettingError("HELEXA_TOKENIZE_PROCESSES must be at least 1")
        if not 1 <= self.tensor_parallel <= 64:
            raise SettingError("HELEXA_TENSOR_PARALLEL must be between 1 and 64")

    def engine_config(self, model_path: str) -> EngineConfig:
        return EngineConfig(
            model=model_path,
            device=self.device,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_bytes=self.kv_cache_mb << 20,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            cuda_graphs=self.cuda_graphs,
            kernels=self.kernels,
            batch_window_ms=self.batch_window_ms,
            stall_s=self.core_stall_s,
            tensor_parallel=self.tensor_parallel,
            batch_aging_steps=self.batch_aging_steps,
            batch_step_interval=self.batch_step_interval,
            batch_prefill_tokens=self.batch_prefill_tokens,
            batch_narrow_s=self.batch_narrow_s,
            batch_narrow_tokens=self.batch_narrow_tokens,
        )


@dataclass(slots=True)
class RecorderSettings:
    nats_url: str = field(default_factory=lambda: _env("NATS_URL", DEFAULT_NATS_URL))
    database_url: str = field(default_factory=lambda: _env("DATABASE_URL", DEFAULT_DATABASE_URL))
    batch_size: int = field(default_factory=lambda: _env_int("HELEXA_RECORDER_BATCH", 256))
    # About how many bytes of events one batch holds at most (pulled, and read from the Object
    # Store for events stored by reference); never less than one message of the server's max_payload.
    batch_bytes: int = field(default_factory=lambda: _env_int("HELEXA_RECORDER_BATCH_BYTES", 16 << 20))
    # How long a batch that is not full waits for more events before it is written.
    linger_ms: float = field(default_factory=lambda: _env_float("HELEXA_RECORDER_LINGER_MS", 250.0))
    # How long a batch fetched by a recorder that then died waits before another recorder gets it.
    ack_wait_s: float = field(default_factory=lambda: _env_float("HELEXA_RECORDER_ACK_WAIT_S", 60.0))
    # Prometheus `/metrics` of this recorder (lag, dead letters, EVENTS limits); 0 serves none.
    metrics_port: int = field(default_factory=lambda: _env_int("HELEXA_RECORDER_METRICS_PORT", 0))
    metrics_host: str = field(default_factory=lambda: _env("HELEXA_RECORDER_METRICS_HOST", "127.0.0.1"))
    # How often the lag and the EVENTS stream's fill are read (and warned about).
    watch_interval_s: float = field(default_factory=lambda: _env_float("HELEXA_RECORDER_WATCH_S", 5.0))

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SettingError("HELEXA_RECORDER_BATCH must be at least 1")
        if self.batch_bytes < 1:
            raise SettingError("HELEXA_RECORDER_BATCH_BYTES must be at least 1")
        if self.ack_wait_s < 1:
            raise SettingError("HELEXA_RECORDER_ACK_WAIT_S must be at least 1")
        if not 0 <= self.linger_ms <= 5000:
            raise SettingError("HELEXA_RECORDER_LINGER_MS must be 0 to 5000")
        if not 0 <= self.metrics_port < 65536:
            raise SettingError("HELEXA_RECORDER_METRICS_PORT must be a TCP port (0: no metrics endpoint)")
        if self.watch_interval_s <= 0:
            raise SettingError("HELEXA_RECORDER_WATCH_S must be positive")


@dataclass(slots=True)
class BenchSettings:
    """Where `helexa bench` publishes its events and where `bench report` / `bench score` read runs."""

    nats_url: str = field(default_factory=lambda: _env(BENCH_NATS_URL, _env("NATS_URL", DEFAULT_NATS_URL)))
    database_url: str = field(default_factory=lambda: _env("DATABASE_URL", DEFAULT_DATABASE_URL))


def data_dir() -> Path:
    return Path(_env("HELEXA_DATA_DIR", ".helexa")).resolve()


def services_nice() -> int:
    """How much lower `helexa up` runs its servers, gateway and recorder than the worker (0-19)."""
    nice = _env_int("HELEXA_SERVICES_NICE", 5)
    if not 0 <= nice <= 19:
        raise SettingError(f"HELEXA_SERVICES_NICE must be 0 to 19, got {nice}")
    return nice


def migrations_dir() -> Path:
    """The numbered SQL migrations: the repo's `migrations/` unless HELEXA_MIGRATIONS_DIR names another."""
    default = Path(__file__).resolve().parents[1] / "migrations"
    return Path(_env("HELEXA_MIGRATIONS_DIR", str(default))).resolve()


@dataclass(frozen=True, slots=True)
class UpSettings:
    """What `helexa up` takes from its environment: the NATS and PostgreSQL an operator exported
    (empty: `up` starts its own) and the environment its apps inherit (each child's own role
    credentials are set over it)."""

    exported_nats_url: str
    exported_database_url: str
    inherited_env: dict[str, str]
    # An app or embedded server that fails to come back this many restarts in a row (an app that
    # exits before it is ready, a server that does not start) ends `up`; 0 retries forever.
    restart_tries: int = 5


def up_settings() -> UpSettings:
    tries = _env_int("HELEXA_UP_RESTART_TRIES", 5)
    if tries < 0:
        raise SettingError("HELEXA_UP_RESTART_TRIES must be >= 0 (0: retry forever)")
    return UpSettings(exported_nats_url=_env("NATS_URL", ""), exported_database_url=_env("DATABASE_URL", ""),
                      inherited_env=dict(os.environ), restart_tries=tries)
