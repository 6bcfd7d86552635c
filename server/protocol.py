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

What the bodies' structured-output fields do is ``server/structured.py``'s, their tools
``server/tools.py``'s; errors are ``server/errors.py``'s.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from runner import Request
from runner.requests import MAX_LOGPROBS, MAX_STOP_STRINGS  # one limit for the API and the runner
from server.chat import RESERVED
from server.errors import APIError, bad_request, short
from server.structured import StructuredOutput
from server.tools import ToolCalls, checked_tools, past_call

log = logging.getLogger("grok_runner.server")
MAX_STOPS = MAX_STOP_STRINGS  # OpenAI's limit


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
class _Body(StructuredOutput, _Tolerant):
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
    # structured output (one of them: GUIDED): OpenAI's response_format, and vLLM's guided_* and
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
                               f"{short(value)}", name)
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
            made = [past_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
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
                           f"\"function\": {{\"name\": ...}}}}, got {short(choice)}", "tool_choice")
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
