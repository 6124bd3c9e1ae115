"""One real request end to end: the openai client → gateway → NATS → worker → PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
import torch
from openai import NotFoundError, OpenAI

from tests.e2e.conftest import System
from tests.support import eventually_async

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference() -> dict:
    """What HF transformers generates greedily for the same GGUF, prompt and template."""
    from transformers import AutoModelForCausalLM

    from engine.loading.default_model import default_model_path
    from engine.loading.gguf_file import GGUFFile, read_tokenizer

    path = default_model_path()
    tokenizer = read_tokenizer(GGUFFile(path))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    generated = out[0, len(prompt_ids):].tolist()
    text_ids = [t for t in generated if t != tokenizer.eos_token_id]
    finish = "stop" if generated[-1] == tokenizer.eos_token_id else "length"
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(generated),
        "text": tokenizer.decode(text_ids),
        "finish_reason": finish,
    }


def client(system: System) -> OpenAI:
    return OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def finished_run(system: System, request_id: str, timeout_s: float = 30.0) -> asyncpg.Record:
    """The run's ledger row once the recorder has projected its run.finished event."""
    conn = await asyncpg.connect(system.database_url)

    async def finished() -> asyncpg.Record | None:
        row = await conn.fetchrow("SELECT * FROM runs WHERE request_id = $1", request_id)
        return row if row is not None and row["finished_at"] is not None else None

    try:
        return await eventually_async(
            finished, timeout_s,
            message=lambda: f"no finished run row for {request_id}; recorder said:\n{system.recorder.output()}")
    finally:
        await conn.close()


def test_models_lists_the_served_model_with_its_limits(system: System) -> None:
    models = client(system).models.list()
    entry = next(m for m in models.data if m.id == system.model)
    assert system.model == "SmolLM2-135M-Instruct"
    # SmolLM2's 8192 positions bind (the KV pool holds more); a quarter is kept for the output.
    assert entry.limit == {"context": 8192, "input": 6144, "output": 2048}
    assert (entry.max_model_len, entry.max_input_tokens, entry.max_output_tokens) == (8192, 6144, 2048)
    assert client(system).models.retrieve(system.model).model_dump() == entry.model_dump()
    with pytest.raises(NotFoundError) as missing:
        client(system).models.retrieve("org/not-served")
    assert missing.value.body["code"] == "model_not_found" and "org/not-served" in missing.value.body["message"]


def test_non_streaming_equals_transformers_and_is_recorded(system: System, reference: dict) -> None:
    response = client(system).chat.completions.create(
        model=system.model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS
    )
    answer = response.choices[0].message.content
    assert answer == reference["text"]
    assert "Paris" in answer
    assert response.usage.prompt_tokens == reference["prompt_tokens"]
    assert response.usage.completion_tokens == reference["completion_tokens"]
    assert response.usage.total_tokens == reference["prompt_tokens"] + reference["completion_tokens"]
    assert response.choices[0].finish_reason == reference["finish_reason"]

    row = asyncio.run(finished_run(system, response.id))
    assert row["model"] == system.model
    assert row["node"] == "e2e-worker"
    assert row["status"] == "ok"
    assert row["prompt_tokens"] == response.usage.prompt_tokens
    assert row["completion_tokens"] == response.usage.completion_tokens
    assert row["finish_reason"] == response.choices[0].finish_reason
    assert row["started_at"] is not None


def test_streaming_equals_transformers_with_usage(system: System, reference: dict) -> None:
    stream = client(system).chat.completions.create(
        model=system.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, ids = [], None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == reference["text"]
    assert len(pieces) > 1, "the answer should arrive in several deltas"
    assert finish == reference["finish_reason"]
    assert usage is not None
    assert usage.prompt_tokens == reference["prompt_tokens"]
    assert usage.completion_tokens == reference["completion_tokens"]
    assert len(ids) == 1

    row = asyncio.run(finished_run(system, ids.pop()))
    assert row["completion_tokens"] == reference["completion_tokens"]


def test_n_choices_streamed_and_not(system: System) -> None:
    kwargs = dict(model=system.model, messages=QUESTION, temperature=1.0, seed=11, max_tokens=12, n=3,
                  extra_body={"ignore_eos": True})
    response = client(system).chat.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert len({c.message.content for c in response.choices}) > 1, "seeds per choice differ"
    assert response.usage.completion_tokens == 3 * 12

    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client(system).chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    # (Not compared with the first answer: the prompt now comes from the prefix cache, and
    # sampling at temperature 1 may turn a last-bit difference in the logits into another token.)
    assert all(texts[i] for i in range(3)) and len(set(texts.values())) > 1


def test_completions_with_text_and_token_prompts(system: System) -> None:
    from engine.frontend.model_source import load_tokenizer
    from engine.loading.default_model import default_model_path

    tokenizer, _ = load_tokenizer(default_model_path())
    prompt = "The capital of France is"
    api = client(system)
    by_text = api.completions.create(model=system.model, prompt=prompt, max_tokens=6, temperature=0)
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    by_ids = api.completions.create(model=system.model, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text.strip()
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6
    assert by_text.choices[0].finish_reason == "length"
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(top) == 2 for top in lp.top_logprobs)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=system.model, prompt=prompt, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text


def test_completions_rejects_out_of_vocab_token_ids(system: System) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client(system).completions.create(model=system.model, prompt=[1, 10**9], max_tokens=2)
    assert caught.value.body["code"] == "invalid_prompt"


def test_seed_reproducibility(system: System) -> None:
    kwargs = dict(model=system.model, max_tokens=16, temperature=0.8, top_p=0.9,
                  messages=[{"role": "user", "content": "Invent a name for a small boat."}])
    first = client(system).chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    again = client(system).chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    others = {client(system).chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (1, 2, 3)}
    assert first == again
    assert others - {first}, "other seeds give other text"


def test_logit_bias_steers_and_bans_tokens_through_the_sdk(system: System) -> None:
    """OpenAI's logit_bias on the real model: +100 on one token makes every greedy token that one;
    -100 on the token greedy decoding picks first keeps it out of the answer."""
    from engine.frontend.model_source import load_tokenizer
    from engine.loading.default_model import default_model_path

    tokenizer, _ = load_tokenizer(default_model_path())
    api = client(system)
    (forced,) = tokenizer.encode(" banana", add_special_tokens=False)
    steered = api.completions.create(model=system.model, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, logit_bias={str(forced): 100}, logprobs=0)
    assert steered.choices[0].logprobs.tokens == [" banana"] * 4
    plain = api.chat.completions.create(model=system.model, messages=QUESTION, max_tokens=1, temperature=0,
                                        logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    (first_id,) = tokenizer.encode(first, add_special_tokens=False)
    banned = api.chat.completions.create(model=system.model, messages=QUESTION, max_tokens=1, temperature=0,
                                         logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
