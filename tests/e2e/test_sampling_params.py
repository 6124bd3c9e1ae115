"""One definition of sampling parameters: whichever API a request came through (chat, completions,
messages, responses), the message on the bus carries the engine's `SamplingParams` with the values
the client asked for, and the worker resolves it to the params its engine request gets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Self

import anthropic
import nats
import openai
import pytest
from nats.aio.msg import Msg

from apps.bus import connection, topology, wire
from apps.bus.codes import Api
from apps.worker.prompt import resolve_sampling
from engine.frontend.protocol import SamplingParams
from tests.e2e.conftest import System
from tests.support import eventually


class BusTap:
    """A core-NATS subscriber beside the workers on a model's request subject (its own loop and
    thread, so the synchronous SDK clients can be used from the test)."""

    def __init__(self, nats_url: str, model: str) -> None:
        self.seen: list[wire.GenerateRequest] = []
        self._nats_url, self._subject = nats_url, topology.request_subject(model)
        self._loop = asyncio.new_event_loop()
        self._ready, self._stop = threading.Event(), asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._listen(),), daemon=True)

    async def _listen(self) -> None:
        nc = await nats.connect(self._nats_url)

        async def keep(msg: Msg) -> None:
            decoded = wire.decode_request(msg.data)
            if isinstance(decoded, wire.GenerateRequest):
                self.seen.append(decoded)

        await nc.subscribe(self._subject, cb=keep)
        await connection.reached_server(nc)
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def published(self, api: Api) -> wire.GenerateRequest:
        """The one request of `api` published while tapped."""
        return eventually(lambda: next((r for r in self.seen if r.api == api), None), timeout_s=10,
                          message=f"no {api} request on {self._subject}")


@pytest.fixture
def tap(system: System) -> Iterator[BusTap]:
    with BusTap(system.nats_url, system.model) as tapped:
        yield tapped


ASKED = {"temperature": 0.5, "top_p": 0.9, "seed": 11, "presence_penalty": 0.25, "frequency_penalty": 0.5,
         "max_tokens": 4}


def expected(**extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.5, top_p=0.9, seed=11, presence_penalty=0.25, frequency_penalty=0.5,
                          max_tokens=4, **extra)  # type: ignore[arg-type]


def openai_client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(system: System) -> object:
    return openai_client(system).chat.completions.create(
        model=system.model, messages=[{"role": "user", "content": "Say hi."}], stop=["zz"],
        extra_body={"top_k": 20, "min_tokens": 2}, **ASKED)


def completions(system: System) -> object:
    return openai_client(system).completions.create(
        model=system.model, prompt="Say hi.", stop=["zz"], extra_body={"top_k": 20, "min_tokens": 2}, **ASKED)


def messages(system: System) -> object:
    client = anthropic.Anthropic(base_url=system.base_url, api_key="unused", max_retries=0, timeout=120)
    return client.messages.create(model=system.model, max_tokens=4, stop_sequences=["zz"],
                                  # This SDK version no longer names them; the API still takes them.
                                  extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
                                  messages=[{"role": "user", "content": "Say hi."}])


@pytest.mark.parametrize(("ask", "api"), [(chat, Api.CHAT_COMPLETIONS), (completions, Api.COMPLETIONS)],
                         ids=["chat", "completions"])
def test_openai_apis_carry_the_engines_sampling_params(system: System, tap: BusTap,
                                                       ask: Callable[[System], object], api: Api) -> None:
    ask(system)
    request = tap.published(api)
    assert request.sampling == expected(top_k=20, min_tokens=2, stop=["zz"])
    # What the worker hands its engine (one choice: choice 0's params are the request's).
    engine_params = resolve_sampling(request, num_prompt_tokens=10, max_model_len=64).for_choice(0)
    assert engine_params == request.sampling


def test_messages_carry_the_engines_sampling_params(system: System, tap: BusTap) -> None:
    messages(system)
    request = tap.published(Api.MESSAGES)
    assert request.sampling == SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=4, stop=["zz"])
    assert resolve_sampling(request, num_prompt_tokens=10, max_model_len=64) == request.sampling


def test_a_missing_max_tokens_is_resolved_by_the_worker_to_what_fits(system: System, tap: BusTap) -> None:
    openai_client(system).chat.completions.create(
        model=system.model, messages=[{"role": "user", "content": "Say hi."}], temperature=0, 
        extra_body={"max_completion_tokens": 3})
    request = tap.published(Api.CHAT_COMPLETIONS)
    assert request.sampling.max_tokens == 3 and request.sampling.greedy
