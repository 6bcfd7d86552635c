"""Tools (OpenAI's function definitions): checked (``checked_tools``), a forced call's grammar
(``ToolCalls``) and its text read back as ``tool_calls`` as it grows (``CallReader``); an
assistant message's past calls checked (``past_call``)."""

from __future__ import annotations

import json
import re
from typing import Optional

from server.errors import APIError, short
from server.structured import json_schema_of


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without them


def past_call(call, field: str) -> dict:
    """An assistant message's tool call, checked, its arguments parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)):
        raise APIError(400, f"{field}: expected {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                       f"\"arguments\": \"<JSON text>\"}}}}, got {short(call)}", field)
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        raise APIError(400, f"{field}.function.arguments: expected a JSON object as text, got "
                       f"{short(function['arguments'])}", f"{field}.function.arguments") from None
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def checked_tools(tools: Optional[list]) -> dict[str, tuple[int, dict]]:
    """The request's tools by name: (index, parameters schema); a 400 naming the field
    (``tools[1].function.name``), what it got and what was expected, for a bad one."""
    out: dict[str, tuple[int, dict]] = {}
    for i, tool in enumerate(tools or ()):
        field = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{field}: expected {{\"type\": \"function\", \"function\": {{...}}}}, got "
                           f"{short(tool)}", field)
        if tool.get("type") != "function":
            raise APIError(400, f"{field}.type: only 'function' tools are supported, got {short(tool.get('type'))}",
                           f"{field}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{field}.function: expected an object with a name (and a description and "
                           f"parameters), got {short(function)}", f"{field}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"{field}.function.name: expected 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                           f"{short(name)}", f"{field}.function.name")
        if name in out:
            raise APIError(400, f"{field}.function.name: {name!r} is also the name of tools[{out[name][0]}]; each "
                           "tool needs its own", f"{field}.function.name")
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise APIError(400, f"{field}.function.{key}: expected a {kind.__name__}, got "
                               f"{short(function[key])}", f"{field}.function.{key}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise APIError(400, f"{field}.function.parameters: expected a JSON schema of type 'object', got "
                           f"{short(parameters)}", f"{field}.function.parameters")
        out[name] = (i, json_schema_of(parameters, f"{field}.function.parameters"))  # closed; the reserved key refused
    return out


class ToolCalls:
    """A forced tool call: the grammar that makes the model write one, and how its text reads
    back as OpenAI's ``tool_calls`` (``CallReader``).

    - A named function (``tool_choice`` ``{"type": "function", "function": {"name": ...}}``): the
      output is its arguments, a JSON document of its parameters' schema; one call.
    - "required": the output is ``[{"name":"f","arguments":{...}}, ...]``, each element a call of
      one of the tools with arguments of its schema: a Lark grammar embedding each tool's
      parameters as its own JSON document (so its ``$ref``s resolve in it), the wrapper compact
      (it is ours, never shown). Several calls with ``parallel_tool_calls`` (OpenAI's default:
      the model may, it need not), exactly one without. This is vLLM's design (an array of
      {name, parameters} objects, anyOf over the tools) as a grammar of our own.
    """

    def __init__(self, tools: dict[str, tuple[int, dict]], named: Optional[str], parallel: bool, options: dict):
        self.tools, self.named, self.parallel, self.options = tools, named, parallel, options

    def schema_of(self, name: str) -> dict:
        """A tool's parameters with the request's spacing options."""
        parameters = self.tools[name][1]
        return parameters if "x-guidance" in parameters else {**parameters, "x-guidance": self.options}

    def constraint(self) -> dict:
        """The rules of the output, as ``Request.json_schema`` takes them."""
        from runner import grammar

        if self.named is not None:
            return self.schema_of(self.named)
        lines = ['start: /[ ]?/ "[" call ("," call)* "]"' if self.parallel else 'start: /[ ]?/ "[" call "]"',
                 "call: " + " | ".join(f"call_{k}" for k in range(len(self.tools)))]
        for k, name in enumerate(self.tools):
            head = grammar.lark_literal(f'{{"name":{json.dumps(name)},"arguments":')
            lines += [f'call_{k}: {head} arguments_{k} "}}"',
                      f"arguments_{k}: {grammar.lark_json(self.schema_of(name))}"]
        return grammar.lark("\n".join(lines))

    def check(self) -> None:
        """Each forced tool's parameters compiled as far as they can be without a tokenizer: a 400
        naming the tool's field for one the grammar engine cannot take, before anything runs."""
        from runner import grammar

        for name in [self.named] if self.named is not None else list(self.tools):
            field = f"tools[{self.tools[name][0]}].function.parameters"
            try:
                grammar.check_schema(self.schema_of(name))
            except ValueError as e:
                raise APIError(400, f"{field}: {e}", field) from None

    def reader(self) -> "CallReader":
        return CallReader(self.named)


class CallReader:
    """Reads a forced tool call's text as it grows (``ToolCalls``): each ``feed`` returns the
    calls' new parts, ``(index, name, arguments)`` with ``name`` once, when its call starts, and
    ``arguments`` the text of its arguments that came. The text follows the grammar, so the
    reader only counts: the literal parts are known, and an argument document ends where its
    brackets close (outside its strings)."""

    _HEAD = '{"name":"'  # then the name, then _MID, then the arguments, then "}"
    _MID = '","arguments":'

    def __init__(self, named: Optional[str]):
        self.named = named
        self.calls: list[list[str]] = []  # [name, arguments so far] of each call
        self.complete = False  # the whole text was read: every call and the list closed
        self.state = "arguments" if named is not None else "open"
        self.skip = 0  # characters of a known literal still to pass
        self.name, self.depth, self.in_string, self.escaped = "", 0, False, False
        self.unnamed = named is not None  # the named call's name is still to be returned (by the first feed)
        if named is not None:
            self.calls.append([named, ""])

    def feed(self, text: str) -> list[tuple[int, Optional[str], str]]:
        parts: dict[int, list] = {}

        def part(index: int) -> list:
            return parts.setdefault(index, [None, ""])

        if self.unnamed:
            part(0)[0], self.unnamed = self.named, False

        for c in text:
            if self.complete:
                break
            if self.skip:
                self.skip -= 1
                continue
            state = self.state
            if state == "open":  # the optional leading space, then "["
                if c == "[":
                    self.state, self.skip = "name", len(self._HEAD)
            elif state == "name":
                if c == '"':
                    self.calls.append([self.name, ""])
                    part(len(self.calls) - 1)[0] = self.name
                    self.name, self.state, self.skip = "", "arguments", len(self._MID) - 1
                else:
                    self.name += c
            elif state == "arguments":
                if self.depth == 0 and c == " " and not self.calls[-1][1]:
                    continue  # the named call's leading space: not part of its document
                self.calls[-1][1] += c
                part(len(self.calls) - 1)[1] += c
                if self._closes(c):
                    if self.named is not None:
                        self.complete = True
                    else:
                        self.state, self.skip = "next", 1  # the call's "}"
            elif state == "next":  # "," and another call, or "]"
                if c == ",":
                    self.state, self.skip = "name", len(self._HEAD)
                else:
                    self.complete = True
        return [(index, name, arguments) for index, (name, arguments) in sorted(parts.items())]

    def _closes(self, c: str) -> bool:
        """Whether ``c`` closes the argument document (JSON: brackets outside strings)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return self.depth == 0
        return False
