"""OpenAI's Responses API (``POST /v1/responses``) on the chat engine.

A Responses body is read as the chat completion it asks for (``ResponsesRequest.chat``): its
``input`` (a string, or a list of messages and of the function calls and their outputs a
conversation holds) and ``instructions`` become the messages, ``text.format`` the
``response_format``, its function ``tools`` and ``tool_choice`` the chat's own; so the chat's
checks, chat template, structured output and forced tool calls serve it unchanged, and an error
names the Responses field (``ResponsesRequest.renamed``). ``ResponsesShape`` answers in the
Responses objects: a ``response`` whose ``output`` holds a ``message`` (its ``output_text``) or
the ``function_call`` items of a forced call, with ``status`` ``completed`` or ``incomplete``
(``max_output_tokens``); streamed, as the Responses events (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), each with its ``sequence_number``.

Nothing is stored: ``store: true``, ``previous_response_id`` and ``conversation`` are 400s naming
them, as is every other field asking for what this server does not do (``reasoning``,
``background``, tools other than functions, non-text inputs ...).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Callable, Optional, Union

from pydantic import Field, ValidationError

from server.errors import APIError, short
from server.protocol import ChatCompletionRequest, _Tolerant

# Fields that ask for nothing only with these values: name -> (the values, what it would ask for)
_REFUSED = {
    "store": ((False,), "store=true (nothing is stored: give store=false)"),
    "previous_response_id": ((), "a previous response (nothing is stored: send the conversation as input)"),
    "conversation": ((), "a stored conversation (nothing is stored: send it as input)"),
    "background": ((False,), "a background response"),
    "reasoning": (({},), "reasoning options (this model does not reason apart from its output)"),
    "prompt": ((), "a stored prompt template"),
    "max_tool_calls": ((), "a limit on built-in tool calls"),
    "top_logprobs": ((0,), "log-probabilities on the Responses API (use /v1/chat/completions)"),
    "truncation": (("disabled",), "truncation of the input"),
    "service_tier": (("auto", "default"), "a service tier"),
    "include": (([],), "extra output to include"),
}
# Chat field -> the Responses field it came from (for the errors the chat's checks raise)
_FIELDS = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("messages", "input"))


class ResponsesRequest(_Tolerant):
    model: str
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    seed: Optional[int] = None  # vLLM's extra, as on chat
    # informative only: echoed back
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    def check(self) -> None:
        """A 400 naming each field this server does not do, before anything runs."""
        for name, (allowed, what) in _REFUSED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in allowed:
                raise APIError(400, f"{name}: {what} is not supported by this server, got {short(value)}", name)
        unknown = set(self.stream_options or ()) - {"include_obfuscation"}
        if unknown:
            raise APIError(400, f"stream_options: unknown option(s) {sorted(unknown)}", "stream_options")
        self.log_unknown()

    # ---- the chat completion it asks for -----------------------------------------------------------
    def chat(self) -> ChatCompletionRequest:
        """This body as the chat completion request the chat endpoint serves (checked there)."""
        self.check()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + self._messages()
        if not messages:
            raise APIError(400, "input: give at least one message", "input")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                "top_p": self.top_p, "stream": self.stream}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("seed", self.seed),
                            ("parallel_tool_calls", self.parallel_tool_calls), ("response_format", self._format()),
                            ("tools", self._tools()), ("tool_choice", self._tool_choice())):
            if value is not None:
                body[name] = value
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "input"
            raise self.renamed(APIError(400, f"{field}: {first['msg']}", field)) from None

    def _messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for i, item in enumerate(self.input):
            field = f"input[{i}]"
            if not isinstance(item, dict):
                raise APIError(400, f"{field}: expected a message or a function call item, got {short(item)}", field)
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item.get("role"), "content": _text(item.get("content"), field)})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", field), "type": "function",
                        "function": {"name": _string(item, "name", field),
                                     "arguments": _string(item, "arguments", field)}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                    out[-1]["tool_calls"].append(call)  # the calls of one turn: one assistant message
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", field),
                            "content": output if isinstance(output, str) else _text(output, f"{field}.output")})
            else:
                raise APIError(400, f"{field}.type: only 'message', 'function_call' and 'function_call_output' "
                               f"items are supported, got {short(kind)}", f"{field}.type")
        return out

    def _format(self) -> Optional[dict]:
        if self.text is None:
            return None
        unknown = set(self.text) - {"format", "verbosity"}
        if unknown:
            raise APIError(400, f"text: unknown option(s) {sorted(unknown)}", "text")
        if self.text.get("verbosity") not in (None, "medium"):
            raise APIError(400, f"text.verbosity: {short(self.text['verbosity'])} is not supported by this server "
                           "(the model has one verbosity)", "text.verbosity")
        spec = self.text.get("format")
        if spec is None or spec == {"type": "text"}:
            return None
        if not isinstance(spec, dict) or spec.get("type") not in ("json_object", "json_schema"):
            raise APIError(400, f"text.format: expected type 'text', 'json_object' or 'json_schema', got "
                           f"{short(spec)}", "text.format")
        if spec["type"] == "json_object":
            return {"type": "json_object"}
        if not isinstance(spec.get("schema"), dict):
            raise APIError(400, "text.format: json_schema needs {\"type\": \"json_schema\", \"name\": ..., \"schema\": "
                           "{...}}", "text.format")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"), "schema": spec["schema"],
                                                       "strict": spec.get("strict")}}

    def _tools(self) -> Optional[list]:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise APIError(400, f"tools[{i}].type: only 'function' tools are supported, got {short(kind)}",
                               f"tools[{i}].type")
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def _tool_choice(self):
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    @staticmethod
    def renamed(e: APIError) -> APIError:
        """A chat error as the Responses request's: the fields it names are this body's."""
        def rename(text: Optional[str]) -> Optional[str]:
            if text is None:
                return None
            text = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", text)
            for chat, responses in _FIELDS:
                text = re.sub(rf"\b{chat}\b", responses, text)
            return text

        return APIError(e.status, rename(e.message), rename(e.param), e.type, e.code, e.headers)


def _text(content, field: str) -> str:
    """A message's content: text, or its ``input_text``/``output_text`` parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{field}.content: expected text or a list of input_text parts, got {short(content)}",
                       f"{field}.content")
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(400, f"{field}.content[{j}]: only text parts are supported, got {short(kind)}",
                           f"{field}.content[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict, key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{field}.{key}: expected a string, got {short(value)}", f"{field}.{key}")
    return value


