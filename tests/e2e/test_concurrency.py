"""Many clients at once through the gateway: continuous batching is invisible in the answers."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from engine.frontend.model_source import load_tokenizer
from engine.loading.default_model import default_model_path
from tests.e2e.conftest import System

CLIENTS = 16
MAX_TOKENS = 16
SUBJECTS = [
    "cats", "the moon", "tea", "rivers", "chess", "volcanoes", "bees", "trains",
    "snow", "maps", "violins", "deserts", "clocks", "whales", "gardens", "lighthouses",
]


async def stream_one(client: AsyncOpenAI, model: str, subject: str) -> tuple[str, str, object]:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me one fact about {subject}."}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage = [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_sixteen_concurrent_streams_complete_with_correct_usage(system: System) -> None:
    tokenizer, _ = load_tokenizer(default_model_path())

    async def scenario() -> tuple[list, list]:
        client = AsyncOpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        together = await asyncio.gather(*(stream_one(client, system.model, s) for s in SUBJECTS))
        alone = [await stream_one(client, system.model, s) for s in SUBJECTS[:4]]
        return together, alone

    together, alone = asyncio.run(scenario())
    assert len(together) == CLIENTS
    for subject, (text, finish, usage) in zip(SUBJECTS, together, strict=True):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me one fact about {subject}."}])
        assert finish == "length"
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert text
    # The first four again, one at a time: the batch did not change a single token.
    assert [t[0] for t in together[:4]] == [a[0] for a in alone]


def test_stop_strings_end_generation_and_are_never_emitted(system: System) -> None:
    async def scenario() -> tuple:
        client = AsyncOpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        full = await client.chat.completions.create(model=system.model, messages=question, temperature=0)
        cut = await client.chat.completions.create(
            model=system.model, messages=question, temperature=0, stop=["France is"]
        )
        stream = await client.chat.completions.create(
            model=system.model, messages=question, temperature=0, stop=["France is"], stream=True
        )
        pieces, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return full, cut, "".join(pieces), finish

    full, cut, streamed, finish = asyncio.run(scenario())
    answer = full.choices[0].message.content
    assert "France is" in answer
    expected = answer[: answer.index("France is")]
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    assert streamed == expected and finish == "stop"
