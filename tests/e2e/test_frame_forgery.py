"""A worker that did not take a request cannot take over its stream: frames with a later attempt
number, published with a worker's own credentials while the real worker has sent no text yet
(when a later attempt would win), never reach the client, who gets the real answer."""

from __future__ import annotations

import asyncio
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from apps.bus import connection, roles, topology, wire
from tests.e2e.conftest import System, scripted_worker
from tests.support import eventually_async

MODEL = "forgery-model"
REPLY = "the real answer"
# Long enough before the first token for the forged frames to arrive ahead of any real text.
SCRIPT = {"default": REPLY, "rules": [{"match": "", "reply": REPLY, "first_token_delay_s": 3.0}]}


def forged(attempt: int) -> list[wire.ReplyFrame]:
    return [wire.Accepted(seq=0, attempt=attempt, node="rogue", prompt_tokens=1),
            wire.Delta(seq=1, attempt=attempt, text="FORGED", num_tokens=1, finish_reason="stop"),
            wire.Final(seq=2, attempt=attempt, finish_reason="stop",
                       usage=wire.Usage(prompt_tokens=1, completion_tokens=1))]


async def _forge(system: System, asked: threading.Event) -> list[str]:
    """As a rogue worker: learn all of the request's reply subject a rogue can (its gateway's
    inbox; the operator's view of the bus stands in for that here), then claim attempt 2 there.
    Returns what the server refused the rogue."""
    refused: list[str] = []

    async def note(exc: Exception) -> None:
        refused.append(str(exc).lower())

    operator = await connection.connect(system.nats_server.url_for(roles.OPERATOR), "test-operator",
                                      role=roles.OPERATOR)
    rogue = await connection.connect(system.nats_server.url_for(roles.WORKER), "test-rogue", role=roles.WORKER,
                                   error_cb=note)
    try:
        requests = await operator.subscribe(topology.request_subject(MODEL))
        await connection.reached_server(operator)
        asked.set()
        request = wire.request_decoder.decode((await requests.next_msg(timeout=60)).data)
        # The gateway's inbox (`_INBOX.gateway.<user>.<id>`): predictable, see tests/gateway/test_reply_subjects.py.
        inbox = ".".join(request.reply_subject.split(".")[:4])
        assert inbox.startswith(topology.inbox_prefix(roles.GATEWAY, "gateway") + ".")
        # It cannot listen where the gateway's replies go, to learn the rest.
        await rogue.subscribe(f"{topology.inbox_root(roles.GATEWAY)}.>")
        for subject in (inbox, f"{inbox}.{secrets.token_urlsafe(16)}", f"{request.reply_subject[:-2]}xx"):
            for frame in forged(request.attempt + 1):
                await rogue.publish(subject, wire.encode(frame))
        await connection.reached_server(rogue)

        async def subscription_refused() -> bool:
            # The client hears the server's refusal in a task of its own: waited for, not assumed.
            return any("subscription to" in said for said in refused)

        await eventually_async(subscription_refused, 30, message=lambda: f"no refusal heard: {refused}")
        return refused
    finally:
        await rogue.close()
        await operator.close()


def test_a_later_attempt_from_a_worker_that_did_not_take_the_request_does_not_take_over(
        system: System, tmp_path: Path) -> None:
    with scripted_worker(system, tmp_path, MODEL, SCRIPT):
        client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        asked = threading.Event()

        def ask() -> tuple[str, str | None]:
            assert asked.wait(30)
            text, finish = "", None
            for chunk in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask)
            refused = asyncio.run(_forge(system, asked))
            text, finish = answer.result(timeout=120)
    assert (text, finish) == (REPLY, "stop")
    assert any(f'subscription to "{topology.inbox_root(roles.GATEWAY)}.>"'.lower() in said for said in refused)
