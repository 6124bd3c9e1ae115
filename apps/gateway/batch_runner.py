"""The batch runner: a gateway's worker for /v1/batches, durable across gateway deaths.

A gateway runs one batch at a time (more gateways run more at once). Batches are claimed through
the BATCHES work queue (`topology.batch_runners_config`): one claim
message per batch, taken by whichever gateway's runner pulls it, kept alive with in-progress acks
while the batch runs and acked only once the batch is finished (or naked when this gateway stops).
A gateway that dies holding one stops acking, so after the ack wait JetStream hands the claim to
another runner, or to this one once it is back. Nothing of a batch lives only in a runner: the
ledger (`apps.gateway.batch_store`) has the batch and every finished line, so the runner that takes
a claim over reads which lines are done and runs the rest.

Why this shape rather than feeding lines into REQUESTS directly: REQUESTS' age, dedupe window and
delivery limit fit live traffic, not a 24 h window, and a line sent through the gateway's own
generation pipeline gets everything a live request gets (routing, admission, migration on a lost
worker, the same rendering), so a batch line's answer is exactly the answer the live route gives.

Per batch: the input file's lines are decoded (`apps.gateway.batch_lines`) into the endpoint's
own request struct with the live route's code (`validate.decode_body`, same bounds); an invalid
line becomes an error line, never a failed batch. Valid lines run `batch_concurrency` at a time, non-streaming, with
`service_class="batch"` (the engine preempts them for interactive work) and a request id made of
the batch id, the line and the claim's delivery count (deterministic, yet new for a runner that
takes the batch over, so REQUESTS' dedupe never swallows a retaken line). Each finished line is a
`batch.line` event whose event id is the batch id and line number: published twice, recorded
once. Once the ledger has a row for every line, the output and error JSONL files are written to
the files bucket as the batch owner's (purpose `batch_output`), then the batch is `completed`.

Cancelling (`batch.status` cancelling, from any gateway) stops new lines from starting; the ones
running finish, then the batch is `cancelled` with what is done. At `expires_at` (re-read from
the ledger at every poll, so the deadline has one owner, the `batches` row) the same happens,
the lines that never started become error lines `batch_expired`, and the batch is `expired`. A
line refused for lack of capacity (429, 503) is retried after a pause, with a new request id, a
bounded number of times. Waits on the ledger are bounded too: a line event lost on its way gives
the claim back, and the next run records what is missing. A batch the ledger has in a final state
that its run did not give it (`failed` by a gateway whose claim publish seemed to fail, though the
claim was queued) starts no more lines, and its claim is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.events import AnyEvent, BatchLine
from apps.bus.pull import BatchPuller
from apps.gateway.api.structured import check_enforceable
from apps.gateway.batch_lines import Prepared, expired_lines, line_error, line_event, output_line, prepare, split_lines
from apps.gateway.batch_store import BATCH_IDS, TERMINAL, BatchStore, StoredBatch
from apps.gateway.bus_client import GatewayBus
from apps.gateway.errors import error_body
from apps.gateway.file_store import FileStore
from apps.gateway.generation import GenerationPipeline
from apps.gateway.metrics import GatewayMetrics

log = logging.getLogger("helexa.gateway")

HANDLER = "batch"
# How often a running batch re-reads its status (cancelled elsewhere?) and the claim is kept alive.
_POLL_S = 1.0
# One wait for a claim while none is there: stopping ends it, and a gateway that freezes meanwhile
# delays one batch by the claim's ack wait at most.
_CLAIM_WAIT_S = 30.0
# A line refused for the moment is tried again, the pauses doubling from _RETRY_PAUSE_S up to
# _MAX_RETRY_PAUSE_S: refused for capacity (the model busy past the queue's wait, its queue full,
# the principal's cap, a model still loading), until it is answered or no line may run any more
# (expired, cancelled), so a batch waits out interactive load within its window; any other 429 or
# 503 (a worker or engine lost, a model out of service) at most _TRIES times in all, so a line
# that fails for its own sake (one that hangs its engine) ends with its error.
_RETRY_PAUSE_S = 1.0
_MAX_RETRY_PAUSE_S = 60.0
_TRIES = 6
_WAITED_OUT = frozenset({ErrorCode.QUEUE_TIMEOUT, ErrorCode.QUEUE_FULL, ErrorCode.RATE_LIMIT_EXCEEDED,
                         ErrorCode.MODEL_LOADING})
# How long a runner waits for its events to reach the ledger before it gives the claim back.
_PROJECTION_WAIT_S = 120.0
# How long a claim waits for its batch.created to be projected before it is dropped.
_UNKNOWN_BATCH_S = 600.0
# How long past its window a batch may still be claimed: one that has not ended by then (its lines
# never all reach the ledger, or every runner holding it dies) ends with what is recorded, rather
# than coming back forever. Counted from `expires_at`, so no healthy batch is ever cut by it.
GIVE_UP_AFTER_EXPIRY_S = 3600.0


class BatchRunner:
    def __init__(self, bus: GatewayBus, batches: BatchStore, files: FileStore, generations: GenerationPipeline,
                 concurrency: int, max_body_bytes: int, events_emit: Callable[[AnyEvent], None],
                 metrics: GatewayMetrics) -> None:
        self._bus = bus
        self._batches = batches
        self._files = files
        self._generations = generations
        self._concurrency = concurrency
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics
        self._emit = events_emit
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop pulling and running; bounded, so a gateway's shutdown never waits on it: a
        cancellation that `asyncio.wait_for` lost (Python 3.11) is repeated, and the loop also
        checks `_stopping` between pulls."""
        self._stopping = True
        task = self._task
        if task is None:
            return
        for _ in range(3):
            task.cancel()
            done, _pending = await asyncio.wait({task}, timeout=2.0)
            if done:
                break
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so it is not logged as never retrieved

    async def _loop(self) -> None:
        puller: BatchPuller | None = None
        try:
            while not self._stopping:
                try:
                    if puller is None or puller.nc is not self._bus.nc:  # the connection was replaced
                        puller = await topology.batch_puller(self._bus.nc)
                    claims = await puller.fetch(1, timeout=_CLAIM_WAIT_S)
                except Exception as exc:
                    log.warning("batch runner cannot pull claims", extra={"detail": repr(exc)})
                    await asyncio.sleep(_POLL_S)
                    continue
                for claim in claims:
                    await self._hold(claim)
        finally:
            if puller is not None and not puller.nc.is_closed:
                for claim in await puller.stop():  # came as the runner stopped: another gateway's now
                    with contextlib.suppress(nats.errors.Error):
                        await claim.nak()

    async def _hold(self, claim: Msg) -> None:
        batch_id = claim.data.decode(errors="replace")
        keep_alive = asyncio.create_task(keep_claim_alive(self._bus.nc, claim))
        try:
            finished = await self.run(batch_id, claim.metadata.num_delivered)
        except asyncio.CancelledError:
            await asyncio.shield(claim.nak())  # this gateway stops: another runner takes it now
            raise
        except _GatewayStopping:
            self._stopping = True  # this gateway takes no more claims, this one included
            keep_alive.cancel()
            await claim.nak()  # its lines in flight were not recorded: whoever takes it runs them
            return
        except Exception as exc:
            log.warning("batch interrupted", extra={"batch_id": batch_id, "detail": repr(exc)})
            finished = False
        finally:
            keep_alive.cancel()
        if finished:
            await claim.ack()
        else:
            await claim.nak(delay=_POLL_S * 5)

    async def run(self, batch_id: str, delivery: int) -> bool:
        """Run the batch to its end; False if it is not known yet (the claim comes back later)."""
        batch = await self._batches.read(batch_id)
        if batch is None:
            made = BATCH_IDS.made_at_s(batch_id)
            return made is None or time.time() - made > _UNKNOWN_BATCH_S
        if batch.status in TERMINAL:
            return True
        expires_at = batch.row.get("expires_at")
        if expires_at is not None and time.time() > expires_at + GIVE_UP_AFTER_EXPIRY_S:
            return await self._give_up(batch)
        content = await self._input(batch)
        if content is None:
            self._batches.set_status(batch_id, "failed", errors=[line_error(
                "invalid_file", f"The input file {batch.row['input_file_id']} is gone.")])
            await self._until(batch_id, lambda b: b.status in TERMINAL)
            return True
        lines = await asyncio.to_thread(split_lines, content)
        if batch.row.get("total") is None:
            self._batches.set_status(batch_id, "in_progress", total=len(lines))
        done = await self._batches.lines_done(batch_id)
        prepared = await asyncio.to_thread(self._prepare_all, batch, lines, done, delivery)
        stop = _Stop(batch)
        watcher = asyncio.create_task(self._watch(batch_id, stop))
        try:
            await self._run_lines(batch, prepared, stop)
        finally:
            watcher.cancel()
        if stop.reason == "stopping":
            raise _GatewayStopping(batch_id)
        if stop.reason == "ended":
            log.warning("batch ended elsewhere while it ran: no more of its lines start",
                        extra={"batch_id": batch_id})
            return True
        if stop.reason == "expired":
            for expired in expired_lines(batch_id, prepared, stop.started):
                stop.started.add(expired.line)
                self._emit(expired)
        await self._until_lines(batch_id, done | stop.started)
        self._batches.set_status(batch_id, "finalizing")
        return await self._end_with_outputs(batch, stop.reason or "completed")

    async def _give_up(self, batch: StoredBatch) -> bool:
        """End a batch still claimed GIVE_UP_AFTER_EXPIRY_S past its window: `expired` (`cancelled`
        if it was being cancelled), with the output and error files of the lines the ledger has."""
        log.warning("batch given up past its window", extra={"batch_id": batch.batch_id})
        recorded = len(await self._batches.lines_done(batch.batch_id))
        return await self._end_with_outputs(batch, "cancelled" if batch.status == "cancelling" else "expired",
                                            errors=[line_error("batch_incomplete", (
                                                f"The batch had not ended {GIVE_UP_AFTER_EXPIRY_S / 3600:g} h past its "
                                                f"window; the output and error files hold the {recorded} lines "
                                                "recorded."))])

    async def _end_with_outputs(self, batch: StoredBatch, final: str, **fields: Any) -> bool:
        """Write the output and error files of the lines the ledger has, end the batch `final` with
        them (and `fields`), and wait until the ledger has it so."""
        output, errors = await self._write_outputs(batch)
        self._batches.set_status(batch.batch_id, final, output_file_id=output, error_file_id=errors, **fields)
        await self._until(batch.batch_id, lambda b: b.status in TERMINAL)
        return True

    def _prepare_all(self, batch: StoredBatch, lines: list[bytes], done: set[int],
                     delivery: int) -> list[Prepared | BatchLine]:
        out: list[Prepared | BatchLine] = []
        seen: set[str] = set()
        for number, raw in enumerate(lines, start=1):
            item = prepare(batch, number, raw, delivery, self._max_body_bytes)
            custom_id = item.custom_id
            if custom_id is not None and custom_id in seen:
                item = line_event(batch.batch_id, number, None, error=line_error(
                    "duplicate_custom_id", f"Line {number} repeats custom_id '{wire.bounded_text(custom_id, 64)}'."))
            elif custom_id is not None:
                seen.add(custom_id)
            if number not in done:
                out.append(item)
        return out

    async def _run_lines(self, batch: StoredBatch, items: list[Prepared | BatchLine], stop: _Stop) -> None:
        slots = asyncio.Semaphore(self._concurrency)
        running: set[asyncio.Task[None]] = set()
        for item in items:
            if stop.reason is not None:
                break
            if isinstance(item, BatchLine):
                stop.started.add(item.line)
                self._metrics.batch_lines.labels("invalid").inc()
                self._emit(item)
                continue
            await slots.acquire()
            if stop.reason is not None:
                slots.release()
                break
            stop.started.add(item.line)
            task = asyncio.create_task(self._line(batch, item, stop))
            running.add(task)
            task.add_done_callback(running.discard)
            task.add_done_callback(lambda _: slots.release())
        if running:
            await asyncio.gather(*running)

    async def _line(self, batch: StoredBatch, item: Prepared, stop: _Stop) -> None:
        request = item.request
        self._metrics.batch_lines_running.inc()
        try:
            attempt = 0
            while True:
                status, body = await self._answer(request, item)
                if status not in (429, 503) or (_code(body) not in _WAITED_OUT and attempt == _TRIES - 1):
                    break
                await stop.wait(min(_RETRY_PAUSE_S * 2 ** attempt, _MAX_RETRY_PAUSE_S))
                if stop.reason is not None:
                    break  # its last refusal is its answer
                attempt += 1
                request = msgspec.structs.replace(request, request_id=f"{item.request.request_id}-r{attempt}")
        except _GatewayStopping:
            # Ended by this gateway's stop, not answered: neither retried here nor recorded as a
            # failure, and no line starts after it; whoever takes the claim runs it.
            stop.end("stopping")
            return
        finally:
            self._metrics.batch_lines_running.dec()
        self._metrics.batch_lines.labels("answered" if status == 200 else "failed").inc()
        self._emit(line_event(batch.batch_id, item.line, item.custom_id, status, request.request_id, body))

    async def _answer(self, request: wire.GenerateRequest, item: Prepared) -> tuple[int, dict[str, Any]]:
        try:
            await check_enforceable(request, item.constraint_param)
            response = await self._generations.serve(None, request, item.formatter, HANDLER, item.output_param)
        except ServingError as exc:
            if exc.code == ErrorCode.GATEWAY_STOPPING:
                raise _GatewayStopping(request.request_id) from None
            return exc.status, error_body(exc.status, exc.message, exc.code)
        content = response.content
        body = msgspec.json.decode(content) if isinstance(content, bytes) else content
        body = body if isinstance(body, dict) else {"content": body}
        status = response.status_code or 200
        if status == 503 and _code(body) == ErrorCode.GATEWAY_STOPPING:  # ended after its first frame
            raise _GatewayStopping(request.request_id)
        return status, body

    async def _watch(self, batch_id: str, stop: _Stop) -> None:
        while stop.reason is None:
            await stop.wait(_POLL_S)
            try:
                batch = await self._batches.read(batch_id)
            except ServingError as exc:  # the ledger away for now: the expiry is still watched
                log.warning("a running batch's status cannot be read", extra={"batch_id": batch_id,
                                                                              "detail": exc.message})
                batch = None
            if batch is not None:
                if batch.status == "cancelling":
                    stop.end("cancelled")
                elif batch.status in TERMINAL:
                    # Ended elsewhere: `failed` by a gateway that could not tell its claim was queued.
                    stop.end("ended")
                stop.expires_at = batch.row["expires_at"]  # the ledger owns the deadline
            stop.check_expiry()

    async def _input(self, batch: StoredBatch) -> bytes | None:
        """The batch's input file, or None when it is gone (a 404). The ledger or the bus away (a
        503) raises: the claim comes back later, the batch is not failed for the weather."""
        try:
            _, chunks = await self._files.content(batch.row["input_file_id"], batch.principal)
        except ServingError as exc:
            if exc.status == 404:
                return None
            raise
        return b"".join([chunk async for chunk in chunks])

    async def _until_lines(self, batch_id: str, lines: set[int]) -> None:
        """Wait until the ledger has `lines`; an event lost on its way (the publisher's backlog full)
        ends the wait with TimeoutError, and the claim comes back to run what is missing."""
        async with asyncio.timeout(_PROJECTION_WAIT_S):
            while not lines <= await self._batches.lines_done(batch_id):
                await asyncio.sleep(_POLL_S / 4)

    async def _until(self, batch_id: str, done: Callable[[StoredBatch], bool]) -> None:
        async with asyncio.timeout(_PROJECTION_WAIT_S):
            while True:
                batch = await self._batches.read(batch_id)
                if batch is not None and done(batch):
                    return
                await asyncio.sleep(_POLL_S / 4)

    async def _write_outputs(self, batch: StoredBatch) -> tuple[str | None, str | None]:
        """The output file (answered lines) and the error file (the rest), each written from the
        ledger a page of lines at a time; None for one that would be empty."""
        ids: list[str | None] = []
        for name, answered in (("output", True), ("errors", False)):
            pages = self._batches.line_pages(batch.batch_id, answered)
            first = await anext(pages, None)
            if first is None:
                ids.append(None)
                continue
            stored = await self._files.create_output(batch.principal, f"{batch.batch_id}_{name}.jsonl",
                                                     _chunks(first, pages))
            ids.append(stored.file_id)
        return ids[0], ids[1]


