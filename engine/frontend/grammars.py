"""From a `StructuredOutput` to an llguidance grammar, whether that grammar compiles, and the bounds
every grammar a client sends is held to.

One translation for every side: the gateway checks a request's constraint (`GrammarChecker`)
before publishing it, the worker checks the tool-call grammars it composes, and the engine core
compiles the very same grammar text into a matcher (`engine.core.structured_output`). Checking here
needs no tokenizer and no torch.

Compiling costs time that grows faster than the grammar (an alternation of choices is quadratic,
GBNF's conversion to Lark too), so every kind has a byte bound (`GrammarBounds`: the one place they
are), checked before anything compiles, and every compile runs off the event loop with a deadline:
llguidance drops the GIL while it compiles, so a thread keeps the loop answering. Its error texts
are short: llguidance's verbose errors carry the whole grammar and the parser's state, so they are
turned off, and what is left is cut to `MAX_ERROR_BYTES`.

JSON schemas compile without free whitespace (", " between items, ": " after keys), the way
`json.dumps` writes: a small model given the freedom of any whitespace can spend its whole budget
on newlines. A schema may still ask for more through llguidance's own `x-guidance` options.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.frontend.protocol import MAX_GRAMMAR_CHARS, StructuredOutput, StructuredOutputKind

JSON_DEFAULTS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Longest error text (UTF-8 bytes) a grammar failure may carry into a reply, an event or a log line.
MAX_ERROR_BYTES = 512
# The stack of a thread that compiles grammars. llguidance recurses through a grammar's rules: a
# chain of 1,000 `$ref`s (75 KB of JSON schema) overflowed a default 8 MiB thread stack and took
# the whole process down (SIGSEGV). At 256 MiB the largest spec any bound allows (512 KB) compiles
# with room to spare (12,000 links, 925 KB, measured); the memory is reserved, touched only as used.
GRAMMAR_STACK_BYTES = 256 << 20
_stack_lock = threading.Lock()


class GrammarThreads(ThreadPoolExecutor):
    """A thread pool whose threads have `GRAMMAR_STACK_BYTES` of stack: where grammars compile."""

    def _adjust_thread_count(self) -> None:
        # Threads start here; the stack size is the interpreter's setting when each is made.
        with _stack_lock:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                super()._adjust_thread_count()
            finally:
                threading.stack_size(previous)


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """What a client's grammar may weigh, in UTF-8 bytes and counts. Picked so that the largest
    allowed grammar of each kind compiles in well under a second on one core (measured with
    llguidance 1.9 and a 49k-token vocabulary), and so that real use fits with room to spare:
    OpenAI caps an enum at 1000 values; the JSON and SQL grammars people send are a few KiB."""

    # guided_choice / structured_outputs.choice: llguidance allows 2000 alternatives in a row.
    choices: int = 1024
    choice_bytes: int = 1024
    choices_total_bytes: int = 64 << 10
    # A JSON schema (response_format, guided_json, text.format, ...), as the JSON text compiled.
    schema_bytes: int = 128 << 10
    # Nesting of a schema given as a string (one given as an object is bounded with the body).
    schema_depth: int = 64
    # A regex, and a JSON whitespace pattern.
    regex_bytes: int = 16 << 10
    # A Lark or GBNF grammar. GBNF's conversion to Lark is pure Python (it holds the GIL) and costs
    # about 35 ns x rules x bytes: 1,300 rules in 32 KiB took 1.4 s; at most 128 rules, ~0.15 s.
    grammar_bytes: int = 32 << 10
    gbnf_rules: int = 128
    # Tools whose calls are held to their parameter schemas (strict, or a forced call).
    tool_schema_bytes: int = 64 << 10
    tool_schemas_total_bytes: int = 256 << 10
    # The grammar a worker composes from a request's tools and its own constraint.
    composed_bytes: int = 512 << 10

    def __post_init__(self) -> None:
        if self.composed_bytes > MAX_GRAMMAR_CHARS:
            raise ValueError("a composed grammar must fit what the bus and the core pipe carry")


BOUNDS = GrammarBounds()
# A compile that takes longer fails its request alone: at the gateway a 400, in the core an error.
CHECK_DEADLINE_S = 5.0
COMPILE_BUDGET_S = 10.0


# Earley items one token's mask may build (llguidance's `step_max_items`, 50,000 by default). A
# grammar can compile in a millisecond and still cost more per token the longer the answer gets:
# the ambiguous `s: s s | "a"` took 0.9 ms a mask at 100 tokens and 100 ms at 600 on this project's
# CPU, in the engine's step, for every row that carries it. At 2,000 such a row fails alone (at about
# 250 tokens, its masks under 8 ms); JSON schemas of 120 properties, 60-deep recursive schemas and an
# ambiguous SQL condition grammar over 1,800 tokens stay under it (at most 1.5 ms a mask).
STEP_MAX_ITEMS = 2000


def run_time_error(error: str) -> str:
    """A grammar's failure while generating, as a request's error: short, and for the per-token
    bound with what usually causes it and the way around it."""
    if "Too many items" in error:
        return (f"the grammar needs more parser work per token than allowed ({STEP_MAX_ITEMS} items); a rule "
                f"repeated by right recursion over single characters (x ::= c x | c) does: write it with + or * "
                f"or left recursion ({short_error(error, 160)})")
    return short_error(error)


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's own limits: short errors (verbose ones embed the grammar and parser state), and
    a mask's work bounded per token (`STEP_MAX_ITEMS`)."""
    return llguidance.LLParserLimits(verbose_errors=False, step_max_items=STEP_MAX_ITEMS)


