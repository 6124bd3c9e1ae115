"""From a `StructuredOutput` to an llguidance grammar, and whether that grammar compiles.

One translation for every side: the gateway validates a request's constraint with
`grammar_error` before publishing it, the worker validates the tool-call grammars it composes, and
the engine core compiles the very same grammar text into a matcher (`engine.structured_output`).
Validation here needs no tokenizer and no torch.

JSON schemas compile without free whitespace (", " between items, ": " after keys), the way
`json.dumps` writes: a small model given the freedom of any whitespace can spend its whole budget
on newlines. A schema may still ask for more through llguidance's own `x-guidance` options.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.protocol import StructuredOutput, StructuredOutputKind

JSON_DEFAULTS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


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
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
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
        return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(spec), defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is StructuredOutputKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(_choices(spec)))
    if kind is StructuredOutputKind.GRAMMAR:
        try:
            lark = any_to_lark(spec)  # Lark passes through; GBNF is converted
        except Exception as exc:  # the converter raises whatever its parser hit
            raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind is StructuredOutputKind.LLGUIDANCE:
        return spec
    raise ValueError(f"unknown structured output kind {kind!r}")


def grammar_error(structured: StructuredOutput) -> str | None:
    """Why the constraint cannot be compiled, or None when it can."""
    try:
        grammar = to_llguidance(structured)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid grammar") if is_error else None
