"""The OpenAI API's request bodies (completions, chat completions, tokenize) as pydantic models,
and their translation into the runner's ``Request``s.

Tolerant where vLLM is, never silently wrong:
- a field this server does not know is accepted and logged once per name (vLLM's rule: clients
  send their own extras, and a 400 for each would break them);
- structured output (``response_format`` json_object or json_schema, vLLM's ``guided_json`` and
  ``structured_outputs``) becomes the request's ``json_schema``, which the runner compiles;
- a known field whose meaning is not implemented (``best_of`` > 1, ``logit_bias``, ``suffix``,
  ``tools``, ``service_tier`` "flex", ``store`` true, ...) is a 400 naming it when it asks for
  something, never accepted and ignored;
- a null means the field's default (clients send ``"temperature": null`` for "default").
Every other field is checked here or by ``Request``; a bad one is an ``APIError`` (HTTP 400)
naming the API's own field (``top_p``, not ``nucleus_p``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runner import Request
from runner.requests import MAX_LOGPROBS, MAX_STOP_STRINGS  # one limit for the API and the runner

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
    # structured output: OpenAI's response_format, and vLLM's guided_json and structured_outputs
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    structured_outputs: Optional[dict[str, Any]] = None

    def check_common(self) -> None:
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
        self.json_schema()  # checked now, before anything runs
        stops = self.stops()
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop: up to {MAX_STOPS} non-empty strings, got {self.stop!r}", "stop")

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _schema_fields(self) -> list[str]:
        """The fields this body gives a structured output in (one, unless the body is refused)."""
        return [name for name in ("response_format", "guided_json", "structured_outputs")
                if getattr(self, name) not in (None, {"type": "text"})]

    def schema_field(self) -> str:
        """The field this body gave its structured output in (``response_format`` if none)."""
        return next(iter(self._schema_fields()), "response_format")

    def api_names(self, prompt_field: str) -> dict[str, str]:
        """``Request`` fields -> the names this body sent them under (for ``bad_request``)."""
        return {"prompt": prompt_field, "json_schema": self.schema_field()}

    def json_schema(self) -> Optional[dict]:
        """The schema a structured output must satisfy (``{"type": "object"}`` for any object), from
        ``response_format`` or vLLM's ``guided_json`` / ``structured_outputs``; None: free text."""
        given = self._schema_fields()
        if len(given) > 1:
            raise APIError(400, f"{given[1]}: give one of response_format, guided_json and structured_outputs, "
                           f"got {given}", given[1])
        if not given:
            return None
        name, value = given[0], getattr(self, given[0])
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
                                   skip_special_tokens=self.skip_special_tokens, json_schema=self.json_schema(),
                                   speculative=self.speculative))
            except ValueError as e:
                raise bad_request(e, self.api_names(prompt_field)) from None
        return out


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
    return value


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: not used by the template

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

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


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None  # asks nothing without tools

    def check(self) -> None:
        self.check_common()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", "tools")
        if self.tool_choice not in (None, "none", "auto"):  # without tools, "auto" is "none"
            raise APIError(400, f"tool_choice {self.tool_choice!r}: tools are not supported by this server "
                           "(only 'none' or 'auto')", "tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")


class TokenizeRequest(_Tolerant):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None


class DetokenizeRequest(_Tolerant):
    model: Optional[str] = None
    tokens: list[int]