def short_error(text: str, limit: int = MAX_ERROR_BYTES) -> str:
    """An error text on one line, cut to `limit` bytes of UTF-8."""
    text = " ".join(text.split())
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode(errors="ignore") + "..."


def grammar_key(structured: StructuredOutput) -> str:
    """The content hash compiled grammars are cached under."""
    return hashlib.sha256(f"{structured.kind.value}\0{structured.spec}".encode()).hexdigest()


def utf8_len(text: str) -> int:
    # Cheap for ASCII, which is what grammars mostly are: a char is a byte.
    return len(text) if text.isascii() else len(text.encode())


def bounds_error(structured: StructuredOutput) -> str | None:
    """Why a constraint is past the grammar bounds, or None. The gateway holds each request field to
    its bound with a message naming it; this is the same rule for a constraint from anywhere else
    (a bus client's, a worker's composition), checked again before anything compiles it."""
    kind, size = structured.kind, utf8_len(structured.spec)
    limit = {
        StructuredOutputKind.JSON_SCHEMA: BOUNDS.schema_bytes,
        StructuredOutputKind.REGEX: BOUNDS.regex_bytes,
        StructuredOutputKind.GRAMMAR: BOUNDS.grammar_bytes,
        StructuredOutputKind.LLGUIDANCE: BOUNDS.composed_bytes,
        # The choices as a JSON list: quotes and separators besides their own bytes.
        StructuredOutputKind.CHOICE: BOUNDS.choices_total_bytes + 4 * BOUNDS.choices + 2,
    }[kind]
    if size > limit:
        return f"the {kind.value.replace('_', ' ')} is {size} bytes; at most {limit} are allowed"
    if kind is StructuredOutputKind.GRAMMAR and (rules := gbnf_rules(structured.spec)) > BOUNDS.gbnf_rules:
        return f"the grammar has {rules} GBNF rules; at most {BOUNDS.gbnf_rules} are allowed"
    if kind is StructuredOutputKind.CHOICE:
        try:
            choices = json.loads(structured.spec)
        except ValueError:
            return None  # not a list at all: compiling it says so
        if isinstance(choices, list) and len(choices) > BOUNDS.choices:
            return f"{len(choices)} choices; at most {BOUNDS.choices} are allowed"
        if isinstance(choices, list) and any(isinstance(c, str) and utf8_len(c) > BOUNDS.choice_bytes
                                             for c in choices):
            return f"a choice is longer than {BOUNDS.choice_bytes} bytes"
    return None


