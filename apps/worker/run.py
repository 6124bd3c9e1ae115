"""One request's run on a worker: template, tokenize, check limits, generate, stream frames, record.

`run_request` is the whole life of one attempt once the model loop has taken it: a poisoned model
refuses at once; the prompt is rendered and tokenized and max_tokens resolved against the context
(a refusal is the request's own 4xx; any other failure there is an error frame and the message is
terminated, never left to be redelivered); then the `Accepted` frame and the `run.started` event, the
generation of every choice with its text streamed as it comes, and the final (or error) frame.
It returns a `RunOutcome`: the `run.finished` event, which the model loop publishes before it
settles the message, and whether to terminate the message rather than ack it.

This is the worker's asyncio side: the engine does the torch work elsewhere and hands back token
ids; `choices` turns them into text and frames, `run_record` into the ledger's numbers. A device
fault is the only failure that changes shared state: it poisons the model through its `ModelHealth`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from apps.bus import wire
from apps.bus.codes import ErrorCode, RunStatus, ServingError
from apps.bus.event_publish import publish_event
from apps.bus.events import RunFinished
from apps.worker import liveness
from apps.worker.choices import engine_request_ids, generate
from apps.worker.context_limit import ContextLimit
from apps.worker.prompt import build_prompt, check_resume, check_sampling_ids, resolve_sampling
from apps.worker.replies import Replier
from apps.worker.run_record import RunRecord
from apps.worker.tokenizing import Tokenizing
from apps.worker.tool_grammar import check_composed
from engine.frontend.grammars import GrammarChecker
from engine.frontend.protocol import ENGINE_STOPPED, DeviceFault, Engine, FinishReason, is_device_fault
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")


def poisoned_message(model: str) -> str:
    return (f"The model '{model}' is out of service on this worker after a device fault (or an engine "
            f"that kept failing); reload it (helexa models load {model}).")


@dataclass(slots=True)
class ModelHealth:
    """Whether a model may serve. Only a device fault takes it out of service, until it is
    reloaded; `changed` is set so the worker refreshes its node entry now, not at the next tick."""

    model_id: str
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    poisoned: str | None = None

    def poison(self, detail: str) -> None:
        """Out of service until reloaded: the device's state can no longer be trusted."""
        if self.poisoned is None:
            log.error("device fault: model poisoned", extra={"model": self.model_id, "error": detail})
            self.poisoned = detail
            self.changed.set()


@dataclass(slots=True, frozen=True)
class ServedModel:
    """What a run uses of the model it runs on."""

    model_id: str
    engine: Engine
    tokenizer: Tokenizer
    context: ContextLimit
    health: ModelHealth
    # Where long prompts are templated and tokenized (a process pool), and the checks of the tool
    # grammars the worker composes (threads with a deadline): never on the event loop.
    tokenizing: Tokenizing
    reasoning_parser: str = "auto"
    grammars: GrammarChecker = field(default_factory=GrammarChecker)


@dataclass(slots=True, frozen=True)
class RunOutcome:
    """How a run ended: the ledger's event (`finished.served` False: this attempt lost its
    request to another, whose message it must leave alone), and whether the message must be
    terminated rather than acked (a request no worker could prepare: it must not come back, nor
    wait for it)."""

    finished: RunFinished
    terminate: bool = False


def check_resume_fits(request: wire.GenerateRequest, max_tokens: int | None) -> None:
    """A migrated choice's resumed tokens count as generated, so none can hold more than the
    request may generate (`max_tokens`, already bounded by the model's context): a longer list is
    no client's answer so far, and the engine would prefill it all."""
    longest = max((len(choice.token_ids) for choice in request.resume or []), default=0)
    if max_tokens is not None and longest > max_tokens:
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           f"A resumed choice has {longest} tokens; this request may generate {max_tokens}.",
                           param="resume")


async def abort_request(engine: Engine, request: wire.GenerateRequest) -> None:
    """Abort every choice of `request` (idempotent: a finished or unknown id is no-op)."""
    for engine_request_id in engine_request_ids(request.request_id, request.sampling.n):
        await engine.abort(engine_request_id)


