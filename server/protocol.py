"""The OpenAI API's request bodies (completions, chat completions, tokenize) as pydantic models,
and their translation into the runner's ``Request``s.

Tolerant where vLLM is, never silently wrong:
- a field this server does not know is accepted and logged once per name (vLLM's rule: clients
  send their own extras, and a 400 for each would break them);
- a known field whose meaning is not implemented (``best_of`` > 1, ``logit_bias``, ``suffix``,
  ``service_tier`` "flex", ``store`` true, OpenAI's ``functions``, ``audio``, ``prediction``,
  vLLM's ``use_beam_search``, ``bad_words``...: ``_UNSUPPORTED``) is a 400 naming it when it asks
  for something, never accepted and ignored; those that only inform (``user``, ``metadata``,
  ``prompt_cache_key``, ``safety_identifier``) are accepted as they are;
- a null means the field's default (clients send ``"temperature": null`` for "default").
Every other field is checked here or by ``Request``; a bad one is an ``APIError`` (HTTP 400)
naming the API's own field (``top_p``, not ``nucleus_p``).

Structured output, one kind a request (two are a 400 naming both): ``response_format``
(json_object, json_schema), vLLM's ``guided_json`` / ``structured_outputs`` (a schema),
``guided_regex``, ``guided_choice`` (the output is exactly one of the strings), ``guided_grammar``
(a Lark grammar as llguidance reads it, or GBNF), and on chat a forced tool call (``tools`` with
``tool_choice`` "required" or a named function: ``ToolCalls``). Each becomes the request's
``json_schema``, which the runner compiles (``runner/grammar.py``); regexes and grammars are
checked here, before anything runs. JSON is compact (no whitespace between its tokens) unless
``guided_whitespace_pattern`` gives the whitespace allowed there. vLLM's default is the other way
round: its xgrammar and guidance backends allow any whitespace unless the server is started with
``disable_any_whitespace`` (``StructuredOutputsConfig.disable_any_whitespace = False``,
vllm/config/structured_outputs.py; ``whitespace_flexible: not disable_any_whitespace`` in
vllm/v1/structured_output/backend_guidance.py). Compact here because a small or prose-trained
model given the choice spends its tokens on blank lines (measured: runner/grammar.py).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from runner import Request
from runner.requests import MAX_LOGPROBS, MAX_STOP_STRINGS  # one limit for the API and the runner
from server.chat import RESERVED

log = logging.getLogger("grok_runner.server")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Request's field -> the API's name for it
_API_NAMES = {"prompt": "prompt", "temperature": "temperature", "nucleus_p": "top_p", "rng_seed": "seed",
              "max_len": "max_tokens", "top_k": "top_k", "stop_token_ids": "stop_token_ids",
              "request_id": "request_id", "logprobs": "logprobs", "prompt_logprobs": "logprobs",
              "min_p": "min_p", "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
              "presence_penalty": "presence_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
              "skip_special_tokens": "skip_special_tokens", "json_schema": "response_format",
              "speculative": "speculative"}
MAX_STOPS = MAX_STOP_STRINGS  # OpenAI's limit


def bad_request(error: ValueError, names: Optional[dict[str, str]] = None) -> APIError:
    """A ``Request``/runner ``ValueError`` as a 400 naming the API's field: the one this body sent
    (``names``: a ``Request`` field -> the body's name for it, e.g. ``json_schema`` ->
    ``guided_json``), else the API's usual name."""
    message = str(error)
    match = re.match(r"Request\.(\w+)", message)
    param = None
    if match:
        param = (names or {}).get(match.group(1)) or _API_NAMES.get(match.group(1))
    if param is not None and match:
        message = param + message[match.end():]
    return APIError(400, message, param)


