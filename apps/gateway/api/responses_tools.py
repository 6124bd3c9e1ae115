"""A Responses request's `tools` and `tool_choice` as the functions a chat template is offered.

Function tools are offered as they are. A `namespace` tool's functions are offered one by one, each
named `<namespace>.<function>` (the dotted recipient OpenAI's own chat formats use); a call to one
comes back as a `function_call` item with the plain `name` and its `namespace`, as the `openai`
SDK's `ResponseFunctionToolCall` holds it, and a `function_call` sent back as input with a
`namespace` is qualified again before the template sees it.

Tools the server cannot run (hosted tools: web search, file search, code interpreter, computer
use, image generation, MCP, shells, tool search, custom free-form tools) are left out of what the
model sees; the answer says so in the `X-Helexa-Warning` header and the gateway logs it. A
`tool_choice` that forces one of them is a 400 naming it. Any other tool type is a 400.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from apps.bus.codes import ErrorCode, ServingError
from apps.gateway.api import responses_schema as rs
from apps.gateway.api.validate import MAX_TOOLS

log = logging.getLogger("helexa.gateway")

WARNING_HEADER = "X-Helexa-Warning"
# Tool types OpenAI runs itself (or that need a runtime this server does not have).
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview", "image_generation",
    "mcp", "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling", "custom",
})


def _refuse(message: str, param: str) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST, message, param=param)


def qualified(namespace: str | None, name: str) -> str:
    """A function's name as the template sees it."""
    return f"{namespace}.{name}" if namespace else name


@dataclass
class OfferedTools:
    """What the model is offered: template tools, the namespace of each qualified name, and the
    tool types left out."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)

    def offer(self, tool: rs.FunctionTool, namespace: str | None) -> None:
        function = {k: v for k, v in msgspec.to_builtins(tool).items() if k != "type" and v is not None}
        function["name"] = qualified(namespace, tool.name)
        if namespace:
            self.namespaces[function["name"]] = (namespace, tool.name)
        self.functions.append({"type": "function", "function": function})

    def warning(self) -> str | None:
        if not self.left_out:
            return None
        kinds = ", ".join(sorted(set(self.left_out)))
        return f"tools not offered to the model (this server cannot run them): {kinds}"


def _convert(value: dict[str, Any], kind: type[msgspec.Struct], param: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise _refuse(f"Invalid tool in '{param}': {exc}.", param) from None


def offered_tools(tools: list[dict[str, Any]]) -> OfferedTools:
    offered = OfferedTools()
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            offered.offer(_convert(tool, rs.FunctionTool, "tools"), None)
        elif kind == "namespace":
            space = _convert(tool, rs.NamespaceTool, "tools")
            for inner in space.tools:
                if inner.get("type") == "function":
                    offered.offer(_convert(inner, rs.FunctionTool, "tools"), space.name)
                elif inner.get("type") in HOSTED_TOOLS:
                    offered.left_out.append(f"{space.name}.{inner.get('type')}")
                else:
                    raise _refuse(f"Tools of type '{inner.get('type')}' are not supported in a namespace.", "tools")
        elif kind in HOSTED_TOOLS:
            offered.left_out.append(str(kind))
        else:
            raise _refuse(f"Tools of type '{kind}' are not supported.", "tools")
    if len(offered.functions) > MAX_TOOLS:
        raise _refuse(f"'tools' holds at most {MAX_TOOLS} functions, namespaces' functions included.", "tools")
    names = [f["function"]["name"] for f in offered.functions]
    if len(set(names)) != len(names):
        raise _refuse("Two tools in 'tools' have the same name.", "tools")
    if offered.left_out:
        log.info("tools the server cannot run left out of the prompt", extra={"tools": offered.left_out})
    return offered


def forced(choice: str | dict[str, Any] | None, offered: OfferedTools, declared: bool) -> tuple[bool, str | None]:
    """(a call is required, the function it must call) from `tool_choice`."""
    if choice is None or isinstance(choice, str):
        if choice == "required" and not offered.functions:
            raise _refuse("'tool_choice' requires 'tools' the model can call." if declared
                          else "'tool_choice' requires 'tools'.", "tool_choice")
        return choice == "required", None
    kind = choice.get("type")
    if kind in HOSTED_TOOLS or kind in ("mcp", "allowed_tools"):
        raise _refuse(f"'tool_choice' forces the tool type '{kind}', which this server cannot run.", "tool_choice")
    if kind != "function" or not isinstance(choice.get("name"), str):
        raise _refuse("'tool_choice' must be 'none', 'auto', 'required' or a function.", "tool_choice")
    name = qualified(choice.get("namespace"), choice["name"])
    if name not in {f["function"]["name"] for f in offered.functions}:
        raise _refuse(f"'tool_choice' names the function '{name}', which is not in 'tools'.", "tool_choice")
    return True, name
