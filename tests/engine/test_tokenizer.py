"""The GGUF-built SmolLM2 tokenizer: digit splitting, special tokens, chat template, streaming."""

from __future__ import annotations

import pytest

from engine.frontend.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer
from engine.loading.loader import Checkpoint
from tests.support import byte_token_ids


@pytest.fixture(scope="module")
def tok(smollm2: Checkpoint) -> Tokenizer:
    return smollm2.tokenizer


def test_digits_after_spaces_split_like_training(tok: Tokenizer) -> None:
    assert tok.encode("  1") == [256, 33]
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]


def test_special_tokens_encode_atomically(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"


def test_no_bos_added(tok: Tokenizer) -> None:
    # tokenizer.ggml.add_bos_token is False for SmolLM2.
    with_special = tok.encode("Hello", add_special_tokens=True)
    assert with_special == tok.encode("Hello", add_special_tokens=False)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  indented\n\tcode = 42", "naïve café 你好 🙂"],
    ids=["ascii", "whitespace", "unicode"])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


def test_chat_template_system_and_user(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt.endswith("Hi!<|im_end|>\n")


def test_chat_template_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("text", ["héllo 你好世界 🙂👍🏽 wörld", "🦀", "日本語"],
                         ids=["mixed", "emoji", "cjk"])
def test_incremental_detokenizer_byte_tokens(tok: Tokenizer, text: str) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("<|im_start|>assistant\n"))
    deltas = [detok.step([token_id]) for token_id in byte_token_ids(tok, text)]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text
    assert detok.flush() == ""


def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer) -> None:
    text = "Sure! Here are 3 colors: 红, 🟢 green, and blue.\n"
    ids = tok.encode(text) + [2]  # a trailing <|im_end|> is skipped, like a final eos
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([token_id]) for token_id in ids]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_incremental_detokenizer_flushes_cut_off_character(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.step(byte_token_ids(tok, "a")) == "a"
    assert detok.step(byte_token_ids(tok, "🙂")[:2]) == ""  # half an emoji is held back
    assert detok.flush() == REPLACEMENT_CHAR


def test_invalid_bytes_are_held_back_for_four_tokens_at_most(tok: Tokenizer) -> None:
    """A model repeating a lone continuation byte (a random model's greedy answer) gets its text
    out every 4 tokens, not only at the end; valid characters of up to 4 byte tokens are never cut."""
    lone = byte_token_ids(tok, "é")[1]  # 0xA9, a continuation byte with no lead
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([lone]) for _ in range(12)]
    assert deltas == ["", "", "", REPLACEMENT_CHAR * 4] * 3
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([t]) for t in byte_token_ids(tok, "a🙂b")) == "a🙂b"