class _Tolerant(BaseModel):
    """A body that accepts unknown fields (each name logged once a process) and reads a null as
    the field's default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def log_unknown(self) -> None:
        for name in self.model_extra or {}:
            with _seen_lock:
                if name in _seen_unknown:
                    continue
                _seen_unknown.add(name)
            log.warning("%s: ignoring the unknown field %r (logged once)", type(self).__name__, name)


_seen_unknown: set[str] = set()
_seen_lock = threading.Lock()


# Known fields this server does not implement, accepted only where they ask for nothing: name ->
# (the values that ask nothing, what it would ask for). Undeclared, so they are also logged once
# as fields this server ignores. Fields that only inform are not here: user, metadata,
# prompt_cache_key, safety_identifier (OpenAI's), request_id (vLLM's: ours are our own).
_UNSUPPORTED = {
    # vLLM's sampling and output extras
    "use_beam_search": ((False,), "beam search"),
    "length_penalty": ((1, 1.0), "a length penalty (beam search)"),
    "include_stop_str_in_output": ((False,), "the stop string in the output"),
    "spaces_between_special_tokens": ((True,), "special tokens decoded without spaces between them"),
    "truncate_prompt_tokens": ((), "prompt truncation"),
    "prompt_logprobs": ((), "prompt logprobs this way (on /v1/completions: echo=true with logprobs)"),
    "allowed_token_ids": (([],), "a list of allowed tokens"),
    "bad_words": (([],), "banned words"),
    "logits_processors": (([],), "logits processors"),
    "return_tokens_as_token_ids": ((False,), "tokens named by their ids"),
    "return_token_ids": ((False,), "the token ids in the response"),
    "priority": ((0,), "priority scheduling (requests are served in arrival order)"),
    "cache_salt": ((), "a prefix cache of its own (the prefix cache is shared by all requests)"),
    "kv_transfer_params": ((), "KV-cache transfer"),
    "vllm_xargs": ((), "vLLM's extra arguments"),
    "mm_processor_kwargs": ((), "multimodal input"),
    "prompt_embeds": ((), "prompt embeddings"),
    "add_special_tokens": ((False,), "a BOS token added to the prompt (none is: as Grok-1's runner)"),
    "structural_tag": ((), "structural tags"),
    "guided_decoding_backend": (("auto", "guidance", "llguidance"),
                                "another grammar engine (the grammar engine is llguidance)"),
}
_UNSUPPORTED_CHAT = {
    # OpenAI's
    "functions": ((), "the legacy functions (give tools, with tool_choice 'required' or a named function)"),
    "function_call": (("none", "auto"), "the legacy function_call (give tools, with tool_choice 'required' or a "
                      "named function)"),
    "audio": ((), "audio output"),
    "modalities": ((["text"],), "output other than text"),
    "prediction": ((), "predicted outputs"),
    "web_search_options": ((), "web search"),
    "reasoning_effort": ((), "reasoning (this model does not reason before it answers)"),
    "verbosity": ((), "a verbosity"),
    # vLLM's
    "echo": ((False,), "the last message echoed"),
    "chat_template": ((), "a chat template of the request's own (the server's is set when it starts: "
                      "--chat-template)"),
    "documents": ((), "documents for the chat template"),
}
# the fields a structured output may be given in, one a request (see the module docstring)
_GUIDED = ("response_format", "guided_json", "structured_outputs", "guided_regex", "guided_choice",
           "guided_grammar")


class _Body(_Tolerant):
    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # OpenAI's fields that ask for nothing this server would have to do: accepted as they are
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    # ... and those accepted only where they ask for nothing (a 400 naming them otherwise)
    store: bool = False
    service_tier: Optional[str] = None
    best_of: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extras
    top_k: int = 0  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # ours: draft tokens a step of n-gram speculative decoding (None: the server's --speculative; 0: off)
    speculative: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    # structured output (one of them: _GUIDED): OpenAI's response_format, and vLLM's guided_* and
    # structured_outputs (its json or json_object)
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # the whitespace allowed between JSON tokens, a regex (vLLM's, for its outlines backend); none:
    # compact JSON. Every match must be JSON whitespace.
    guided_whitespace_pattern: Optional[str] = None

    _unsupported: ClassVar[dict] = _UNSUPPORTED

    def check_common(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self._unsupported and value not in self._unsupported[name][0]:
                raise APIError(400, f"{name}: {self._unsupported[name][1]} is not supported by this server, got "
                               f"{_short(value)}", name)
        self.log_unknown()
        refused = (("best_of", self.best_of not in (None, 1), "best_of > 1"),
                   ("logit_bias", bool(self.logit_bias), "logit_bias"),
                   ("store", self.store, "store=true (nothing is stored)"),
                   ("service_tier", self.service_tier not in (None, "auto", "default"),
                    f"service_tier {self.service_tier!r} (only 'auto' and 'default')"))
        for name, asked, what in refused:
            if asked:
                raise APIError(400, f"{name}: {what} is not supported by this server", name)
        if self.stream_options:
            if not self.stream:
                raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
            unknown = set(self.stream_options) - {"include_usage", "continuous_usage_stats"}
            if unknown:
                raise APIError(400, f"stream_options: unknown option(s) {sorted(unknown)}", "stream_options")
        self.check_guided()
        stops = self.stops()
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop: up to {MAX_STOPS} non-empty strings, got {self.stop!r}", "stop")

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _guided_fields(self) -> list[str]:
        """The fields this body gives a structured output in (one, unless the body is refused)."""
        return [name for name in _GUIDED if getattr(self, name) not in (None, {"type": "text"})]

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
            raise APIError(400, f"{given[1]}: give one of {', '.join(_GUIDED + self._forcing)}, got {given}",
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

    _forcing: ClassVar[tuple] = ()  # fields beyond _GUIDED that may give a structured output (chat: tool_choice)

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
            return grammar.lark(_lark_of(value))
        return self._with_options(self._json_constraint(name, value), name)

    def _json_constraint(self, name: str, value) -> dict:
        if name == "guided_json":
            return _schema(value, name)
        if name == "structured_outputs":
            keys = set(value) - {"json", "json_object"}
            if keys or len(value) != 1:
                raise APIError(400, f"structured_outputs: only one of 'json' (a schema) or 'json_object' is "
                               f"supported, got {sorted(value)}", "structured_outputs")
            return {"type": "object"} if "json_object" in value else _schema(value["json"], "structured_outputs.json")
        kind = value.get("type")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise APIError(400, "response_format: json_schema needs {\"name\": ..., \"schema\": {...}}",
                               "response_format")
            return _schema(spec["schema"], "response_format")
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

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: the usage so far in every chunk."""
        return bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))

    def requests(self, prompt, max_tokens: int, prompt_field: str, logprobs: Optional[int] = None,
                 prompt_logprobs: Optional[int] = None) -> list[Request]:
        """The ``n`` runner requests of one prompt (text or ids): choice i takes seed + i. Each
        computes ``logprobs`` alternatives per token (None: no log-probabilities) and scores the
        prompt with ``prompt_logprobs`` (the copies of a prompt share one prefill, and its scores)."""
        out = []
        constraint = self.json_schema()
        for i in range(self.n):
            seed = None if self.seed is None else self.seed + i  # choice i: seed + i, in 64 bits
            if seed is not None and seed >= 2**64 > self.seed:
                seed -= 2**64
            try:
                out.append(Request(prompt, temperature=self.temperature, nucleus_p=self.top_p,
                                   top_k=0 if self.top_k == -1 else self.top_k, rng_seed=seed,
                                   max_len=max_tokens, stop_token_ids=self.stop_token_ids or (), stop=self.stops(),
                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs, min_p=self.min_p,
                                   repetition_penalty=self.repetition_penalty,
                                   frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                                   min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                                   skip_special_tokens=self.skip_special_tokens, json_schema=constraint,
                                   speculative=self.speculative))
            except ValueError as e:
                raise bad_request(e, self.api_names(prompt_field)) from None
        return out


