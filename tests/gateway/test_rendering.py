"""SSE rendering: what one frame renders to leaves as one body part (one socket write on the gateway,
one read on the client), however many events it holds, and the events are those the API defines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from apps.bus import wire
from apps.bus.codes import FinishReason
from apps.gateway.api.chat import ChatFormatter
from apps.gateway.rendering import sse_chunks
from engine.frontend.protocol import SamplingParams


def events(part: bytes) -> list[str]:
    return [event.removeprefix("data: ") for event in part.decode().split("\n\n") if event]


def render(request: wire.GenerateRequest,
           frames: AsyncIterator[wire.Delta | wire.Final]) -> tuple[list[bytes], list[bool]]:
    """The SSE body parts a chat stream of `frames` makes, and whether its close ran."""
    closed: list[bool] = []

    async def close() -> None:
        closed.append(True)

    async def collect() -> list[bytes]:
        accepted = wire.Accepted(seq=0, attempt=1, node="n", prompt_tokens=3)
        return [part async for part in sse_chunks(accepted, frames, ChatFormatter(request, True), close)]

    return asyncio.run(collect()), closed


def test_each_frame_is_one_body_part_holding_all_its_events() -> None:
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.r", stream=True,
                                   sampling=SamplingParams(n=2))
    frames: list[wire.Delta | wire.Final] = [
        wire.Delta(seq=1, attempt=1, text="Hi", num_tokens=1, index=0),
        # The second choice's last text and its finish: two chat events from one frame.
        wire.Delta(seq=2, attempt=1, text="Yo", num_tokens=1, index=1, finish_reason=FinishReason.STOP),
        wire.Final(seq=3, attempt=1, finish_reason=FinishReason.STOP,
                   usage=wire.Usage(prompt_tokens=3, completion_tokens=2)),
    ]
    async def replay() -> AsyncIterator[wire.Delta | wire.Final]:
        for frame in frames:
            yield frame

    parts, closed = render(request, replay())
    # The start (a role event per choice), the two deltas, the final, the end marker.
    assert len(parts) == 5, parts
    assert [len(events(part)) for part in parts[:3]] == [2, 1, 2]
    first = [json.loads(event)["choices"][0] for event in events(parts[0])]
    assert [(c["index"], c["delta"]["role"]) for c in first] == [(0, "assistant"), (1, "assistant")]
    finishing = [json.loads(event)["choices"][0] for event in events(parts[2])]
    assert finishing[0]["delta"]["content"] == "Yo" and finishing[1]["finish_reason"] == "stop"
    assert events(parts[4]) == ["[DONE]"] and closed == [True]


def test_a_bug_after_the_first_chunk_ends_the_stream_with_an_error_event_not_a_cut() -> None:
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.r", stream=True,
                                   sampling=SamplingParams())
    async def broken() -> AsyncIterator[wire.Delta | wire.Final]:
        yield wire.Delta(seq=1, attempt=1, text="Hi", num_tokens=1, index=0)
        raise RuntimeError("a bug in the frames' path")

    parts, closed = render(request, broken())
    error = json.loads(events(parts[-2])[0])["error"]
    assert error["code"] == "internal_error" and "RuntimeError" not in error["message"]
    assert events(parts[-1]) == ["[DONE]"] and closed == [True]
