"""The end of a streamed choice: whatever the detokenizer still holds back reaches the client.

A run's text must not depend on how the engine's outputs were grouped (a slow reader gets them
coalesced): every grouping of the same token ids streams exactly the full decode, including a
character cut off by the end of generation, and a stop string that ends inside the held-back tail
still stops the choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from apps.bus import wire
from apps.worker import choices
from apps.worker.prompt import Prompt
from apps.worker.replies import CollectingReplier
from apps.worker.run_record import RunRecord
from engine.frontend.protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams
from engine.frontend.tokenizer import Tokenizer
from tests.support import LoopTurns, byte_token_ids


class GroupedEngine:
    """Hands out fixed token ids in the given groups, the last group finishing the request."""

    def __init__(self, groups: list[list[int]], reason: FinishReason) -> None:
        self.groups, self.reason = groups, reason

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        for i, ids in enumerate(self.groups):
            last = i == len(self.groups) - 1
            yield EngineOutput(request.request_id, list(ids), finished=last,
                               finish_reason=self.reason if last else None,
                               num_prompt_tokens=len(request.prompt_token_ids),
                               prefill_ms=0.0 if i == 0 else None)


def _groupings(ids: list[int]) -> list[list[list[int]]]:
    """One token per output, everything in one output, and every split into two outputs."""
    splits = [[ids[:cut], ids[cut:]] for cut in range(1, len(ids))]
    return [[[t] for t in ids], [ids], *splits]


def _run(tok: Tokenizer, groups: list[list[int]], stop: list[str], reason: FinishReason,
         parse_reasoning: bool = False) -> tuple[CollectingReplier, RunRecord, str]:
    prompt_ids = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="-",
                                   sampling=SamplingParams(max_tokens=64, stop=stop))
    record = RunRecord(request=request, node="n", attempt=1, received_at=time.time())
    replier = CollectingReplier(attempt=1, node="n")
    reasons, error = asyncio.run(choices.generate(
        GroupedEngine(groups, reason), tok, replier, record,
        Prompt(token_ids=prompt_ids, parse_reasoning=parse_reasoning), SamplingParams(max_tokens=64)))
    assert error is None
    return replier, record, reasons[0]


def _stream(tok: Tokenizer, groups: list[list[int]], stop: list[str], reason: FinishReason) -> tuple[str, str]:
    replier, _, finish = _run(tok, groups, stop, reason)
    return "".join(f.text for f in replier.frames if isinstance(f, wire.Delta)), finish


@pytest.mark.parametrize("text", ["ok 🙂", "日本", "héllo 👍🏽"], ids=["emoji", "cjk", "modifier"])
def test_every_grouping_streams_the_full_decode(tok: Tokenizer, text: str) -> None:
    ids = byte_token_ids(tok, text)
    for groups in _groupings(ids):
        assert _stream(tok, groups, [], FinishReason.LENGTH) == (text, "length"), groups


def test_a_character_cut_off_by_the_end_is_not_dropped(tok: Tokenizer) -> None:
    # Generation stopped (max_tokens) after half an emoji: the text is what a whole decode says.
    ids = byte_token_ids(tok, "ab🙂")[:4]
    expected = tok.decode(ids)
    assert expected.startswith("ab") and expected.endswith("\ufffd")
    for groups in _groupings(ids):
        assert _stream(tok, groups, [], FinishReason.LENGTH) == (expected, "length"), groups


def test_stop_strings_hold_for_every_grouping(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, "say 日本 then")
    for groups in _groupings(ids):
        assert _stream(tok, groups, ["本"], FinishReason.LENGTH) == ("say 日", "stop"), groups


def test_reasoning_tokens_count_the_same_for_every_grouping(tok: Tokenizer) -> None:
    """A window's outputs come merged: the tokens up to the reasoning's close still count as
    reasoning one by one, as a migrated answer's tokens are counted again (`ChoiceText.prime`)."""
    ids = byte_token_ids(tok, "<think>hm</think>ok")
    one_by_one = [[t] for t in ids]
    replier, record, _ = _run(tok, one_by_one, [], FinishReason.LENGTH, parse_reasoning=True)
    # From the token after the opening tag to the one that closes the reasoning.
    assert record.reasoning_tokens == len(byte_token_ids(tok, "hm</think>"))
    for groups in _groupings(ids):
        grouped, grouped_record, _ = _run(tok, groups, [], FinishReason.LENGTH, parse_reasoning=True)
        assert grouped_record.reasoning_tokens == record.reasoning_tokens, groups
        deltas = [f for f in grouped.frames if isinstance(f, wire.Delta)]
        assert ("".join(d.reasoning for d in deltas), "".join(d.text for d in deltas)) == ("hm", "ok"), groups


def test_a_long_resume_is_fed_a_chunk_at_a_time_with_the_loop_let_go_between(tok: Tokenizer) -> None:
    """A migrated choice's resumed tokens are fed to its text as a generation would (~16 µs a
    token): a resume near a long context would hold the event loop for seconds in one go. Past
    `PRIME_CHUNK_TOKENS` the loop runs between chunks."""
    text = "word " * 1500
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2 * choices.PRIME_CHUNK_TOKENS
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="s", prompt="hi",
                                   sampling=SamplingParams(max_tokens=len(ids) + 1))
    record = RunRecord(request, "node", 2, time.time())

    async def prime() -> int:
        async with LoopTurns() as turns:
            before = turns.count
            choice, ended = await choices.prime_choice(tok, Prompt(ids[:1]), record,
                                                       wire.ResumedChoice(token_ids=ids))
            ran = turns.count - before
        assert ended is None and choice is not None
        return ran

    ran = asyncio.run(prime())
    assert ran >= len(ids) // choices.PRIME_CHUNK_TOKENS
    assert record.completion_tokens == len(ids)
