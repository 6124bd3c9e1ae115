"""Structured outputs at the edge: the request fields that constrain a reply, turned into the
engine's one `StructuredOutput`, held to the grammar bounds (`engine.frontend.grammars.BOUNDS`) and checked to
compile before anything is published.

The fields, all optional, of chat and text completions:
- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (the schema is enforced
  whatever `strict` says);
- vLLM `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice`, `grammar` (Lark
  or GBNF), `json_object`, plus `whitespace_pattern` for JSON;
- vLLM's older spellings `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern`.
One constraint per request. A field that cannot be honoured is a 400 naming it, never ignored:
an unknown `structured_outputs` key, a second constraint, a grammar past its bounds, a schema
llguidance cannot compile (or not within `CHECK_DEADLINE_S`).

Two steps, because compiling costs: building the constraint (`structured_output`, while the bus
request is built) checks only its shape and bounds, which costs nothing, so the token endpoints,
which never need the grammar, never compile one; `check_enforceable`, awaited by each generation
route before it serves, compiles in a thread off the event loop (llguidance drops the GIL) with a
deadline.

Tool calls: a forced tool call or a tool with `strict: true` has its calls constrained to the
tool's parameter schema by the worker, which writes the call's opening into the prompt and owns
the tool-call format (`apps/worker/tool_grammar.py`); here those schemas are held to their bounds
and checked to compile (a 400 naming `tools`), whichever API the tools came through.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.gateway.api.validate import json_too_deep
from engine.frontend.grammars import (
    BOUNDS,
    CheckBusy,
    CheckTimeout,
    GrammarChecker,
    constrained_functions,
    gbnf_rules,
    utf8_len,
)
from engine.frontend.protocol import StructuredOutput, StructuredOutputKind

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# This gateway's grammar checks: two threads; its `started` count is on /metrics.
CHECKER = GrammarChecker(threads=2)


class TextFormat(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    pass


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object", kw_only=True):
    pass


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(max_length=64)] = "response"
    description: str | None = None
    # Absent: any JSON object.
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    json_schema: JsonSchemaSpec | None = None


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` object; a key we cannot honour is refused, not skipped."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    # We have one backend and never fall back, and JSON has no free whitespace unless asked.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False


class StructuredOutputFields(msgspec.Struct, kw_only=True):
    """The structured-output request fields chat and text completions share."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The request's one constraint, held to its bounds (compiling it is `check_enforceable`'s)."""
        found = _constraints(self)
        if len(found) > 1:
            names = ", ".join(f"'{param}'" for param, _ in found)
            raise _refuse(found[1][0], f"Only one structured-output constraint per request; got {names}.")
        return found[0][1] if found else None

    def constraint_param(self) -> str | None:
        """The field the request's constraint came in (for a 400 that names it)."""
        found = _constraints(self)
        return found[0][0] if found else None


def json_constraint(schema: str | dict[str, Any] | None, param: str) -> StructuredOutput:
    """A JSON constraint from one schema (any JSON object when None), held to its bounds: what
    the Responses API's `text.format` asks for."""
    return _json(JSON_OBJECT_SCHEMA if schema is None else _schema_text(schema, None, param), param)


async def check_enforceable(request: wire.GenerateRequest, param: str | None) -> None:
    """The request's constraint (which came in `param`) and the parameter schemas of the tools whose
    calls will be constrained compile, each checked in a thread with a deadline: a 400 naming the
    field when one does not (or not in time), a 503 when the checker is too busy to start."""
    checks: list[tuple[str, StructuredOutput, str]] = []
    if request.sampling.structured is not None:
        constraint = request.sampling.structured
        where = param or "response_format"
        checks.append((where, constraint, f"The {constraint.kind.value.replace('_', ' ')} in '{where}'"))
    for name, schema in _tool_schemas(request):
        checks.append(("tools", _json(schema, "tools"), f"The parameters of tool '{name}'"))
    for where, constraint, what in checks:
        try:
            error = await CHECKER.error(constraint)
        except CheckTimeout as exc:
            raise ServingError(400, ErrorCode.GRAMMAR_TOO_COMPLEX, f"{what} cannot be enforced: {exc}.",
                               param=where) from None
        except CheckBusy as exc:
            raise unavailable(Unavailable.GATEWAY_GRAMMARS_BUSY, {"detail": str(exc)}) from None
        if error is not None:
            raise _refuse(where, f"{what} cannot be enforced: {error}")


def _tool_schemas(request: wire.GenerateRequest) -> list[tuple[str, str]]:
    """(name, schema text) of each tool whose calls the worker will constrain, held to the bounds."""
    functions = constrained_functions(request.tools, request.tool_required, request.tool_name)
    schemas, total = [], 0
    for function in functions:
        parameters = function.get("parameters")
        schema = json.dumps(parameters if isinstance(parameters, dict) else {"type": "object"})
        size = utf8_len(schema)
        if size > BOUNDS.tool_schema_bytes:
            raise _refuse("tools", f"The parameters of tool '{function.get('name')}' are {size} bytes of JSON "
                                   f"schema; a tool whose calls are enforced may have at most "
                                   f"{BOUNDS.tool_schema_bytes}.")
        total += size
        schemas.append((str(function.get("name")), schema))
    if total > BOUNDS.tool_schemas_total_bytes:
        raise _refuse("tools", f"The tools whose calls are enforced have {total} bytes of parameter schemas "
                               f"together; at most {BOUNDS.tool_schemas_total_bytes} are allowed.")
    return schemas


