"""Errors in OpenAI's shape: ``APIError`` (an HTTP status and ``{"error": {"message", "type",
"param", "code"}}``), a runner ``ValueError`` as the 400 naming the API's own field
(``bad_request``), and a value as a message quotes it (``short``)."""

from __future__ import annotations

import json
import re
from typing import Optional


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


def short(value, limit: int = 200) -> str:
    """A value as a message quotes it, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
