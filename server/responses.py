"""The two response shapes of the OpenAI API, built from a request's choices: text completions and
chat completions, each whole or as server-sent-event chunks.

A shape is an object with three methods the server calls the same way for both endpoints
(``Server._answer``): ``chunk(choice, piece, first)`` (one SSE chunk of a choice), ``final()``
(the usage chunk that ends a stream) and ``response(choices)`` (the whole answer). It only formats:
the choices (``server.choices.Choice``) already hold each one's text, tokens, logprobs and finish
reason, and the usage comes from ``usage()``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Callable

import numpy as np

from tokenization import Tokenizer


class CompletionShape:
    """``text_completion`` objects: ``echo`` puts each prompt's text before its choices' (and with
    ``logprobs``, its tokens' scores before theirs); ``logprobs`` is OpenAI's legacy block
    (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, body, model: str, tokenizer: Tokenizer, prompt_text: list[str], usage: Callable[[], dict],
                 echo_logprobs: bool):
        self.body, self.model, self.tokenizer, self.usage = body, model, tokenizer, usage
        self.prompt_text, self.echo_logprobs = prompt_text, echo_logprobs
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.sent: dict[int, int] = {}  # tokens of each choice already streamed

    def _object(self, choices: list[dict], **more) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **more}

    def echoed(self, choice) -> str:
        return self.prompt_text[choice.index // self.body.n] if self.body.echo else ""

    def logprobs(self, choice, start_token: int = 0, start_text: int = 0):
        if self.body.logprobs is None:
            return None
        name = self.tokenizer.token_name
        return {"tokens": [name(t) for t in choice.tokens[start_token:]],
                "token_logprobs": choice.logprobs[start_token:],
                "top_logprobs": [{name(t): lp for t, lp in top} for top in choice.tops[start_token:]],
                "text_offset": [start_text + o for o in choice.offsets[start_token:]]}

    def with_prompt(self, choice, lp: dict) -> dict:
        """``lp`` (the generated tokens' logprobs, offsets past the echoed prompt) after the
        prompt's own: its tokens, each one's log-probability given those before it (the first has
        none) and its alternatives."""
        entries = choice.prompt_logprobs or ()
        name = self.tokenizer.token_name
        texts = [name(e.token_id) for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=0)) if texts else []
        tops = [None if e.logprob is None else {name(t): float(np.log(max(p, 1e-45))) for t, p in e.top_tokens}
                for e in entries]
        return {"tokens": texts + lp["tokens"], "token_logprobs": [e.logprob for e in entries] + lp["token_logprobs"],
                "top_logprobs": tops + lp["top_logprobs"], "text_offset": offsets + lp["text_offset"]}

    def _choice_logprobs(self, choice, start: int = 0):
        lp = self.logprobs(choice, start, len(self.echoed(choice)))
        return self.with_prompt(choice, lp) if self.echo_logprobs and start == 0 else lp

    def chunk(self, choice, piece: str, first: bool) -> dict:
        start = self.sent.get(choice.index, 0)
        self.sent[choice.index] = len(choice.tokens)
        text = (self.echoed(choice) if first else "") + piece
        lp = self.logprobs(choice, start, len(self.echoed(choice)))
        if first and self.echo_logprobs:
            lp = self.with_prompt(choice, lp)
        out = self._object([{"index": choice.index, "text": text, "logprobs": lp,
                             "finish_reason": choice.finish_reason}])
        return {**out, "usage": self.usage()} if self.body.continuous_usage() else out

    def final(self) -> dict:
        return self._object([], usage=self.usage())

    def response(self, choices) -> dict:
        return self._object([{"index": c.index, "text": self.echoed(c) + c.text, "logprobs": self._choice_logprobs(c),
                              "finish_reason": c.finish_reason} for c in choices], usage=self.usage())


class ChatShape:
    """``chat.completion`` objects (``chat.completion.chunk`` streamed): the assistant's message,
    and with ``logprobs`` each token's name, log-probability, bytes and alternatives.

    A forced tool call (``body.tool_calls()``, ``server.tools.ToolCalls``) is answered as
    OpenAI answers one: ``content`` null, ``tool_calls`` (each with an id of its own, its function's
    name and its arguments as JSON text), finish reason "tool_calls" once every call is complete
    ("length" or "stop" where a limit or a stop string cut it: its arguments as far as they got).
    Streamed, a call's first delta has its ``index``, ``id``, ``type`` and name, the later ones
    fragments of its arguments, which join to the whole response's."""

    def __init__(self, body, model: str, tokenizer: Tokenizer, usage: Callable[[], dict]):
        self.body, self.model, self.tokenizer, self.usage = body, model, tokenizer, usage
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.sent: dict[int, int] = {}
        self.tools = body.tool_calls()
        self.readers: dict[int, object] = {}  # choice -> its CallReader, streamed
        self.call_ids: dict[tuple[int, int], str] = {}  # (choice, call) -> the call's id

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.tokenizer.token_name(token), "logprob": logprob,
                "bytes": self.tokenizer.token_bytes(token)}

    def logprobs(self, choice, start: int = 0):
        if not self.body.logprobs:
            return None
        return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in tops]}
                            for t, lp, tops in zip(choice.tokens[start:], choice.logprobs[start:],
                                                   choice.tops[start:])]}

    def _call_id(self, choice: int, call: int) -> str:
        return self.call_ids.setdefault((choice, call), f"call_{uuid.uuid4().hex[:24]}")

    def _finish_reason(self, choice, reader) -> str | None:
        if self.tools is not None and choice.finish_reason == "stop" and reader.complete:
            return "tool_calls"
        return choice.finish_reason

    def _tool_deltas(self, choice, piece: str) -> list[dict]:
        """The streamed entries of ``tool_calls`` for ``piece``: a call's first with its id, type
        and name, then its arguments as they come."""
        reader = self.readers.setdefault(choice.index, self.tools.reader())
        out = []
        for call, name, arguments in reader.feed(piece):
            entry = {"index": call}
            if name is not None:
                entry.update(id=self._call_id(choice.index, call), type="function")
            entry["function"] = {"name": name, "arguments": arguments} if name is not None else {"arguments": arguments}
            out.append(entry)
        return out

    def chunk(self, choice, piece: str, first: bool) -> dict:
        start = self.sent.get(choice.index, 0)
        self.sent[choice.index] = len(choice.tokens)
        finish_reason = choice.finish_reason
        if self.tools is None:
            delta = {"role": "assistant", "content": piece} if first else {"content": piece}
            if choice.done and not piece and not first:
                delta = {}
        else:
            calls = self._tool_deltas(choice, piece)
            delta = {"role": "assistant", "content": None} if first else {}
            if calls:
                delta["tool_calls"] = calls
            finish_reason = self._finish_reason(choice, self.readers[choice.index])
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [{"index": choice.index, "delta": delta, "logprobs": self.logprobs(choice, start),
                            "finish_reason": finish_reason}]}
        return {**out, "usage": self.usage()} if self.body.continuous_usage() else out

    def final(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    def _choice(self, c) -> dict:
        if self.tools is None:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c), "finish_reason": c.finish_reason}
        reader = self.tools.reader()
        reader.feed(c.text)
        calls = [{"id": self._call_id(c.index, k), "type": "function", "function": {"name": name, "arguments": args}}
                 for k, (name, args) in enumerate(reader.calls)]
        message = {"role": "assistant", "content": None, **({"tool_calls": calls} if calls else {})}
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c),
                "finish_reason": self._finish_reason(c, reader)}

    def response(self, choices) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice(c) for c in choices], "usage": self.usage()}
