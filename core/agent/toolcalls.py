"""Tool calls in model text, and the tool schemas environments declare.

Calls use the Hermes format, what Qwen2.5's chat template asks for and verl's ``HermesToolParser`` reads::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>

A turn may hold several. A body that is not a JSON object with a ``name`` is an error string (the environment
shows it to the model), never an exception. ``arguments`` may also be a JSON string holding the object (OpenAI's
wire form), or absent (no arguments).

``bare_call=(tool, parameter)`` also takes a body that is not JSON as a call of `tool` with the body, stripped,
as `parameter` (``<tool_call>3+4</tool_call>``): for environments with one tool and small models that emit
short bodies (the tiny kit's).
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from verlflow.core.errors import BlueprintError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus '.')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_calls(text: str, *, bare_call: Optional[tuple[str, str]] = None) -> tuple[list[ToolCall], list[str]]:
    """The calls in `text` and, for each body that is not a call, an error string saying why."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in _CALL.findall(text):
        call, error = _parse_body(body.strip(), bare_call)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    if text.count(OPEN) > text.count(CLOSE):
        errors.append(f"a {OPEN} without its {CLOSE}: the call was cut off or not closed.")
    return calls, errors


def check_tool_schema(schema: Any, where: str) -> None:
    """Refuse (BlueprintError naming `where`) a tool schema that is not an OpenAI function schema whose
    ``parameters`` is a valid JSON Schema of an object."""
    how = (' A tool schema looks like {"type": "function", "function": {"name": "calculator", "description": '
           '"...", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
           '"required": ["expression"]}}}.')
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise BlueprintError(f"{where}: not an OpenAI function tool schema (it needs \"type\": \"function\" and a "
                             f"\"function\" object), got {_short(schema)}." + how)
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise BlueprintError(f"{where}: function.name must be 1-64 letters, digits, '_', '-' or '.', "
                             f"got {_short(fn.get('name'))}." + how)
    if "description" in fn and not isinstance(fn["description"], str):
        raise BlueprintError(f"{where}: function.description must be a string, got {_short(fn['description'])}." + how)
    if "parameters" in fn:
        _check_parameters(fn["parameters"], f"{where}: function.parameters", how)


# ---------------------------------------------------------------------------------------------------
def _parse_body(body: str, bare_call: Optional[tuple[str, str]]) -> tuple[Optional[ToolCall], str]:
    try:
        obj = json.loads(body)
    except ValueError as e:
        if bare_call is not None and body:
            return ToolCall(bare_call[0], {bare_call[1]: body}), ""
        return None, f"the tool call is not valid JSON ({e}): {body[:200]!r}"
    if not isinstance(obj, dict):
        if bare_call is not None and body:  # a bare number such as <tool_call>7</tool_call>
            return ToolCall(bare_call[0], {bare_call[1]: body}), ""
        return None, f"the tool call must be a JSON object with \"name\" and \"arguments\", got {body[:200]!r}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"the tool call has no \"name\": {body[:200]!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire form: the object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None, f"the arguments of tool call {name!r} are not valid JSON: {args[:200]!r}"
    if not isinstance(args, dict):
        return None, f"the arguments of tool call {name!r} must be a JSON object, got {_short(args)}"
    return ToolCall(name, args), ""


def _check_parameters(params: Any, where: str, how: str) -> None:
    import jsonschema  # lazy: only validate and environments' construction check schemas

    if not isinstance(params, dict) or params.get("type") != "object":
        raise BlueprintError(f"{where} must be a JSON Schema of an object ({{\"type\": \"object\", "
                             f"\"properties\": {{...}}}}), got {_short(params)}." + how)
    validator = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(params)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top)"
        raise BlueprintError(f"{where} is not a valid JSON Schema: at {path}: {e.message}." + how) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
