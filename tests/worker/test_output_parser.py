"""Reasoning and tool-call parsing over streamed text, split at every possible point."""

from __future__ import annotations

import json

import pytest

from apps.worker.parsers import OutputParser, Parsed


def run(text: str, chunk: int, **kw: bool) -> Parsed:
    parser = OutputParser(**{"parse_reasoning": True, "parse_tools": True, **kw})
    total = Parsed()
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for part in [parser.feed(p) for p in pieces] + [parser.finish()]:
        total.content += part.content
        total.reasoning += part.reasoning
        total.tool_calls += part.tool_calls
    return total


CHUNKS = [1, 2, 3, 7, 1000]


# (case, streamed text, whether the template opened a think block, reasoning, content)
REASONING_CASES = [
    ("think_block_is_reasoning", "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", False,
     "\nLet me add 2 and 2.\n", "The answer is 4."),
    ("template_that_preopens_think", "Hmm, 2 plus 2 is 4.</think>\n\n4", True, "Hmm, 2 plus 2 is 4.", "4"),
    ("generation_cut_off_mid_thought_stays_reasoning", "<think>I should consider the </th", False,
     "I should consider the </th", ""),
]


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), [case[1:] for case in REASONING_CASES],
                         ids=[case[0] for case in REASONING_CASES])
def test_reasoning_and_content(text: str, in_reasoning: bool, reasoning: str, content: str, chunk: int) -> None:
    out = run(text, chunk, in_reasoning=in_reasoning)
    assert out.reasoning == reasoning
    assert out.content == content


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
def test_tool_calls_are_parsed_and_whitespace_between_dropped(chunk: int) -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    out = run(text, chunk)
    assert [(c.index, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"tz": "CET"})
    ]
    assert out.content == ""
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
def test_a_single_call_reply_takes_nothing_after_its_first_call(chunk: int) -> None:
    parser = OutputParser(parse_reasoning=True, parse_tools=True, single_tool_call=True)
    text = ('Let me look. <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> and more')
    parts = []
    for i in range(0, len(text), chunk):
        parts.append(parser.feed(text[i:i + chunk]))
        if parser.done:
            break
    parts.append(parser.finish())
    assert [c.name for p in parts for c in p.tool_calls] == ["a"]
    assert "".join(p.content for p in parts) == "Let me look. "
    assert parser.done and not parser.feed("<tool_call>")


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
def test_malformed_tool_json_falls_back_to_content(chunk: int) -> None:
    text = "Sure. <tool_call>{not json}</tool_call> done"
    out = run(text, chunk)
    assert out.tool_calls == []
    assert out.content == text


@pytest.mark.parametrize("depth", [1500, 100_000])
def test_tool_json_nested_past_what_json_parsing_takes_falls_back_to_content(depth: int) -> None:
    deep = "[" * depth + "]" * depth
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": {deep}}}}}</tool_call>'
    out = run(text, 4096)
    assert out.tool_calls == []
    assert out.content == text


@pytest.mark.parametrize("name", ["", "f" * 257], ids=["empty", "too-long"])
def test_a_call_under_a_name_no_tool_can_have_is_content(name: str) -> None:
    text = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'
    out = run(text, 4096)
    assert out.tool_calls == []
    assert out.content == text


def test_text_that_only_looks_like_a_tag_is_content() -> None:
    assert run("a < b and <thinking> is not a tag", 1).content == "a < b and <thinking> is not a tag"


def test_parsing_off_leaves_tags_in_content() -> None:
    text = "<think>x</think><tool_call>{}</tool_call>"
    assert run(text, 3, parse_reasoning=False, parse_tools=False).content == text


def test_a_template_that_opens_think_starts_generation_in_reasoning() -> None:
    from apps.bus import wire
    from apps.worker.prompt import build_prompt
    from engine.frontend.model_source import load_tokenizer
    from engine.frontend.protocol import SamplingParams
    from engine.frontend.tokenizer import Tokenizer
    from engine.loading.default_model import default_model_path

    base, _ = load_tokenizer(default_model_path())
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    tokenizer = Tokenizer(base.hf, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                          chat_template=template)
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams(),
                                   messages=[wire.ChatMessage(role="user", content="2+2?")])
    prompt = build_prompt(tokenizer, request)
    assert prompt.parse_reasoning and prompt.opens_reasoning
    parser = prompt.output_parser()
    first = parser.feed("Four, clearly.</think>\n\n4")
    assert (first.reasoning, first.content) == ("Four, clearly.", "4")
    assert not build_prompt(tokenizer, request, reasoning_parser="off").opens_reasoning


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
@pytest.mark.parametrize("ending", ["", "\n", "\n</tool_", "\n</tool_call"],
                         ids=["eos", "newline", "half-close", "no-bracket"])
def test_a_tool_call_cut_before_its_close_tag_still_counts_when_its_json_is_whole(chunk: int, ending: str) -> None:
    out = run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' + ending, chunk)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert out.content == ""


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}")
def test_an_unclosed_tool_call_with_broken_json_is_shown_as_written(chunk: int) -> None:
    text = '<tool_call>\n{"name": "get_weather", "argu'
    out = run(text, chunk)
    assert out.tool_calls == []
    assert out.content == text
