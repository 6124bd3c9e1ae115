"""A stream's engine outputs wait out its frame window in the engine's queue (`Replier.hold_outputs`,
`engine.frontend.core_client.OutputStream.hold`): its run wakes once a window, not once a step,
takes what queued merged, and its text still leaves when the window closes, in the same message as
every other stream's. Frames go through a real NATS server to the gateway's reply router."""

from __future__ import annotations

import asyncio
from pathlib import Path

from apps.bus import wire
from apps.bus.codes import FinishReason
from apps.gateway.reply_stream import ReplyStream
from apps.worker.frame_outbox import outbox_of
from apps.worker.replies import Replier
from engine.frontend.core_client import OutputQueue, OutputStream
from engine.frontend.protocol import EngineOutput
from tests.worker.in_process import gateway_and_worker

USAGE = wire.Usage(prompt_tokens=1, completion_tokens=6)
# Far longer than the test takes to queue a window's outputs, however slow the machine.
WINDOW_S = 2.0


def output(token: int, finished: bool = False) -> EngineOutput:
    return EngineOutput("r", [token], finished=finished, finish_reason=FinishReason.STOP if finished else None)


async def run_choice(outputs: OutputStream, replier: Replier, taken: list[list[int]], took: asyncio.Event) -> None:
    """What a choice's run does with its outputs (`apps.worker.choices.generate_choice`)."""
    async for out in outputs:
        taken.append(out.new_token_ids)
        took.set()
        ids = out.new_token_ids
        await replier.delta("".join(f"<{t}>" for t in ids), len(ids), token_ids=ids,
                            finish_reason=FinishReason.STOP if out.finished else None)
        if not out.finished:
            replier.hold_outputs(0, outputs)
    await replier.final(FinishReason.STOP, USAGE)


async def test_held_outputs_wake_their_run_once_a_window_and_leave_in_one_message(tmp_path: Path) -> None:
    async with gateway_and_worker(tmp_path, "hold") as (_, worker, router):
        streams = [ReplyStream() for _ in range(4)]
        queues = [OutputQueue() for _ in streams]
        taken: list[list[list[int]]] = [[] for _ in streams]
        took = [asyncio.Event() for _ in streams]
        runs = []
        for i, stream in enumerate(streams):
            subject = router.new_reply_subject()
            router.follow(stream, subject)
            replier = Replier(worker, subject, attempt=1, node="w", frame_window=WINDOW_S)
            outputs = OutputStream(queues[i], lambda finished: None)
            runs.append(asyncio.create_task(run_choice(outputs, replier, taken[i], took[i])))
        outbox = outbox_of(worker)
        # A stream whose text the Replier itself holds (an engine whose outputs cannot be held):
        # its window closes first, and its frame still shares the message with the others.
        plain_stream = ReplyStream()
        plain_subject = router.new_reply_subject()
        router.follow(plain_stream, plain_subject)
        plain = Replier(worker, plain_subject, attempt=1, node="w", frame_window=WINDOW_S)
        await plain.delta("a", 1, token_ids=[1])
        await plain.delta("b", 1, token_ids=[2])

        # The first token goes alone and at once.
        for queue in queues:
            queue.put_nowait(output(1))
        for stream in streams:
            first = await stream.next(10)
            assert isinstance(first, wire.Delta) and first.token_ids == [1]
        messages_before = outbox.messages
        for event in took:
            event.clear()
        # Four more steps inside the window: they queue, and no run wakes for them.
        for token in range(2, 6):
            for queue in queues:
                queue.put_nowait(output(token))
        assert all(not queue.ready and len(queue.items) == 4 for queue in queues)
        # The window closes: each run wakes once and takes the four merged.
        for stream in streams:
            second = await stream.next(10)
            assert isinstance(second, wire.Delta) and second.token_ids == [2, 3, 4, 5]
            assert second.text == "<2><3><4><5>"
        assert taken == [[[1], [2, 3, 4, 5]]] * len(streams)
        assert [f.text for f in [await plain_stream.next(10) for _ in range(2)] if isinstance(f, wire.Delta)] == [
            "a", "b"]
        # The five streams' window frames shared one message.
        assert outbox.messages == messages_before + 1
        # The last output is never held: it wakes its run at once.
        for queue in queues:
            queue.put_nowait(output(6, finished=True))
        for stream in streams:
            last = await stream.next(10)
            assert isinstance(last, wire.Delta) and last.token_ids == [6] and last.finish_reason == FinishReason.STOP
            assert isinstance(await stream.next(10), wire.Final)
        await asyncio.gather(*runs)
        await plain.final(FinishReason.STOP, USAGE)


async def test_a_held_queue_wakes_its_reader_for_its_last_output_and_on_release() -> None:
    queue = OutputQueue()
    stream = OutputStream(queue, lambda finished: None)
    stream.hold()
    assert not stream.release(), "nothing was waiting"
    stream.hold()
    queue.put_nowait(output(1))
    reader = asyncio.create_task(stream.__anext__())
    for _ in range(5):  # turns of the loop in which a woken reader would have finished
        await asyncio.sleep(0)
    assert not reader.done(), "a held output woke its reader"
    assert stream.release()
    assert (await reader).new_token_ids == [1]
    stream.hold()
    queue.put_nowait(output(2))
    queue.put_nowait(output(3, finished=True))
    last = await asyncio.wait_for(stream.__anext__(), 10)
    assert last.new_token_ids == [2, 3] and last.finished
