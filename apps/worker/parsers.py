"""Splitting generated text into content, reasoning and tool calls, as it streams.

`<think>…</think>` becomes reasoning (also when the chat template opened `<think>` itself, and when
generation stops before the close); Qwen-style `<tool_call>{json}</tool_call>` becomes a tool call,
or stays plain content when its JSON is malformed. Text that may be the start of a tag is held back
until it is known not to be one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from apps.bus import wire

# The longest tool name a call may carry: what a stored Responses item allows (`ItemId`), past
# every edge's own bound on tool names (OpenAI 64, Anthropic 128).
MAX_TOOL_NAME_CHARS = 256

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[wire.ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def _partial_tag_suffix(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:size]):
                longest = max(longest, size)
                break
    return longest


class OutputParser:
    """`single_tool_call`: the reply holds at most one call; once it is whole the parser is `done`
    and takes no more text (the choice ends there, as a stop string would end it)."""

    def __init__(self, parse_reasoning: bool, parse_tools: bool, in_reasoning: bool = False,
                 single_tool_call: bool = False) -> None:
        self.parse_reasoning = parse_reasoning
        self.parse_tools = parse_tools
        self.single_tool_call = single_tool_call
        self.mode = "reasoning" if in_reasoning else "content"
        self._buffer = ""
        # Whitespace between tool calls is held, and dropped if nothing but calls follow.
        self._held_space = ""
        self._strip_leading = False
        self.num_tool_calls = 0

    @property
    def done(self) -> bool:
        return self.single_tool_call and self.num_tool_calls > 0

    @property
    def in_reasoning(self) -> bool:
        return self.mode == "reasoning"

    def _open_tags(self) -> list[str]:
        tags = []
        if self.parse_reasoning:
            tags.append(THINK_OPEN)
        if self.parse_tools:
            tags.append(TOOL_OPEN)
        return tags

    def feed(self, text: str) -> Parsed:
        if self.done:
            return Parsed()
        if not (self.parse_reasoning or self.parse_tools or self._buffer or self._strip_leading
                or self.mode != "content" or self.num_tool_calls):
            return Parsed(text)  # nothing to look for: the text is content, as it came
        self._buffer += text
        out = Parsed()
        while self._buffer:
            if self.mode == "reasoning":
                if not self._take_until(THINK_CLOSE, out, "reasoning"):
                    break
                self.mode, self._strip_leading = "content", True
            elif self.mode == "tool":
                end = self._buffer.find(TOOL_CLOSE)
                if end < 0:
                    break
                self._emit_tool_call(self._buffer[:end], out)
                self._buffer = self._buffer[end + len(TOOL_CLOSE):]
                self.mode = "content"
                if self.done:
                    self._buffer = ""
                    break
            else:
                tags = [(self._buffer.find(t), t) for t in self._open_tags()]
                found = [(i, t) for i, t in tags if i >= 0]
                if not found:
                    keep = _partial_tag_suffix(self._buffer, self._open_tags())
                    self._emit_content(self._buffer[: len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                start, tag = min(found)
                self._emit_content(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(tag):]
                self.mode = "reasoning" if tag == THINK_OPEN else "tool"
        return out

    def _take_until(self, close: str, out: Parsed, target: str) -> bool:
        end = self._buffer.find(close)
        if end < 0:
            keep = _partial_tag_suffix(self._buffer, [close])
            setattr(out, target, getattr(out, target) + self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        setattr(out, target, getattr(out, target) + self._buffer[:end])
        self._buffer = self._buffer[end + len(close):]
        return True

    def _emit_content(self, text: str, out: Parsed) -> None:
        if self._strip_leading:
            text = text.lstrip("\n")
            self._strip_leading = not text
        if not text:
            return
        if self.num_tool_calls and not text.strip():
            self._held_space += text
            return
        out.content += self._held_space + text
        self._held_space = ""

    def _emit_tool_call(self, raw: str, out: Parsed, as_written: str | None = None) -> None:
        """A call from its JSON; text that is not a valid call is shown as written (`as_written`)."""
        try:
            call = json.loads(raw)
            name = call["name"]
            arguments = call.get("arguments", call.get("parameters", {}))
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise ValueError("tool call needs a string name and object arguments")
            if not name or len(name) > MAX_TOOL_NAME_CHARS:
                # No tool is named so (the edges allow at most 128 characters), and a call kept
                # under such a name could not be sent back in a later turn.
                raise ValueError("tool call name empty or too long")
            arguments_json = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, KeyError, TypeError, RecursionError):
            # Not a tool call we can hand to a client (nested past what JSON parsing takes, too):
            # show the model's text as it was.
            self._emit_content(TOOL_OPEN + raw + TOOL_CLOSE if as_written is None else as_written, out)
            return
        out.tool_calls.append(
            wire.ToolCallDelta(index=self.num_tool_calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                               arguments=arguments_json)
        )
        self.num_tool_calls += 1
        self._held_space = ""

    def finish(self) -> Parsed:
        """End of generation: flush what was held; an unclosed thought stays reasoning, and an
        unclosed tool call counts when its JSON is complete (models often stop right after it)."""
        out = Parsed()
        rest, self._buffer = self._buffer, ""
        if self.done:
            return out
        if self.mode == "reasoning":
            out.reasoning = rest
        elif self.mode == "tool":
            body = rest.rstrip()
            body = body[: len(body) - _partial_tag_suffix(body, [TOOL_CLOSE])]
            self._emit_tool_call(body, out, as_written=TOOL_OPEN + rest)
        else:
            self._emit_content(rest, out)
        return out
