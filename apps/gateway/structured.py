"""Structured outputs at the edge: the request fields that constrain a reply, turned into the
engine's one `StructuredOutput` and checked to compile before anything is published.

The fields, all optional, of chat and text completions:
- OpenAI `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (the schema is enforced
  whatever `strict` says);
- vLLM `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice`, `grammar` (Lark
  or GBNF), `json_object`, plus `whitespace_pattern` for JSON;
- vLLM's older spellings `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern`.
One constraint per request. A field that cannot be honoured is a 400 naming it, never ignored:
an unknown `structured_outputs` key, a second constraint, a schema llguidance cannot compile.

Tool calls (chat): a forced `tool_choice` or a tool with `strict: true` has its calls constrained
to the tool's parameter schema by the worker, which writes the call's opening into the prompt and
owns the tool-call format (`apps/worker/tool_grammar.py`); here those schemas are checked to
compile (a 400 naming `tools`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from apps.bus.codes import ErrorCode, ServingError
from engine.grammars import grammar_error
from engine.protocol import StructuredOutput, StructuredOutputKind

JSON_OBJECT_SCHEMA = '{"type": "object"}'


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
        """The request's one constraint, compiled once to prove it can be enforced."""
        found = _constraints(self)
        if len(found) > 1:
            names = ", ".join(f"'{param}'" for param, _ in found)
            raise _refuse(found[1][0], f"Only one structured-output constraint per request; got {names}.")
        # Only chat requests have tools.
        tools = getattr(self, "tools", None)
        if tools:
            check_tool_constraints(tools, getattr(self, "tool_choice", None))
        if not found:
            return None
        param, constraint = found[0]
        error = grammar_error(constraint)
        if error is not None:
            raise _refuse(param, f"The {constraint.kind.value.replace('_', ' ')} in '{param}' cannot be "
                                 f"enforced: {error}")
        return constraint


def json_constraint(schema: str | dict[str, Any] | None, param: str) -> StructuredOutput:
    """A JSON constraint from one schema (any JSON object when None), checked to compile: what the
    Responses API's `text.format` asks for."""
    constraint = _json(JSON_OBJECT_SCHEMA if schema is None else _schema_text(schema, None, param))
    error = grammar_error(constraint)
    if error is not None:
        raise _refuse(param, f"The JSON schema in '{param}' cannot be enforced: {error}")
    return constraint


def _refuse(param: str, message: str) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def _schema_text(schema: str | dict[str, Any], whitespace_pattern: str | None, param: str) -> str:
    """A JSON schema as text, with a whitespace pattern put where llguidance reads its options."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _refuse(param, f"'{param}' must be a JSON schema (an object, or a string of one).") from None
        if not isinstance(schema, dict):
            raise _refuse(param, f"'{param}' must be a JSON schema object.")
    if whitespace_pattern is not None:
        options = dict(schema.get("x-guidance") or {})
        options.update(whitespace_flexible=True, whitespace_pattern=whitespace_pattern)
        schema = {**schema, "x-guidance": options}
    return json.dumps(schema)


def _json(spec: str) -> StructuredOutput:
    return StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=spec)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise _refuse(param, f"'{param}' must list at least one non-empty string.")
    return StructuredOutput(kind=StructuredOutputKind.CHOICE, spec=json.dumps(choices))


def _constraints(fields: StructuredOutputFields) -> list[tuple[str, StructuredOutput]]:
    """Every constraint the request asks for, with the field it came in."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = fields.response_format
    if isinstance(fmt, JsonObjectFormat):
        found.append(("response_format", _json(JSON_OBJECT_SCHEMA)))
    elif isinstance(fmt, JsonSchemaFormat):
        if fmt.json_schema is None:
            raise _refuse("response_format", "'response_format' of type 'json_schema' needs 'json_schema'.")
        schema = fmt.json_schema.schema
        found.append(("response_format", _json(JSON_OBJECT_SCHEMA if schema is None
                                                else _schema_text(schema, None, "response_format"))))
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
            found.append((param, _json(_schema_text(so.json, so.whitespace_pattern, param))))
        elif so.json_object:
            found.append((param, _json(_schema_text(JSON_OBJECT_SCHEMA, so.whitespace_pattern, param))))
        elif so.regex is not None:
            found.append((param, StructuredOutput(kind=StructuredOutputKind.REGEX, spec=so.regex)))
        elif so.choice is not None:
            found.append((param, _choice(so.choice, param)))
        elif so.grammar is not None:
            found.append((param, StructuredOutput(kind=StructuredOutputKind.GRAMMAR, spec=so.grammar)))
    if fields.guided_json is not None:
        found.append(("guided_json", _json(_schema_text(fields.guided_json, fields.guided_whitespace_pattern,
                                                        "guided_json"))))
    elif fields.guided_whitespace_pattern is not None:
        raise _refuse("guided_whitespace_pattern", "'guided_whitespace_pattern' applies to 'guided_json' only.")
    if fields.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(kind=StructuredOutputKind.REGEX, spec=fields.guided_regex)))
    if fields.guided_choice is not None:
        found.append(("guided_choice", _choice(fields.guided_choice, "guided_choice")))
    if fields.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput(kind=StructuredOutputKind.GRAMMAR,
                                                         spec=fields.guided_grammar)))
    return found


def check_tool_constraints(tools: list[Any], tool_choice: Any) -> None:
    """The tools whose calls the worker will constrain (every tool under tool_choice "required",
    the named one, and the strict ones) must have parameter schemas that compile."""
    if tool_choice == "none":
        return  # no tools reach the model
    named = getattr(tool_choice, "function", None)
    forced_name = named.get("name") if isinstance(named, dict) else None
    forced = tool_choice == "required" or forced_name is not None
    for tool in tools:
        function = tool.function
        if not (getattr(function, "strict", None) or (forced and forced_name in (None, function.name))):
            continue
        schema = function.parameters if function.parameters is not None else json.loads(JSON_OBJECT_SCHEMA)
        error = grammar_error(_json(json.dumps(schema)))
        if error is not None:
            raise _refuse("tools", f"The parameters of tool '{function.name}' cannot be enforced: {error}")
