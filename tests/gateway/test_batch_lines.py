"""A batch's input lines, each decoded and bounded by the live route's own code: a valid line is
the request the live route would build (batch class, not streamed, a deterministic id); anything
else is that line's error line, never the batch's failure."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from litestar import Response

from apps.bus.codes import ErrorCode, ServingError
from apps.bus.events import BatchLine
from apps.gateway.batch_lines import Prepared, expired_lines, output_line, prepare, split_lines
from apps.gateway.batch_runner import BatchRunner, _Stop
from apps.gateway.batch_store import StoredBatch
from apps.gateway.errors import error_body
from apps.gateway.file_store import MAX_CUSTOM_ID_CHARS
from apps.gateway.metrics import GatewayMetrics
from engine.frontend.protocol import ServiceClass
from tests.support import Emitted

BATCH = StoredBatch({"batch_id": "batch_x", "principal": "alice", "endpoint": "/v1/chat/completions"})
MAX_BODY = 4096


def raw(custom_id: str = "c1", url: str = "/v1/chat/completions", **body: object) -> bytes:
    body = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def test_a_valid_line_is_the_live_routes_request_in_the_batch_class() -> None:
    prepared = prepare(BATCH, 3, raw(), 2, MAX_BODY)
    assert isinstance(prepared, Prepared)
    request = prepared.request
    assert (request.request_id, request.principal, request.model) == ("batch_x-3-2", "alice", "m")
    assert request.service_class == ServiceClass.BATCH and request.stream is False
    assert prepare(BATCH, 3, raw(), 2, MAX_BODY).request.request_id == request.request_id  # type: ignore[union-attr]


def test_invalid_lines_are_error_lines_naming_what_is_wrong() -> None:
    cases = {
        b"[1, 2]": (None, "not a batch request line"),
        raw(url="/v1/completions"): ("c1", "must be a POST to /v1/chat/completions"),
        raw(model="m"): ("c1", "'messages'"),
        raw(model="m", messages=[{"role": "user", "content": "x" * MAX_BODY}]): ("c1", "max_request_bytes"),
        # Longer than the ledger can index: kept out of the line's event.
        raw(custom_id="c" * (MAX_CUSTOM_ID_CHARS + 1)): (None, "$.custom_id"),
    }
    for line, (custom_id, says) in cases.items():
        error = prepare(BATCH, 7, line, 1, MAX_BODY)
        assert isinstance(error, BatchLine), line
        assert (error.event_id, error.line, error.custom_id, error.status_code) == ("batch_x.7", 7, custom_id, None)
        assert error.error is not None and says in error.error["message"], error.error


def test_lines_and_output_lines() -> None:
    assert split_lines(b'{"a": 1}\r\n{"b": 2}\n') == [b'{"a": 1}', b'{"b": 2}']
    row = {"batch_id": "batch_x", "line": 4, "custom_id": "c4", "status_code": 200, "request_id": "batch_x-4-1",
           "body": '{"id": "chatcmpl-1"}', "error": None}
    assert json.loads(output_line(row)) == {
        "id": "batch_req_x_4", "custom_id": "c4", "error": None,
        "response": {"status_code": 200, "request_id": "batch_x-4-1", "body": {"id": "chatcmpl-1"}}}


def test_a_completions_batch_decodes_completion_requests() -> None:
    batch = StoredBatch({**BATCH.row, "endpoint": "/v1/completions"})
    line = json.dumps({"custom_id": "p1", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "Once", "max_tokens": 4}}).encode()
    prepared = prepare(batch, 1, line, 1, MAX_BODY)
    assert isinstance(prepared, Prepared)
    assert prepared.request.service_class == ServiceClass.BATCH and prepared.request.sampling.max_tokens == 4
    wrong = prepare(batch, 2, raw(url="/v1/completions"), 1, MAX_BODY)  # a chat body is not a completion
    assert isinstance(wrong, BatchLine) and wrong.error is not None


def test_at_expiry_the_lines_never_started_are_batch_expired_error_lines() -> None:
    items = [prepare(BATCH, 1, raw("a"), 1, MAX_BODY), prepare(BATCH, 2, b"[1]", 1, MAX_BODY),
             prepare(BATCH, 3, raw("c"), 1, MAX_BODY), prepare(BATCH, 4, raw("d"), 1, MAX_BODY)]
    expired = expired_lines("batch_x", items, started={1})
    assert [(e.line, e.custom_id) for e in expired] == [(2, None), (3, "c"), (4, "d")]
    assert expired[0] is items[1]  # an invalid line keeps its own error
    for event in expired[1:]:
        assert event.error is not None and event.error["code"] == "batch_expired"
        assert (event.status_code, event.body, event.event_id) == (None, None, f"batch_x.{event.line}")


class _StoppingGateway:
    """The generation pipeline of a gateway that is stopping: every answer in flight ends with
    `gateway_stopping` (`app.end_in_flight`): raised before the first frame, or as the 503 answer
    `rendering.whole_response` makes of it after."""

    def __init__(self, after_first_frame: bool) -> None:
        self.served, self.after_first_frame = 0, after_first_frame

    async def serve(self, *args: object) -> object:
        self.served += 1
        error = ServingError(503, ErrorCode.GATEWAY_STOPPING, "The gateway is stopping.")
        if self.after_first_frame:
            return Response(content=msgspec.json.encode(error_body(503, error.message, error.code)), status_code=503)
        raise error


@pytest.mark.parametrize("after_first_frame", [False, True], ids=["before-its-first-frame", "after"])
async def test_lines_ended_by_the_gateways_stop_are_not_retried_nor_recorded_and_the_batch_goes_back(
        after_first_frame: bool) -> None:
    """A line's answer ended because this gateway stops is not the line's failure: it is not
    retried here (which would publish it again on a closing gateway) nor recorded as an error
    line (which would end it for good); no line starts after it, and the batch goes back to the
    queue, for whoever takes it to run the lines not recorded."""
    gateway, emitted = _StoppingGateway(after_first_frame), Emitted()
    runner = BatchRunner(None, None, None, gateway, 2, MAX_BODY, emitted.emit,  # type: ignore[arg-type]
                         GatewayMetrics())
    items = [prepare(BATCH, n, raw(f"c{n}"), 1, MAX_BODY) for n in range(1, 6)]
    batch = StoredBatch({**BATCH.row, "status": "in_progress", "expires_at": None})
    stop = _Stop(batch)
    await runner._run_lines(batch, items, stop)  # type: ignore[arg-type]
    assert stop.reason == "stopping"
    assert gateway.served == 2  # the two lines running at once, each tried once
    assert emitted.events == []


class _BusyModel:
    """A model refusing `busy_for` times in a row (by default busy with interactive work: the
    queue's wait runs out, 503 `queue_timeout`), then answering."""

    def __init__(self, busy_for: int, code: ErrorCode = ErrorCode.QUEUE_TIMEOUT) -> None:
        self.busy_for, self.served, self.code = busy_for, 0, code

    async def serve(self, *args: object) -> object:
        self.served += 1
        if self.served <= self.busy_for:
            raise ServingError(503, self.code, "Not now.")
        return Response(content=b'{"id": "chatcmpl-1"}', status_code=200)


async def test_a_line_waits_out_a_busy_model_rather_than_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interactive load longer than a few retries does not fail batch lines: a line refused for
    the moment is tried until it is answered (the batch's window bounds it, as its expiry or a
    cancel stops the retries)."""
    import apps.gateway.batch_runner as batch_runner

    monkeypatch.setattr(batch_runner, "_RETRY_PAUSE_S", 0.001)
    model, emitted = _BusyModel(busy_for=8), Emitted()  # more than the six tries a line once had
    runner = BatchRunner(None, None, None, model, 1, MAX_BODY, emitted.emit,  # type: ignore[arg-type]
                         GatewayMetrics())
    batch = StoredBatch({**BATCH.row, "status": "in_progress", "expires_at": None})
    await runner._run_lines(batch, [prepare(batch, 1, raw("c1"), 1, MAX_BODY)], _Stop(batch))  # type: ignore[list-item]
    assert model.served == 9
    assert [(e.line, e.status_code, e.body) for e in emitted.events] == [(1, 200, {"id": "chatcmpl-1"})]
    ended = _BusyModel(busy_for=10**6)
    stop = _Stop(batch)

    async def cancel_after_three() -> None:
        while ended.served < 3:
            await asyncio.sleep(0)
        stop.reason = "cancelled"

    runner = BatchRunner(None, None, None, ended, 1, MAX_BODY, emitted.emit,  # type: ignore[arg-type]
                         GatewayMetrics())
    await asyncio.gather(runner._run_lines(batch, [prepare(batch, 2, raw("c2"), 1, MAX_BODY)], stop),  # type: ignore[list-item]
                         cancel_after_three())
    assert emitted.events[-1].line == 2 and emitted.events[-1].status_code == 503
    assert ended.served == 3  # none after the cancel


async def test_a_line_that_fails_for_its_own_sake_ends_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 503 that is no matter of capacity (its worker or engine lost past the migrations, as a
    line that hangs its engine is) is tried a few times, not until the batch expires."""
    import apps.gateway.batch_runner as batch_runner

    monkeypatch.setattr(batch_runner, "_RETRY_PAUSE_S", 0.001)
    model, emitted = _BusyModel(busy_for=10**6, code=ErrorCode.ENGINE_LOST), Emitted()
    runner = BatchRunner(None, None, None, model, 1, MAX_BODY, emitted.emit,  # type: ignore[arg-type]
                         GatewayMetrics())
    batch = StoredBatch({**BATCH.row, "status": "in_progress", "expires_at": None})
    await runner._run_lines(batch, [prepare(batch, 1, raw("c1"), 1, MAX_BODY)], _Stop(batch))  # type: ignore[list-item]
    assert model.served == batch_runner._TRIES
    assert [(e.line, e.status_code) for e in emitted.events] == [(1, 503)]


class _LedgerAway:
    def __init__(self) -> None:
        self.reads, self.three_failed = 0, asyncio.Event()

    async def read(self, batch_id: str) -> object:
        self.reads += 1
        if self.reads == 3:
            self.three_failed.set()
        raise ServingError(503, ErrorCode.LEDGER_UNAVAILABLE, "The ledger is unavailable.")


async def test_a_running_batch_still_expires_while_the_ledger_is_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher is what ends retries at the batch's expiry: a ledger it cannot read for now
    does not end the watch (a line waiting out a busy model would wait forever)."""
    import apps.gateway.batch_runner as batch_runner

    monkeypatch.setattr(batch_runner, "_POLL_S", 0.01)
    ledger = _LedgerAway()
    runner = BatchRunner(None, ledger, None, None, 1, MAX_BODY, Emitted().emit,  # type: ignore[arg-type]
                         GatewayMetrics())
    clock = [0.0]
    monkeypatch.setattr(batch_runner.time, "time", lambda: clock[0])
    stop = _Stop(StoredBatch({**BATCH.row, "status": "in_progress", "expires_at": 100.0}))
    watching = asyncio.create_task(runner._watch("batch_x", stop))
    await asyncio.wait_for(ledger.three_failed.wait(), 5)
    assert stop.reason is None and not watching.done()
    clock[0] = 101.0
    await asyncio.wait_for(watching, 5)
    assert stop.reason == "expired"