def gbnf_rules(grammar: str) -> int:
    """How many GBNF rules (`name ::= ...`) a grammar has, at most (a `::=` inside a literal counts
    too); a Lark grammar has none."""
    return grammar.count("::=")


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (llguidance reads JSON string escapes in literals)."""
    return json.dumps(text, ensure_ascii=False)


def lark_json(schema: dict[str, object]) -> str:
    """A JSON schema inlined into a Lark rule (`%json {...}`), with the same whitespace defaults
    as a schema given alone (its own `x-guidance` options still win)."""
    options = schema.get("x-guidance")
    merged = {**JSON_DEFAULTS, **(options if isinstance(options, dict) else {})}
    return "%json " + json.dumps({**schema, "x-guidance": merged})


def choice_lark(choices: list[str]) -> str:
    """A grammar whose whole output is exactly one of `choices`."""
    return "start: " + " | ".join(lark_literal(choice) for choice in choices)


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except ValueError:
        raise ValueError("a choice constraint must be a JSON list of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("a choice constraint must be a non-empty list of non-empty strings")
    return choices


def _json_schema(spec: str) -> dict[str, object]:
    try:
        schema = json.loads(spec)
    except RecursionError:
        raise ValueError("the JSON schema nests too deeply") from None
    except ValueError as exc:
        raise ValueError(short_error(f"the JSON schema is not valid JSON: {exc}")) from None
    if schema is True:
        return {}  # the schema every JSON value matches
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object (or true)")
    return schema


def to_llguidance(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) for a constraint; ValueError when the spec is
    malformed before it even reaches the grammar compiler (a schema that is not JSON, say)."""
    kind, spec = structured.kind, structured.spec
    if kind is StructuredOutputKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(spec), defaults=JSON_DEFAULTS)  # type: ignore[arg-type]  # the TypedDict's keys
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is StructuredOutputKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(_choices(spec)))
    if kind is StructuredOutputKind.GRAMMAR:
        try:
            lark = any_to_lark(spec)  # Lark passes through; GBNF is converted
        except Exception as exc:  # the converter raises whatever its parser hit (RecursionError too)
            raise ValueError(short_error(f"the grammar is neither Lark nor GBNF: {exc}")) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind is StructuredOutputKind.LLGUIDANCE:
        return spec
    raise ValueError(f"unknown structured output kind {kind!r}")


def grammar_error(structured: StructuredOutput) -> str | None:
    """Why the constraint cannot be compiled, or None when it can (blocking: see `GrammarChecker`)."""
    try:
        grammar = to_llguidance(structured)
    except ValueError as exc:
        return short_error(str(exc))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    return short_error(messages[0] if messages else "invalid grammar") if is_error else None


class CheckBusy(Exception):
    """No thread was free to check the grammar before the deadline (the checker is overloaded)."""


class CheckTimeout(Exception):
    """The grammar's check ran past the deadline: too costly to compile."""


class GrammarChecker:
    """`grammar_error` in a few threads off the event loop, with a deadline.

    A check that runs past `deadline_s` raises CheckTimeout; one still queued then (every thread
    busy) is dropped and raises CheckBusy. A thread cannot be stopped, so a check past its
    deadline runs on to its end; the bounds keep that end near. `started` counts the checks that
    began compiling (Prometheus reads it)."""

    def __init__(self, threads: int = 2, deadline_s: float = CHECK_DEADLINE_S,
                 check: Callable[[StructuredOutput], str | None] = grammar_error) -> None:
        self._pool = GrammarThreads(max_workers=threads, thread_name_prefix="helexa-grammar")
        self.deadline_s = deadline_s
        self._check = check
        self._lock = threading.Lock()
        self.started = 0

    def _run(self, structured: StructuredOutput, began: list[float]) -> str | None:
        with self._lock:
            self.started += 1
        began.append(time.monotonic())
        return self._check(structured)

    async def error(self, structured: StructuredOutput) -> str | None:
        """Why `structured` cannot be compiled, or None when it can."""
        began: list[float] = []
        future: Future[str | None] = self._pool.submit(self._run, structured, began)
        waiting = asyncio.wrap_future(future)
        # A check given up on may still fail later: its exception is read, never left unretrieved.
        waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), self.deadline_s)
        except TimeoutError:
            pass
        if future.cancel():
            raise CheckBusy(f"no grammar check could start within {self.deadline_s:g} s") from None
        # It started late (every thread was busy): it gets its own deadline from its start.
        left = (began[0] if began else time.monotonic()) + self.deadline_s - time.monotonic()
        if left > 0:
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), left)
            except TimeoutError:
                pass
        raise CheckTimeout(f"the grammar did not compile within {self.deadline_s:g} s")


def function_schemas(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The function definitions among a request's tools (OpenAI's `{"type": "function", ...}`)."""
    return [tool["function"] for tool in tools or [] if tool.get("type") == "function"]


def constrained_functions(tools: list[dict[str, Any]] | None, tool_required: bool,
                          tool_name: str | None) -> list[dict[str, Any]]:
    """The functions whose call arguments a reply is held to: every one under a forced call (or the
    named one), else the strict ones."""
    functions = function_schemas(tools)
    if tool_required:
        return [f for f in functions if tool_name in (None, f.get("name"))]
    return [f for f in functions if f.get("strict")]