async def run_request(model: ServedModel, request: wire.GenerateRequest, replier: Replier, *, attempt: int,
                      node: str, js: JetStreamContext, probe: liveness.RequesterProbe | None = None) -> RunOutcome:
    """Serve one request through `replier` and say how it ended, for the ledger and the message.

    With `probe`, the requester is probed while the run goes: the run is aborted when it is gone,
    and stopped and silenced when another attempt serves its client. A run whose replier was
    silenced (that, or the worker handed it back) records that it did not serve (`served=False`).
    """
    record = RunRecord(request=request, node=node, attempt=attempt, received_at=time.time(),
                       tensor_parallel=model.engine.info.tensor_parallel)
    if model.health.poisoned is not None:
        await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(model.model_id))
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, ErrorCode.MODEL_POISONED))
    try:
        # Templating and tokenizing megabytes takes seconds: long prompts go to processes, so the
        # other streams' frames and every request's heartbeats keep going meanwhile.
        prompt = await model.tokenizing.run(request.text_chars(), build_prompt, request, model.reasoning_parser)
        record.prompt_tokens = len(prompt.token_ids)
        sampling = resolve_sampling(request, len(prompt.token_ids), model.context.derive().context)
        await check_composed(request, sampling, model.grammars)
        check_resume(request, model.tokenizer.vocab_size)
        check_sampling_ids(request, model.tokenizer.vocab_size)
        check_resume_fits(request, sampling.max_tokens)
    except ServingError as exc:
        await replier.error(exc.status, exc.code or ErrorCode.INVALID_REQUEST, exc.message)
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, exc.code))
    except Exception as exc:  # a template or tokenizer that breaks on this request: its own failure
        log.exception("preparing the request failed", extra={"request_id": request.request_id})
        await replier.error(500, ErrorCode.INTERNAL_ERROR, "The worker could not prepare a prompt from this request.")
        return RunOutcome(record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, type(exc).__name__),
                          terminate=True)
    await replier.accepted(len(prompt.token_ids))
    # run.started goes to the ledger beside the generation: the engine need not wait out its
    # PubAck (a round trip per request, which spread a burst's arrivals at the engine). It is
    # awaited below, so it is on the stream before the run.finished the caller publishes.
    started = asyncio.create_task(publish_event(js, record.started_event()))
    watcher = None
    if probe is not None:
        watcher = asyncio.create_task(_follow_requester(probe, model.engine, request, replier))
    error: str | None
    try:
        reasons, error = await generate(model.engine, model.tokenizer, replier, record, prompt, sampling)
        finish_reason = reasons[0]
        if is_device_fault(error):
            model.health.poison(error or "device fault")
            error = ErrorCode.DEVICE_FAULT
    except DeviceFault as exc:
        model.health.poison(str(exc) or "device fault")
        finish_reason, error = FinishReason.ERROR, ErrorCode.DEVICE_FAULT
        await abort_request(model.engine, request)
    except Exception as exc:  # the run fails, the worker goes on
        log.exception("generation failed", extra={"request_id": request.request_id})
        finish_reason, error = FinishReason.ERROR, type(exc).__name__
        await abort_request(model.engine, request)
    finally:
        if watcher is not None:
            watcher.cancel()
    if replier.undeliverable and error is None:  # an error frame ended the answer (a frame too large for the bus)
        finish_reason, error = FinishReason.ERROR, ErrorCode.REPLY_TOO_LARGE
    record.finished_at = time.time()
    await started
    for preemption in record.preemptions:
        await publish_event(js, preemption)
    # The rate is what was computed in the time it took: a migrated request recomputes its resumed
    # tokens too, and counting only its prompt would drag the rate (and the advertised context) down.
    model.context.observe_prefill(record.prefilled_tokens, record.prefill_ms)
    if replier.silenced is not None:
        # Another attempt serves the client, or the worker handed the request back before any text
        # (a cancellation); a stream the stopping worker cut short is a failed one.
        cut_short = replier.silenced == ErrorCode.WORKER_STOPPING and replier.sent_tokens
        status = RunStatus.ERROR if cut_short else RunStatus.CANCELLED
        return RunOutcome(record.finished_event(status, finish_reason, error or replier.silenced, served=False))
    if error == ErrorCode.DEVICE_FAULT:
        await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(model.model_id))
        return RunOutcome(record.finished_event(RunStatus.ERROR, finish_reason, error))
    if error == ENGINE_STOPPED:
        # The engine core died under this run (`apps.worker.restarts` starts it again): the
        # requester may go on with the answer on a core that runs (migration).
        await replier.error(503, ErrorCode.ENGINE_LOST, "The engine serving this request stopped before the answer "
                                                        "was complete; it is being restarted.")
        return RunOutcome(record.finished_event(RunStatus.ERROR, finish_reason, ErrorCode.ENGINE_LOST))
    if error is not None:
        await replier.error(500, ErrorCode.GENERATION_FAILED, "The generation failed on the worker.")
        return RunOutcome(record.finished_event(RunStatus.ERROR, finish_reason, error))
    await replier.final(finish_reason, record.usage())
    status = RunStatus.CANCELLED if finish_reason == FinishReason.ABORT else RunStatus.OK
    return RunOutcome(record.finished_event(status, finish_reason))


async def _follow_requester(probe: liveness.RequesterProbe, engine: Engine, request: wire.GenerateRequest,
                            replier: Replier) -> None:
    verdict = await probe.watch()
    if verdict is liveness.Verdict.TAKEN:
        log.info("another attempt serves this request; this one stops",
                 extra={"request_id": request.request_id, "attempt": probe.attempt})
        replier.silence(ErrorCode.ATTEMPT_TAKEN)
    else:
        log.info("requester gone; aborting", extra={"request_id": request.request_id})
    await abort_request(engine, request)
