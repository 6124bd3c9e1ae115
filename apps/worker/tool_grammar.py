"""Tool calls held to their tools' parameter schemas: the grammar a reply must match when the
request forces a tool call or has strict tools, in the Qwen-style format the output parser reads
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`).

- A forced call (`tool_required`, perhaps `tool_name`): the prompt already ends with the call's
  opening (`prompt._forced_tool_start`, built from `call_opening` here), so the reply is the rest
  of one call and its close: the named tool's arguments, or any tool's name and arguments. The
  request's own constraint (a `response_format`) shapes text content, and a forced reply has none.
- Strict tools (`"strict": true`) otherwise: the reply is free text in which every `<tool_call>`
  opens a call to one of the tools, with arguments matching its schema when it is strict (any
  JSON object when not); with a constraint of its own the reply is either that or tool calls.

No torch: the worker's asyncio side builds these before any work, holds them to the bound of a
composed grammar (`engine.frontend.grammars.BOUNDS.composed_bytes`) and checks that they compile, in a thread
with a deadline (`check_composed`), never on its event loop.
"""

from __future__ import annotations

import json
from typing import Any

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.worker.parsers import TOOL_CLOSE, TOOL_OPEN
from engine.frontend.grammars import (
    BOUNDS,
    CheckBusy,
    CheckTimeout,
    GrammarChecker,
    bounds_error,
    function_schemas,
    lark_json,
    lark_literal,
    to_llguidance,
    utf8_len,
)
from engine.frontend.protocol import SamplingParams, StructuredOutput, StructuredOutputKind

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# The name of the request's own constraint when it is composed with tool calls.
RESPONSE_GRAMMAR = "response"


def call_opening(name: str) -> str:
    """A call's JSON up to its arguments: what a forced call to `name` starts with."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _arguments(function: dict[str, Any], constrained: bool) -> str:
    schema = function.get("parameters") if constrained else None
    return lark_json(schema if isinstance(schema, dict) else ANY_OBJECT)


def _call_rules(functions: list[dict[str, Any]], strict_only: bool) -> str:
    """Rules `call` (one call's JSON, to any of the functions) and one `args_i` per function."""
    alternatives, rules = [], []
    for i, function in enumerate(functions):
        constrained = bool(function.get("strict")) or not strict_only
        alternatives.append(f"{lark_literal(call_opening(function['name']))} args_{i} \"}}\"")
        rules.append(f"args_{i}: {_arguments(function, constrained)}")
    return "call: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n"


def _forced_call(functions: list[dict[str, Any]], name: str | None) -> str:
    close = lark_literal("}\n" + TOOL_CLOSE)
    if name is not None:
        function = next((f for f in functions if f.get("name") == name), None)
        if function is None:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, f"The forced tool '{name}' is not in 'tools'.")
        return f"start: args {close}\nargs: {_arguments(function, True)}\n"
    return f"start: call {lark_literal(chr(10) + TOOL_CLOSE)}\n" + _call_rules(functions, strict_only=False)


def _strict_calls(functions: list[dict[str, Any]], composed: bool) -> str:
    block = f"{lark_literal(TOOL_OPEN + chr(10))} call {lark_literal(chr(10) + TOOL_CLOSE)}"
    if composed:
        # Either the request's own constraint, or tool calls only.
        head = f"start: @{RESPONSE_GRAMMAR} | calls\ncalls: block (\"\\n\" block)*\nblock: {block}\n"
    else:
        # Free text; the first `<tool_call>` after it (a lazy lexeme: the shortest match) opens a call.
        head = ("%llguidance {}\nstart: called* tail\ntail: TEXT\nTEXT: /(.|\\n)*/\n"
                f"opened[lazy]: TEXT {lark_literal(TOOL_OPEN)}\n"
                f"called: opened {lark_literal(chr(10))} call {lark_literal(chr(10) + TOOL_CLOSE)}\n")
    return head + _call_rules(functions, strict_only=True)


def _grammar(top_lark: str, own: StructuredOutput | None) -> str:
    grammars: list[dict[str, Any]] = [{"name": "tool_reply", "lark_grammar": top_lark}]
    if own is not None:
        sub = json.loads(to_llguidance(own))["grammars"]
        sub[0]["name"] = RESPONSE_GRAMMAR
        grammars += sub
    return json.dumps({"grammars": grammars})


def reply_constraint(request: wire.GenerateRequest) -> StructuredOutput | None:
    """What the reply must match: the request's own constraint, unless its tools say more."""
    own = request.sampling.structured
    if own is not None and own.kind is StructuredOutputKind.LLGUIDANCE:
        # Composed here only: from outside it would skip every per-kind bound of what it holds.
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           "A structured output of kind 'llguidance' is not accepted; send a JSON schema, "
                           "regex, grammar or choice.")
    if own is not None and (past_bounds := bounds_error(own)) is not None:
        # A gateway refuses these; a client on the bus gets the same answer here.
        raise ServingError(400, ErrorCode.INVALID_REQUEST, f"The structured output cannot be enforced: {past_bounds}.")
    functions = function_schemas(request.tools)
    if request.tool_required and functions:
        constraint = _grammar(_forced_call(functions, request.tool_name), None)
    elif any(f.get("strict") for f in functions):
        constraint = _grammar(_strict_calls(functions, own is not None), own)
    else:
        return own
    if utf8_len(constraint) > BOUNDS.composed_bytes:
        raise ServingError(400, ErrorCode.INVALID_REQUEST,
                           f"The grammar of the tool calls is {utf8_len(constraint)} bytes; at most "
                           f"{BOUNDS.composed_bytes} are allowed: enforce fewer or smaller tool schemas.",
                           param="tools")
    return StructuredOutput(kind=StructuredOutputKind.LLGUIDANCE, spec=constraint)


async def check_composed(request: wire.GenerateRequest, sampling: SamplingParams, checker: GrammarChecker) -> None:
    """A grammar composed here from the request's tools (`reply_constraint`) compiles, or the request
    is refused naming `tools`; the request's own constraint was checked where it came in."""
    structured = sampling.structured
    if structured is None or structured == request.sampling.structured:
        return
    try:
        error = await checker.error(structured)
    except CheckTimeout as exc:
        raise ServingError(400, ErrorCode.GRAMMAR_TOO_COMPLEX, f"The tools' parameters cannot be enforced: {exc}.",
                           param="tools") from None
    except CheckBusy as exc:
        raise unavailable(Unavailable.WORKER_GRAMMARS_BUSY, error=exc) from None
    if error is not None:
        raise ServingError(400, ErrorCode.INVALID_REQUEST, f"The tools' parameters cannot be enforced: {error}",
                           param="tools")