async def _chunks(first: list[Any], pages: AsyncIterator[list[Any]]) -> AsyncIterator[bytes]:
    """Output lines in chunks of about 1 MiB, from a first page of rows and the pages after it."""
    buffer = bytearray()
    rows: list[Any] | None = first
    while rows is not None:
        for row in rows:
            buffer += output_line(row)
            if len(buffer) >= 1 << 20:
                yield bytes(buffer)
                buffer.clear()
        rows = await anext(pages, None)
    if buffer:
        yield bytes(buffer)


class _GatewayStopping(Exception):
    """This gateway is stopping and ended a line's answer: the batch goes back to the queue."""


class _Stop:
    """Why no further line of a batch starts: None (they do), `cancelled`, `expired`, `ended` (the
    ledger has it in a final state this run did not give it), or `stopping` (this gateway is)."""

    def __init__(self, batch: StoredBatch) -> None:
        self.reason: str | None = None
        self._ended = asyncio.Event()
        if batch.status == "cancelling":
            self.end("cancelled")
        self.expires_at = batch.row["expires_at"]
        # The lines this run recorded or started (each is recorded once it finishes).
        self.started: set[int] = set()
        self.check_expiry()

    def end(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._ended.set()

    async def wait(self, timeout_s: float) -> None:
        """Until `timeout_s` has passed or no line may run any more, whichever is first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), timeout_s)

    def check_expiry(self) -> None:
        if self.expires_at is not None and time.time() >= self.expires_at:
            self.end("expired")


def _code(body: dict[str, Any]) -> str | None:
    """An error body's `error.code`, if it is one."""
    error = body.get("error")
    return error.get("code") if isinstance(error, dict) else None


async def keep_claim_alive(nc: NatsClient, claim: Msg) -> None:
    """In-progress acks on a batch's claim until cancelled, at a quarter of the claim's ack wait as
    the server has it (`topology.batch_ack_wait_s`), so the claim never passes to another runner
    while this one lives. The first ack goes before the read, which is bounded: a read that fails
    leaves the claim its full ack wait, and the acks go on at the shortest wait's quarter."""
    every_s = topology.MIN_BATCH_ACK_WAIT_S / 4
    try:
        await claim.in_progress()
        every_s = await topology.batch_ack_wait_s(nc, timeout_s=every_s) / 4
    except Exception as exc:
        log.warning("batch claim kept alive every %.1f s: its ack wait unread", every_s, extra={"detail": repr(exc)})
    while True:
        await asyncio.sleep(every_s)
        try:
            await claim.in_progress()
        except Exception as exc:
            log.warning("batch claim not kept alive", extra={"detail": repr(exc)})