class ResponsesShape:
    """``response`` objects and, streamed, the Responses events, from the chat flow's one choice
    (the calls of ``server.choices.Choice``, as ``server.responses.ChatShape``'s)."""

    final_always = True  # a stream ends with response.completed (its usage), asked or not

    def __init__(self, request: ResponsesRequest, body: ChatCompletionRequest, model: str,
                 usage: Callable[[], dict]):
        self.request, self.body, self.model, self.usage = request, body, model, usage
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.tools = body.tool_calls()
        self.reader = self.tools.reader() if self.tools is not None else None
        self.items: list[dict] = []  # the output items, as streamed so far
        self.sequence = 0
        self.choice = None

    # ---- objects --------------------------------------------------------------------------------
    def _response(self, status: str, output: list[dict], choice=None) -> dict:
        r = self.request
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if choice.finish_reason == "length" else "content_filter"}
        usage = None
        if status != "in_progress":
            u = self.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "incomplete_details": incomplete, "error": None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "tools": r.tools or [],
                "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "text": r.text or {"format": {"type": "text"}}, "metadata": r.metadata or {}, "user": r.user,
                "previous_response_id": None, "store": False, "truncation": "disabled", "reasoning": None,
                "usage": usage}

    def _status(self, choice, reader=None) -> str:
        """``completed``, or ``incomplete`` where a limit cut the output (a forced call's too)."""
        if choice.finish_reason == "stop" and (reader is None or reader.complete):
            return "completed"
        return "incomplete"

    @staticmethod
    def _message(text: str, status: str, item_id: str) -> dict:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _call(self, k: int, name: str, arguments: str, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{self.id[5:21]}{k}", "call_id": f"call_{self.id[5:21]}{k}",
                "name": name, "arguments": arguments, "status": status}

    def response(self, choices) -> dict:
        [choice] = choices
        reader = None if self.tools is None else self.tools.reader()
        if reader is not None:
            reader.feed(choice.text)
        status = self._status(choice, reader)
        item_status = "completed" if status == "completed" else "incomplete"
        if reader is None:
            output = [self._message(choice.text, item_status, f"msg_{self.id[5:]}")]
        else:
            last = len(reader.calls) - 1  # where a limit cut the output, its last call alone is cut
            output = [self._call(k, name, args, "completed" if k < last else item_status)
                      for k, (name, args) in enumerate(reader.calls)]
        return self._response(status, output, choice)

    # ---- events ---------------------------------------------------------------------------------
    def frame(self, event: dict) -> str:
        """One server-sent event: its type as the event's name, its sequence number set."""
        if "type" not in event and "error" in event:  # a choice that failed while streaming
            event = {"type": "error", **event["error"]}
        event = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    done = ""  # no [DONE]: response.completed ends the stream

    def chunk(self, choice, piece: str, first: bool) -> list[dict]:
        self.choice = choice
        events = []
        if first:
            events += [{"type": "response.created", "response": self._response("in_progress", [])},
                       {"type": "response.in_progress", "response": self._response("in_progress", [])}]
            if self.tools is None:
                item = self._message("", "in_progress", f"msg_{self.id[5:]}")
                item["content"] = []
                events += self._open(item)
                events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": 0,
                               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        if self.tools is None:
            if piece:
                item = self.items[0]
                item["text"] = item.get("text", "") + piece
                events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                               "content_index": 0, "delta": piece, "logprobs": []})
        else:
            for k, name, arguments in self.reader.feed(piece):
                if name is not None:
                    events += self._close_call()
                    events += self._open(self._call(k, name, "", "in_progress"))
                if arguments:
                    item = self.items[k]
                    item["arguments"] += arguments
                    events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                   "output_index": k, "delta": arguments})
        return events

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _close_call(self, status: str = "completed") -> list[dict]:
        """The last function call item's end, if one is open."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        k, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": k,
                 "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": k, "item": dict(item)}]

    def final(self) -> list[dict]:
        """The events that end a stream: the open items closed, then the whole response."""
        choice = self.choice
        status = self._status(choice, self.reader)
        item_status = "completed" if status == "completed" else "incomplete"
        events = []
        if self.tools is None:
            item = self.items[0]
            text = item.pop("text", "")
            message = self._message(text, item_status, item["id"])
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": 0,
                        "content_index": 0, "text": text, "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": 0,
                        "content_index": 0, "part": message["content"][0]},
                       {"type": "response.output_item.done", "output_index": 0, "item": message}]
            output = [message]
        else:
            events += self._close_call(item_status)
            output = [dict(item) for item in self.items]
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [{"type": kind, "response": self._response(status, output, choice)}]
