"""Structured output, one kind a request (two are a 400 naming both): ``response_format``
(json_object, json_schema), vLLM's ``guided_json`` / ``structured_outputs`` (a schema),
``guided_regex``, ``guided_choice`` (the output is exactly one of the strings), ``guided_grammar``
(a Lark grammar as llguidance reads it, or GBNF), and on chat a forced tool call (``tools`` with
``tool_choice`` "required" or a named function: ``server.tools.ToolCalls``). Each becomes the request's
``json_schema``, which the runner compiles (``runner/grammar.py``); regexes and grammars are
checked here, before anything runs. JSON is compact (no whitespace between its tokens) unless
``guided_whitespace_pattern`` gives the whitespace allowed there. vLLM's default is the other way
round: its xgrammar and guidance backends allow any whitespace unless the server is started with
``disable_any_whitespace`` (``StructuredOutputsConfig.disable_any_whitespace = False``,
vllm/config/structured_outputs.py; ``whitespace_flexible: not disable_any_whitespace`` in
vllm/v1/structured_output/backend_guidance.py). Compact here because a small or prose-trained
model given the choice spends its tokens on blank lines (measured: runner/grammar.py).

``StructuredOutput`` is what a request body does with these fields (``server.protocol._Body``
holds them); ``json_schema_of`` reads a schema as a client sent it.
"""

from __future__ import annotations

import json
from typing import ClassVar, Optional

from server.errors import APIError

GUIDED = ("response_format", "guided_json", "structured_outputs", "guided_regex", "guided_choice",
          "guided_grammar")


def lark_of(text: str) -> str:
    """``guided_grammar`` as Lark: llguidance reads Lark (its dialect), and turns GBNF (llama.cpp's,
    which vLLM's xgrammar backend takes) into it."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # its converter's own errors, of any kind: the grammar is not GBNF
        raise APIError(400, f"guided_grammar: neither Lark nor GBNF llguidance reads: {e}", "guided_grammar") from None


def json_schema_of(value, field: str) -> dict:
    """A JSON schema given as an object or as JSON text (vLLM's guided_json takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"{field}: the schema is not JSON: {e}", field.split(".")[0]) from None
        except RecursionError:  # Python's parser gives up near 1,000 levels; the runner takes 100
            raise APIError(400, f"{field}: the schema is JSON nested too deeply", field.split(".")[0]) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{field}: a JSON schema must be an object, got {type(value).__name__}",
                       field.split(".")[0])
    from runner.grammar import LARK_KEY

    if LARK_KEY in value:  # how the runner tells a Lark grammar from a schema
        raise APIError(400, f"{field}: {LARK_KEY!r} is reserved by this server, not a JSON-schema keyword; for a "
                       "grammar give guided_grammar", field.split(".")[0])
    from runner.schema import closed_objects

    return closed_objects(value)  # objects closed unless the schema opens them, as vLLM's default backend


