"""A generation as a Responses API answer: output items built from the worker's deltas, whole or
as the full semantic event stream.

The stream goes `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its parts and deltas (`response.content_part.added`,
`response.output_text.delta` / `response.reasoning_text.delta`, `...done`,
`response.content_part.done`; a function call's `response.function_call_arguments.delta` and
`.done`) and `response.output_item.done`, and last `response.completed` (or `response.incomplete`
when the output was cut short; `error` and `response.failed` when the generation failed). Every
event carries a `sequence_number` counting from 0. Streamed and whole answers are built from the
same deltas by the same `OutputBuilder`, so they agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason, ServingError
from apps.gateway.api import responses_schema as rs
from apps.gateway.errors import error_body

_encode = msgspec.json.encode
Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _snapshot(struct: msgspec.Struct) -> Any:
    # Events hold a copy: the item goes on growing after the event is made.
    return msgspec.to_builtins(struct)


def output_logprobs(entries: list[wire.TokenLogprobs]) -> list[dict[str, Any]]:
    """Logprobs of output text, as `ResponseOutputText.logprobs` holds them."""
    return [{"token": e.token, "bytes": e.bytes, "logprob": e.logprob,
             "top_logprobs": [{"token": t, "bytes": b, "logprob": lp} for t, lp, b in e.top]}
            for e in entries]


def _without_bytes(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprobs as the text delta and done events carry them (`ResponseTextDeltaEvent.Logprob`)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs]


class OutputBuilder:
    """Output items from deltas: reasoning, then text, then function calls, in the order they come."""

    def __init__(self, with_logprobs: bool, namespaces: dict[str, tuple[str, str]] | None = None) -> None:
        self.with_logprobs = with_logprobs
        # A namespaced function's qualified name -> (namespace, name) (`responses_tools`).
        self.namespaces = namespaces or {}
        self.items: list[rs.OutputItem] = []
        self._open: rs.OutputMessage | rs.OutputReasoning | None = None
        # The open item's text so far, joined into it when it closes (a `+=` per delta on the
        # item would copy the whole text each time).
        self._parts: list[str] = []
        # Its logprobs as the text events carry them (without bytes), made a delta at a time.
        self._event_logprobs: list[dict[str, Any]] = []

    def feed(self, delta: wire.Delta) -> list[Event]:
        events = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.text:
            events += self._text(delta.text, delta.logprobs if self.with_logprobs else None)
        for call in delta.tool_calls:
            events += self._function_call(call)
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """End the item being written; `status` is "incomplete" when the generation was cut short."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.content[0].text, self._parts = "".join(self._parts), []
        event_logprobs, self._event_logprobs = self._event_logprobs, []
        item.status = status  # type: ignore[assignment]  # an item type narrows its status
        index = len(self.items) - 1
        place = {"item_id": item.id, "output_index": index, "content_index": 0}
        # A closed item changes no more: its done events hold it as it is, not a copy (a copy of
        # an answer's logprobs is half a second at their bound).
        if isinstance(item, rs.OutputMessage):
            part = item.content[0]
            events = [{"type": "response.output_text.done", **place, "text": part.text,
                       "logprobs": event_logprobs},
                      {"type": "response.content_part.done", **place, "part": part}]
        else:
            reasoning = item.content[0]
            events = [{"type": "response.reasoning_text.done", **place, "text": reasoning.text},
                      {"type": "response.content_part.done", **place, "part": reasoning}]
        return [*events, {"type": "response.output_item.done", "output_index": index, "item": item}]

    def so_far(self) -> list[rs.OutputItem]:
        """The items as they stand, the open one with its text so far (it stays open)."""
        if self._open is not None:
            self._open.content[0].text = "".join(self._parts)
        return self.items

    def _add(self, item: rs.OutputItem) -> list[Event]:
        events = self.close()
        self.items.append(item)
        return [*events, {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                          "item": _snapshot(item)}]

    def _place(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1, "content_index": 0}

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, rs.OutputReasoning):
            item = rs.OutputReasoning(id=_item_id("rs"), content=[], status="in_progress")
            events += self._add(item)
            item.content.append(rs.ReasoningText(text=""))
            self._open = item
            events.append({"type": "response.content_part.added", **self._place(),
                           "part": _snapshot(item.content[0])})
        self._parts.append(text)
        return [*events, {"type": "response.reasoning_text.delta", **self._place(), "delta": text}]

    def _text(self, text: str, logprobs: list[wire.TokenLogprobs] | None) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, rs.OutputMessage):
            item = rs.OutputMessage(id=_item_id("msg"), content=[], status="in_progress")
            events += self._add(item)
            item.content.append(rs.OutputText(text="", logprobs=[] if self.with_logprobs else None))
            self._open = item
            events.append({"type": "response.content_part.added", **self._place(),
                           "part": _snapshot(item.content[0])})
        part = self._open.content[0]
        self._parts.append(text)
        shown = output_logprobs(logprobs or [])
        in_event = _without_bytes(shown)
        if part.logprobs is not None:
            part.logprobs += shown
            self._event_logprobs += in_event
        return [*events, {"type": "response.output_text.delta", **self._place(), "delta": text,
                          "logprobs": in_event}]

    def _function_call(self, call: wire.ToolCallDelta) -> list[Event]:
        namespace, name = self.namespaces.get(call.name, (None, call.name))
        item = rs.OutputFunctionCall(id=_item_id("fc"), call_id=call.id, name=name, arguments="",
                                     status="in_progress", namespace=namespace)
        events = self._add(item)
        index = len(self.items) - 1
        item.arguments, item.status = call.arguments, "completed"
        return [*events,
                {"type": "response.function_call_arguments.delta", "item_id": item.id, "output_index": index,
                 "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": item.id, "output_index": index,
                 "name": name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": _snapshot(item)}]


def response_usage(usage: wire.Usage) -> rs.ResponseUsage:
    return rs.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        output_tokens=usage.completion_tokens,
        output_tokens_details={"reasoning_tokens": usage.reasoning_tokens},
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


# The `ResponseError.code` values the SDK knows; everything of ours is a server error to it.
_RESPONSE_ERROR_CODES = {ErrorCode.RATE_LIMIT_EXCEEDED: "rate_limit_exceeded",
                         ErrorCode.INVALID_PROMPT: "invalid_prompt"}


class ResponsesFormatter:
    """A Responses answer, whole (`response`) or as its event stream; `on_complete` gets the final
    response object (to store it) once the generation has ended well, `on_failed` is told when it
    ended in an error instead (nothing will be stored)."""

    def __init__(self, template: rs.ResponseObject, with_logprobs: bool,
                 on_complete: Callable[[rs.ResponseObject], None] | None = None,
                 namespaces: dict[str, tuple[str, str]] | None = None,
                 on_failed: Callable[[], None] | None = None) -> None:
        self.template = template
        self.on_complete = on_complete
        self.on_failed = on_failed
        self._output = OutputBuilder(with_logprobs, namespaces)
        self._finish: FinishReason | None = None
        self._sequence = 0

    def _feed(self, delta: wire.Delta) -> list[Event]:
        self._finish = delta.finish_reason or self._finish
        return self._output.feed(delta)

    def _finished(self, final: wire.Final) -> tuple[rs.ResponseObject, list[Event]]:
        cut_short = (self._finish or final.finish_reason) == FinishReason.LENGTH
        events = self._output.close("incomplete" if cut_short else "completed")
        response = msgspec.structs.replace(
            self.template, status="incomplete" if cut_short else "completed", output=self._output.items,
            usage=response_usage(final.usage), completed_at=None if cut_short else int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut_short else None)
        if self.on_complete is not None:
            self.on_complete(response)
        return response, events

    def _sse(self, event: Event) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"

    def whole(self, deltas: list[wire.Delta], final: wire.Final) -> rs.ResponseObject:
        for delta in deltas:
            self._feed(delta)
        return self._finished(final)[0]

    def error_body(self, error: ServingError) -> dict[str, Any]:
        if self.on_failed is not None:
            self.on_failed()
        return error_body(error.status, error.message, error.code, error.param)

    def stream_start(self, accepted: wire.Accepted) -> list[bytes]:
        return [self._sse({"type": kind, "response": self.template})
                for kind in ("response.created", "response.in_progress")]

    def stream_delta(self, delta: wire.Delta) -> list[bytes]:
        return [self._sse(event) for event in self._feed(delta)]

    def stream_final(self, final: wire.Final) -> list[bytes]:
        response, events = self._finished(final)
        done = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return [self._sse(event) for event in [*events, {"type": done, "response": response}]]

    def stream_error(self, error: ServingError) -> bytes:
        if self.on_failed is not None:
            self.on_failed()
        code = _RESPONSE_ERROR_CODES.get(error.code, "server_error") if error.code else "server_error"
        failed = msgspec.structs.replace(self.template, status="failed", output=self._output.so_far(),
                                         error=rs.ResponseError(code=code, message=error.message))
        return (self._sse({"type": "error", "code": error.code, "message": error.message, "param": error.param})
                + self._sse({"type": "response.failed", "response": failed}))

    def stream_end(self) -> list[bytes]:
        return []
