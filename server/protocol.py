"""The OpenAI API's request bodies (completions, chat completions, tokenize) as pydantic models,
and their translation into the runner's ``Request``s.

Every field is checked here or by ``Request``; a bad one is an ``APIError`` (HTTP 400) naming the
API's own field (``top_p``, not ``nucleus_p``). Fields of the OpenAI API this runner does not
implement (``best_of``, ``logit_bias``, penalties, ``response_format``, ``suffix``, ...) are
refused by name when set, never ignored; unknown fields are refused too.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from runner import Request
from runner.requests import MAX_LOGPROBS  # one limit for the API and the runner


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
              "request_id": "request_id", "logprobs": "logprobs", "prompt_logprobs": "logprobs"}
MAX_STOPS = 4


def bad_request(error: ValueError, prompt_field: str = "prompt") -> APIError:
    """A ``Request``/runner ``ValueError`` as a 400 naming the API's field."""
    message = str(error)
    match = re.match(r"Request\.(\w+)", message)
    param = _API_NAMES.get(match.group(1)) if match else None
    if param == "prompt":
        param = prompt_field
    if param is not None and match:
        message = param + message[match.end():]
    return APIError(400, message, param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extra; -1 or 0 = off
    n: int = Field(default=1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # not implemented: refused by name when set
    best_of: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    response_format: Optional[dict[str, Any]] = None

    def check_common(self) -> None:
        for name, default in (("best_of", (None, 1)), ("logit_bias", (None, {})), ("presence_penalty", (None, 0)),
                              ("frequency_penalty", (None, 0)), ("response_format", (None, {"type": "text"}))):
            if getattr(self, name) not in default:
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.stream_options is not None:
            if not self.stream:
                raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
            unknown = set(self.stream_options) - {"include_usage", "continuous_usage_stats"}
            if unknown:
                raise APIError(400, f"stream_options: unknown option(s) {sorted(unknown)}", "stream_options")
        stops = self.stops()
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop: up to {MAX_STOPS} non-empty strings, got {self.stop!r}", "stop")

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def requests(self, prompt, max_tokens: int, prompt_field: str, logprobs: Optional[int] = None,
                 prompt_logprobs: Optional[int] = None) -> list[Request]:
        """The ``n`` runner requests of one prompt (text or ids): choice i takes seed + i. Each
        computes ``logprobs`` alternatives per token (None: no log-probabilities) and scores the
        prompt with ``prompt_logprobs`` (the copies of a prompt share one prefill, and its scores)."""
        out = []
        for i in range(self.n):
            seed = None if self.seed is None else self.seed + i
            try:
                out.append(Request(prompt, temperature=self.temperature, nucleus_p=self.top_p,
                                   top_k=0 if self.top_k == -1 else self.top_k, rng_seed=seed,
                                   max_len=max_tokens, stop_token_ids=self.stop_token_ids or (),
                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs))
            except ValueError as e:
                raise bad_request(e, prompt_field) from None
        return out


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported by this server", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

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

    def check(self) -> None:
        self.check_common()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", "tools")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]