class StructuredOutput:
    """The structured-output fields of a request body (``server.protocol._Body``), checked and
    read as the runner's constraint."""

    def _guided_fields(self) -> list[str]:
        """The fields this body gives a structured output in (one, unless the body is refused)."""
        return [name for name in GUIDED if getattr(self, name) not in (None, {"type": "text"})]

    def schema_field(self) -> str:
        """The field this body gave its structured output in (``response_format`` if none)."""
        return next(iter(self._guided_fields()), "response_format")

    def api_names(self, prompt_field: str) -> dict[str, str]:
        """``Request`` fields -> the names this body sent them under (for ``bad_request``)."""
        return {"prompt": prompt_field, "json_schema": self.schema_field()}

    def check_guided(self) -> None:
        """The structured output's fields, checked before anything runs: one kind, and a regex,
        grammar or whitespace pattern llguidance reads (a JSON schema is compiled by the runner,
        which names the field of a bad one)."""
        given = self._guided_fields()
        if len(given) > 1:
            raise APIError(400, f"{given[1]}: give one of {', '.join(GUIDED + self._forcing)}, got {given}",
                           given[1])
        constraint = self.json_schema()
        if given and given[0] in ("guided_regex", "guided_grammar"):
            from runner import grammar  # llguidance is imported by the first request that asks for it

            try:
                if given[0] == "guided_regex":
                    grammar.check_regex(self.guided_regex)
                else:
                    grammar.check_lark(constraint[grammar.LARK_KEY])
            except ValueError as e:
                raise APIError(400, f"{given[0]}: {e}", given[0]) from None
        if self.guided_whitespace_pattern is not None:
            if not self._json_output():
                raise APIError(400, "guided_whitespace_pattern: it spaces JSON output (response_format json_object "
                               "or json_schema, guided_json, structured_outputs, a forced tool call's arguments); "
                               "this request asks for none", "guided_whitespace_pattern")
            from runner import grammar

            try:
                grammar.check_whitespace(self.guided_whitespace_pattern)
            except ValueError as e:
                raise APIError(400, f"guided_whitespace_pattern: {e}", "guided_whitespace_pattern") from None

    _forcing: ClassVar[tuple] = ()  # fields beyond GUIDED that may give a structured output (chat: tool_choice)

    def _json_output(self) -> bool:
        """Whether this body's structured output is JSON."""
        return bool(self._guided_fields()) and self._guided_fields()[0] in ("response_format", "guided_json",
                                                                           "structured_outputs")

    def json_options(self) -> dict:
        """llguidance's spacing options for this body's JSON (runner/grammar.py): compact, or the
        whitespace ``guided_whitespace_pattern`` allows between tokens."""
        from runner import grammar

        if self.guided_whitespace_pattern is None:
            return dict(grammar.COMPACT)
        return {"whitespace_pattern": self.guided_whitespace_pattern}

    def json_schema(self) -> Optional[dict]:
        """The rules a structured output must satisfy, as ``Request.json_schema`` takes them: a
        JSON schema (``{"type": "object"}`` for any object) with its spacing options, or a Lark
        grammar (``runner.grammar.lark``); None: free text."""
        given = self._guided_fields()
        if not given:
            return None
        from runner import grammar  # llguidance is imported by the first request that asks for it

        name, value = given[0], getattr(self, given[0])
        if name == "guided_regex":
            return grammar.lark(f"start: {grammar.lark_regex(value)}")
        if name == "guided_choice":
            if not value:
                raise APIError(400, "guided_choice: give at least one string, got []", name)
            return grammar.lark("start: " + " | ".join(grammar.lark_literal(c) for c in value))
        if name == "guided_grammar":
            return grammar.lark(lark_of(value))
        return self._with_options(self._json_constraint(name, value), name)

    def _json_constraint(self, name: str, value) -> dict:
        if name == "guided_json":
            return json_schema_of(value, name)
        if name == "structured_outputs":
            keys = set(value) - {"json", "json_object"}
            if keys or len(value) != 1:
                raise APIError(400, f"structured_outputs: only one of 'json' (a schema) or 'json_object' is "
                               f"supported, got {sorted(value)}", "structured_outputs")
            return {"type": "object"} if "json_object" in value else json_schema_of(value["json"], "structured_outputs.json")
        kind = value.get("type")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise APIError(400, "response_format: json_schema needs {\"name\": ..., \"schema\": {...}}",
                               "response_format")
            return json_schema_of(spec["schema"], "response_format")
        raise APIError(400, f"response_format: type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                       "response_format")

    def _with_options(self, schema: dict, field: str) -> dict:
        """``schema`` with this body's spacing options (a schema that sets llguidance's own, its
        ``x-guidance``, keeps them where the body asks nothing else)."""
        own = schema.get("x-guidance")
        if own is not None and self.guided_whitespace_pattern is not None:
            raise APIError(400, f"{field}: the schema's x-guidance sets llguidance's options itself; drop it or "
                           "guided_whitespace_pattern", field)
        return schema if own is not None else {**schema, "x-guidance": self.json_options()}
