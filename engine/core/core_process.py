"""The engine core's process: build the core (`build_core`: dtype, kernels, tensor-parallel ranks,
weights, each long step logged), then step it whenever there is work and apply the client's messages
between steps (`run_core_process`), until told to stop or the client is gone. A message that cannot be
applied fails the request it carries, never the process."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import torch

from engine.core.batch_window import gather_burst
from engine.core.engine_core import GRAMMAR_POLL_S, EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    EngineOutput,
    EngineRefused,
    FinishReason,
    FromCore,
    Shutdown,
    StepOutputs,
    device_fault_message,
    encode_message,
    to_core_decoder,
)
from engine.runner import ops
from engine.runner.tensor_parallel import GroupLost

log = logging.getLogger("helexa.engine")


def exit_core(why: str) -> None:
    """A tensor-parallel rank is gone: end the core process at once, from any thread (the other
    ranks die with it, `engine.frontend.parent_death`); the worker sees a core death."""
    log.error("engine core ends: %s", why)
    logging.shutdown()
    os._exit(1)


def build_core(config: EngineConfig, on_rank_lost: Callable[[str], None] = exit_core) -> EngineCore:
    """The engine for `config`, each step of a start that takes seconds announced in the log (the
    CPU kernels' one-time build, the dtype measurement, the weights). A dtype this CPU cannot run
    is refused first (`engine.cpu.cpu_support.UnsupportedDtype`), before anything is built, and so
    is a model whose shapes do not divide by `tensor_parallel`. At N > 1 the dtype and kernel
    choice is made here once and every rank is given it; `on_rank_lost` runs when a rank dies."""
    from engine.cpu import cpu_support
    from engine.cpu.dtype_cache import default_cache_path
    from engine.cpu.dtype_choice import choose_dtype
    from engine.cpu.thread_governor import fit_torch_threads
    from engine.loading.loader import load_checkpoint, read_model_config, weights_bytes
    from engine.models.parallel_layers import Shard, refuse_indivisible
    from engine.runner.tensor_parallel import join_group, rank_device, start_followers

    if config.device == "auto":
        config = dataclasses.replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device).type
    if device == "cpu" and config.tensor_parallel == 1:
        # Before the dtype is measured: the linears are timed on the threads the steps will run on.
        # Tensor-parallel ranks share the CPUs out when they join (`join_group`).
        fit_torch_threads()
    if config.dtype != "auto":
        cpu_support.require(config.dtype, device)
    # Picked before the dtype is measured: the linears are timed as this backend runs them.
    kernels = ops.use_backend(config.kernels, config.device)
    model_config = read_model_config(config.model)
    world = config.tensor_parallel
    refuse_indivisible(model_config, world)
    choice = choose_dtype(config, model_config, device, default_cache_path())
    followers = None
    shard = Shard(0, world)
    if world > 1:
        config = dataclasses.replace(config, dtype=choice.dtype, kernels=kernels)
        followers, init_file = start_followers(config, world, on_rank_lost)
        config = dataclasses.replace(config, device=rank_device(config, shard))
    start = time.perf_counter()
    log.info("loading weights (%d MiB on disk) as %s from %s ...", weights_bytes(config.model) >> 20,
             choice.dtype, config.model)
    try:
        if followers is not None:
            join_group(shard, init_file, config.device)
        checkpoint = load_checkpoint(config.model, dtype=choice.torch_dtype, device=config.device, shard=shard)
        log.info("weights loaded in %.1f s (tensor_parallel %d)", time.perf_counter() - start, world)
        core = EngineCore(checkpoint, config, followers)
    except BaseException:
        if followers is not None:
            followers.close()
        raise
    core.info = msgspec.structs.replace(core.info, dtype=choice.dtype, dtype_reason=choice.detail,
                                        dtype_timings_ms=choice.timings_ms)
    return core


@dataclasses.dataclass(slots=True)
class Arrivals:
    """What the core loop knows of requests still on their way."""

    more_arriving: bool = False  # the last request taken said others are right behind it


def _take(core: EngineCore, conn: Connection, outputs: list[EngineOutput], arrivals: Arrivals) -> bool:
    """Apply the next message from the client, its outputs into `outputs`; False: shut down."""
    handled = handle_message(core, conn.recv_bytes(), arrivals)
    if handled is None:
        return False
    outputs.extend(handled)
    return True


def handle_message(core: EngineCore, data: bytes, arrivals: Arrivals) -> list[EngineOutput] | None:
    """Apply one message from the client; None means shut down. A message that cannot be
    applied fails the request it carries, never the process."""
    try:
        message = to_core_decoder.decode(data)
    except msgspec.DecodeError as exc:
        request_id = _request_id_of(data)
        log.warning("undecodable message for request %r: %s", request_id, exc)
        if request_id is None:
            return []
        return [EngineOutput(request_id=request_id, new_token_ids=[], finished=True,
                             finish_reason=FinishReason.ERROR, error=f"invalid engine request: {exc}")]
    if isinstance(message, AddRequest):
        core.add_request(message.request)
        arrivals.more_arriving = message.request.more_arriving
    elif isinstance(message, AbortRequests):
        return core.abort(message.request_ids)
    elif isinstance(message, Shutdown):
        return None
    return []


def _request_id_of(data: bytes) -> str | None:
    """The request id inside an AddRequest that failed validation, if it can be read at all."""
    try:
        raw = msgspec.msgpack.decode(data)
        request_id = raw["request"][0]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return None
    return request_id if isinstance(request_id, str) else None


def run_core_process(conn: Connection, config: EngineConfig) -> None:
    """The core process: load the model, then step whenever there is work, until told to stop."""
    # Ctrl-C reaches the whole process group; the worker owns shutdown and stops us through the
    # pipe (or by closing it), so an interrupted terminal does not look like a crashed engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(message: FromCore) -> None:
        conn.send_bytes(encode_message(message))

    try:
        core = build_core(config)
    except EngineRefused as exc:  # a configuration this machine cannot run: one line, no traceback
        send(CoreFailed(error=str(exc), refused=True))
        return
    except Exception as exc:  # reported to the parent, which decides what to do
        send(CoreFailed(error=f"{type(exc).__name__}: {exc}"))
        return
    send(CoreReady(info=core.info))
    window_s = config.batch_window_ms / 1000.0
    arrivals = Arrivals()
    last_sent = time.monotonic()
    try:
        while True:
            outputs: list[EngineOutput] = []
            try:
                # Block for commands only when idle; otherwise just take what has arrived.
                idle = not core.has_work()
                if idle:
                    conn.poll(None)
                elif core.only_compiling:
                    conn.poll(GRAMMAR_POLL_S)  # a message, or the next look at the compiles
                while conn.poll():
                    if not _take(core, conn, outputs, arrivals):
                        return
                if idle and window_s and core.has_work() and not gather_burst(
                        conn.poll, lambda: _take(core, conn, outputs, arrivals),  # noqa: B023  (called before it returns)
                        core.scheduler.next_step_is_full,
                        lambda: arrivals.more_arriving, window_s):
                    return
            except (EOFError, OSError):
                return  # the worker is gone; so is our reason to run
            try:
                outputs.extend(core.step())
            except GroupLost as exc:
                exit_core(str(exc))
            except Exception as exc:
                log.exception("engine step failed")
                outputs.extend(core.fail_all(device_fault_message(exc)))
            # Outputs, or at least a pulse while it works (a long prefill, a grammar compile): a
            # core not heard from is hung (`EngineConfig.stall_s`).
            if outputs or time.monotonic() - last_sent >= config.pulse_s:
                try:
                    send(StepOutputs(outputs=outputs, stats=core.stats))
                except (EOFError, OSError):
                    return
                last_sent = time.monotonic()
    finally:
        core.close()
