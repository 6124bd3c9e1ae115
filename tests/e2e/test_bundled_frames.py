"""A worker's frames for one gateway share NATS messages (apps/worker/frame_outbox.py): with a
scripted engine at 100 tokens/s per stream, 16 streams and a 20 ms frame window, the reply
messages the gateway gets (counted on the bus, every frame alone or in a bundle) are at most 0.3
per generated token, every stream's first token comes alone, and every stream's text is the
script's, whole and in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
from nats.aio.msg import Msg

from apps.bus import bundles, connection, roles, topology, wire
from tests.support import eventually_async
from tests.system import System, scripted_worker

MODEL = "bundles-model"
STREAMS = 16
WORDS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen twenty").split()
REPLY = " ".join(WORDS * 3)
SCRIPT = {"default": REPLY, "rules": [{"match": "", "reply": REPLY, "token_delay_s": 0.01}]}


class ReplyCounter:
    """Every message on gateways' reply subjects and bundles (not probes, not other inbox traffic)."""

    def __init__(self) -> None:
        self.messages = 0
        self.bundles = 0
        self.finals = 0

    async def on_message(self, msg: Msg) -> None:
        parts = msg.subject.split(".")
        if len(parts) != 6 or parts[4] != bundles.REPLY:
            return
        self.messages += 1
        if parts[5] == bundles.BUNDLE:
            self.bundles += 1
            frames = [frame for _, frame in bundles.decode(msg.data)]
        else:
            frames = [msg.data]
        self.finals += sum(isinstance(wire.frame_decoder.decode(f), wire.Final) for f in frames)


async def stream(client: openai.AsyncOpenAI, n: int) -> tuple[str, int, str]:
    """The stream's text, its completion tokens and its first chunk's text."""
    text, tokens, first = "", 0, None
    chunks = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"count {n}"}], stream=True,
        stream_options={"include_usage": True})
    async for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if first is None and choice.delta.content:
                first = choice.delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, first or ""


async def test_frames_of_many_streams_share_messages_and_the_text_is_whole(system: System, tmp_path: Path) -> None:
    env = {"HELEXA_FRAME_WINDOW_MS": "20", "HELEXA_MAX_NUM_SEQS": str(STREAMS)}
    counter = ReplyCounter()
    with scripted_worker(system, tmp_path, MODEL, SCRIPT, env):
        watcher = await connection.connect(system.nats_url, "test-bundle-counter")
        client = openai.AsyncOpenAI(base_url=f"{system.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            await watcher.subscribe(f"{topology.inbox_root(roles.GATEWAY)}.>", cb=counter.on_message)
            await connection.reached_server(watcher)
            answers = await asyncio.gather(*(stream(client, n) for n in range(STREAMS)))
            # Every final frame seen on the bus too, so no message is still on its way to the count.
            await eventually_async(lambda: counter.finals >= STREAMS, 30,
                                   message=lambda: f"{counter.finals} final frames seen")
        finally:
            await client.close()
            await watcher.close()
    assert [text for text, _, _ in answers] == [REPLY] * STREAMS
    # The first token was not held for the window: it came alone.
    assert [first for _, _, first in answers] == [WORDS[0]] * STREAMS
    tokens = sum(count for _, count, _ in answers)
    assert tokens >= STREAMS * len(WORDS) * 3
    assert counter.bundles > 0
    # Accepted, first-token and final frames included: the steady state is lower still.
    assert counter.messages / tokens <= 0.3, (counter.messages, counter.bundles, tokens)