def _refuse(param: str, message: str) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def _schema_text(schema: str | dict[str, Any], whitespace_pattern: str | None, param: str) -> str:
    """A JSON schema as text, with a whitespace pattern put where llguidance reads its options."""
    if isinstance(schema, str):
        if utf8_len(schema) > BOUNDS.schema_bytes:
            raise _too_large(param, "JSON schema", utf8_len(schema), BOUNDS.schema_bytes)
        # The decoder recurses once per level: a string of 5000 '[' must not reach it.
        if json_too_deep(schema, BOUNDS.schema_depth):
            raise _refuse(param, f"The JSON schema in '{param}' nests deeper than {BOUNDS.schema_depth} levels.")
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _refuse(param, f"'{param}' must be a JSON schema (an object, or a string of one).") from None
        if not isinstance(schema, dict):
            raise _refuse(param, f"'{param}' must be a JSON schema object.")
    if whitespace_pattern is not None:
        _check_bytes(whitespace_pattern, BOUNDS.regex_bytes, param, "whitespace pattern")
        options = dict(schema.get("x-guidance") or {})
        options.update(whitespace_flexible=True, whitespace_pattern=whitespace_pattern)
        schema = {**schema, "x-guidance": options}
    return json.dumps(schema)


def _too_large(param: str, what: str, size: int, limit: int) -> ServingError:
    return _refuse(param, f"The {what} in '{param}' is {size} bytes; at most {limit} are allowed.")


def _check_bytes(text: str, limit: int, param: str, what: str) -> str:
    size = utf8_len(text)
    if size > limit:
        raise _too_large(param, what, size, limit)
    return text


def _json(spec: str, param: str) -> StructuredOutput:
    _check_bytes(spec, BOUNDS.schema_bytes, param, "JSON schema")
    return StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=spec)


def _regex(spec: str, param: str) -> StructuredOutput:
    return StructuredOutput(kind=StructuredOutputKind.REGEX,
                            spec=_check_bytes(spec, BOUNDS.regex_bytes, param, "regex"))


def _grammar(spec: str, param: str) -> StructuredOutput:
    _check_bytes(spec, BOUNDS.grammar_bytes, param, "grammar")
    if (rules := gbnf_rules(spec)) > BOUNDS.gbnf_rules:
        raise _refuse(param, f"The grammar in '{param}' has {rules} GBNF rules; at most {BOUNDS.gbnf_rules} "
                             "are allowed.")
    return StructuredOutput(kind=StructuredOutputKind.GRAMMAR, spec=spec)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise _refuse(param, f"'{param}' must list at least one non-empty string.")
    if len(choices) > BOUNDS.choices:
        raise _refuse(param, f"'{param}' lists {len(choices)} choices; at most {BOUNDS.choices} are allowed.")
    sizes = [utf8_len(choice) for choice in choices]
    if max(sizes) > BOUNDS.choice_bytes:
        raise _refuse(param, f"Each choice in '{param}' may be at most {BOUNDS.choice_bytes} bytes long.")
    if sum(sizes) > BOUNDS.choices_total_bytes:
        raise _refuse(param, f"The choices in '{param}' are {sum(sizes)} bytes together; at most "
                             f"{BOUNDS.choices_total_bytes} are allowed.")
    return StructuredOutput(kind=StructuredOutputKind.CHOICE, spec=json.dumps(choices))


def _constraints(fields: StructuredOutputFields) -> list[tuple[str, StructuredOutput]]:
    """Every constraint the request asks for, with the field it came in."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = fields.response_format
    if isinstance(fmt, JsonObjectFormat):
        found.append(("response_format", _json(JSON_OBJECT_SCHEMA, "response_format")))
    elif isinstance(fmt, JsonSchemaFormat):
        if fmt.json_schema is None:
            raise _refuse("response_format", "'response_format' of type 'json_schema' needs 'json_schema'.")
        schema = fmt.json_schema.schema
        found.append(("response_format", _json(JSON_OBJECT_SCHEMA if schema is None
                                                else _schema_text(schema, None, "response_format"), "response_format")))
    so = fields.structured_outputs
    if so is not None:
        param = "structured_outputs"
        asked = [key for key in ("json", "regex", "choice", "grammar") if getattr(so, key) is not None]
        asked += ["json_object"] if so.json_object else []
        if len(asked) != 1:
            raise _refuse(param, f"'{param}' takes exactly one of 'json', 'regex', 'choice', 'grammar', "
                                 f"'json_object'; got {len(asked)}.")
        if so.whitespace_pattern is not None and asked[0] not in ("json", "json_object"):
            raise _refuse(param, f"'{param}.whitespace_pattern' applies to JSON only.")
        if so.json is not None:
            found.append((param, _json(_schema_text(so.json, so.whitespace_pattern, param), param)))
        elif so.json_object:
            found.append((param, _json(_schema_text(JSON_OBJECT_SCHEMA, so.whitespace_pattern, param), param)))
        elif so.regex is not None:
            found.append((param, _regex(so.regex, param)))
        elif so.choice is not None:
            found.append((param, _choice(so.choice, param)))
        elif so.grammar is not None:
            found.append((param, _grammar(so.grammar, param)))
    if fields.guided_json is not None:
        found.append(("guided_json", _json(_schema_text(fields.guided_json, fields.guided_whitespace_pattern,
                                                        "guided_json"), "guided_json")))
    elif fields.guided_whitespace_pattern is not None:
        raise _refuse("guided_whitespace_pattern", "'guided_whitespace_pattern' applies to 'guided_json' only.")
    if fields.guided_regex is not None:
        found.append(("guided_regex", _regex(fields.guided_regex, "guided_regex")))
    if fields.guided_choice is not None:
        found.append(("guided_choice", _choice(fields.guided_choice, "guided_choice")))
    if fields.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(fields.guided_grammar, "guided_grammar")))
    return found