def _short(value, limit: int = 200) -> str:
    """A value as a message quotes it, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lark_of(text: str) -> str:
    """``guided_grammar`` as Lark: llguidance reads Lark (its dialect), and turns GBNF (llama.cpp's,
    which vLLM's xgrammar backend takes) into it."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # its converter's own errors, of any kind: the grammar is not GBNF
        raise APIError(400, f"guided_grammar: neither Lark nor GBNF llguidance reads: {e}", "guided_grammar") from None


def _schema(value, field: str) -> dict:
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


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0: with echo, the prompt alone (scoring)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None

    def prompts(self) -> list:
        """The prompts: texts or id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; it is only allowed with echo=true (the prompt "
                           "returned, with its logprobs if asked)", "max_tokens")


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without them


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # refusal, audio...: of OpenAI's own replies sent back; unused

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None  # an assistant's (checked by template_messages)
    tool_call_id: Optional[str] = None  # a tool's: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages: only text content parts are supported, got {part.get('type')!r}",
                               "messages")
            parts.append(part["text"])
        return "".join(parts)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as a chat template reads them (server/chat.py): role, content (text, or None
    if null), and name, tool_calls (their arguments parsed: Hugging Face's templates take a dict)
    and tool_call_id where given. A tool message must answer a call of an earlier assistant
    message, as OpenAI requires; a 400 naming the field otherwise."""
    out, calls = [], set()
    for i, m in enumerate(messages):
        made = None
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls: only an assistant message makes tool calls, got role "
                               f"{m.role!r}", f"messages[{i}].tool_calls")
            made = [_past_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            calls.update(c["id"] for c in made)
        if m.role == "tool" and m.tool_call_id not in calls:
            field = f"messages[{i}].tool_call_id"
            raise APIError(400, f"{field}: a tool message answers a tool call of an earlier assistant message: "
                           f"expected one of {sorted(calls)}, got {m.tool_call_id!r}", field)
        message = {"role": m.role, "content": None if m.content is None else m.text()}
        for name, value in (("name", m.name), ("tool_calls", made), ("tool_call_id", m.tool_call_id)):
            if value is not None:
                message[name] = value
        out.append(message)
    return out


def _past_call(call, field: str) -> dict:
    """An assistant message's tool call, checked, its arguments parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)):
        raise APIError(400, f"{field}: expected {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                       f"\"arguments\": \"<JSON text>\"}}}}, got {_short(call)}", field)
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        raise APIError(400, f"{field}.function.arguments: expected a JSON object as text, got "
                       f"{_short(function['arguments'])}", f"{field}.function.arguments") from None
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def checked_tools(tools: Optional[list]) -> dict[str, tuple[int, dict]]:
    """The request's tools by name: (index, parameters schema); a 400 naming the field
    (``tools[1].function.name``), what it got and what was expected, for a bad one."""
    out: dict[str, tuple[int, dict]] = {}
    for i, tool in enumerate(tools or ()):
        field = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{field}: expected {{\"type\": \"function\", \"function\": {{...}}}}, got "
                           f"{_short(tool)}", field)
        if tool.get("type") != "function":
            raise APIError(400, f"{field}.type: only 'function' tools are supported, got {_short(tool.get('type'))}",
                           f"{field}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{field}.function: expected an object with a name (and a description and "
                           f"parameters), got {_short(function)}", f"{field}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"{field}.function.name: expected 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                           f"{_short(name)}", f"{field}.function.name")
        if name in out:
            raise APIError(400, f"{field}.function.name: {name!r} is also the name of tools[{out[name][0]}]; each "
                           "tool needs its own", f"{field}.function.name")
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise APIError(400, f"{field}.function.{key}: expected a {kind.__name__}, got "
                               f"{_short(function[key])}", f"{field}.function.{key}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise APIError(400, f"{field}.function.parameters: expected a JSON schema of type 'object', got "
                           f"{_short(parameters)}", f"{field}.function.parameters")
        out[name] = (i, _schema(parameters, f"{field}.function.parameters"))  # closed; the reserved key refused
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


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None  # "none", "auto", "required", {"type": "function", "function": {"name"}}
    parallel_tool_calls: Optional[bool] = None  # None: OpenAI's default, true
    # vLLM's chat template options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    _unsupported: ClassVar[dict] = {**_UNSUPPORTED, **_UNSUPPORTED_CHAT}
    _forcing: ClassVar[tuple] = ("tool_choice",)
    _tools: Optional[dict] = PrivateAttr(default=None)

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        calls = self.tool_calls()
        if calls is not None:
            calls.check()
            if self.response_format not in (None, {"type": "text"}):  # set aside, still checked
                self._json_constraint("response_format", self.response_format)
        _check_template_options(self)

    def tool_mode(self) -> tuple[str, Optional[str]]:
        """("none" | "required" | "named", the named function); a 400 for a tool_choice this
        server cannot honour."""
        choice, tools = self.tool_choice, self.checked_tools()
        if choice in (None, "none", "auto") and not tools:
            return "none", None  # without tools, "auto" is "none"
        if choice == "none":
            return "none", None  # OpenAI's: the tools are the template's to show, none is called
        if choice in (None, "auto"):
            field = "tool_choice" if choice == "auto" else "tools"
            raise APIError(400, f"{field}: tool_choice 'auto'{' (the default with tools)' if choice is None else ''} "
                           "lets the model choose between text and a tool call, and this model has no tool-call "
                           "format (no chat template that declares one), so a call could not be told from text; "
                           "give tool_choice 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}} "
                           "(the output is then forced to be a call), or 'none'", field)
        if choice == "required":
            if not tools:
                raise APIError(400, "tool_choice: 'required' needs tools", "tool_choice")
            return "required", None
        function = choice.get("function") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)):
            raise APIError(400, f"tool_choice: expected 'none', 'auto', 'required' or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {_short(choice)}", "tool_choice")
        if function["name"] not in tools:
            raise APIError(400, f"tool_choice: the function {function['name']!r} is not one of the tools "
                           f"({sorted(tools) or 'none given'})", "tool_choice")
        return "named", function["name"]

    def checked_tools(self) -> dict[str, tuple[int, dict]]:
        if self._tools is None:
            self._tools = checked_tools(self.tools)
        return self._tools

    def tool_calls(self) -> Optional[ToolCalls]:
        """The forced tool call this request asks for, or None."""
        mode, name = self.tool_mode()
        if mode == "none":
            return None
        return ToolCalls(self.checked_tools(), name, self.parallel_tool_calls is not False, self.json_options())

    def _guided_fields(self) -> list[str]:
        given = super()._guided_fields()
        if self.tool_mode()[0] == "none":
            return given
        # A forced call takes precedence over response_format for this turn, as in vLLM: the OpenAI
        # Agents SDK sends both when an agent has tools and an output type (its final answer is a
        # later turn's). Any other structured output beside a forced call is a conflict (a 400).
        return [name for name in given if name != "response_format"] + ["tool_choice"]

    def _json_output(self) -> bool:
        return super()._json_output() or self._guided_fields()[:1] == ["tool_choice"]

    def api_names(self, prompt_field: str) -> dict[str, str]:
        names = super().api_names(prompt_field)
        return {**names, "json_schema": "tools"} if names["json_schema"] == "tool_choice" else names

    def json_schema(self) -> Optional[dict]:
        calls = self.tool_calls()
        return calls.constraint() if calls is not None else super().json_schema()

    def template_args(self) -> dict:
        return _template_args(self)


def _check_template_options(body) -> None:
    """vLLM's chat template options, checked."""
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(400, "continue_final_message: it continues the last message, add_generation_prompt starts "
                           "a new one; give add_generation_prompt=false with it", "continue_final_message")
        if body.messages[-1].role != "assistant":
            raise APIError(400, f"continue_final_message: the last message must be the assistant's to continue, got "
                           f"role {body.messages[-1].role!r}", "continue_final_message")
    reserved = sorted(set(body.chat_template_kwargs or ()) & set(RESERVED))
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved} are given by the server, not the request",
                       "chat_template_kwargs")


def _template_args(body) -> dict:
    """What ``ChatTemplate.prompt`` takes of a body with messages."""
    checked_tools(body.tools)
    return {"messages": template_messages(body.messages), "tools": body.tools or None,
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message, "extra": body.chat_template_kwargs}


class TokenizeRequest(_Tolerant):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # as on chat: the prompt the chat endpoint would run
    tools: Optional[list[Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def template_args(self) -> dict:
        _check_template_options(self)
        return _template_args(self)


class DetokenizeRequest(_Tolerant):
    model: Optional[str] = None
    tokens: list[int]
