"""One response's choices as the server collects them: a ``Sink`` per runner request (its events,
handed from the engine's thread to the event loop) and a ``Choice`` (its text so far, tokens,
logprobs and finish reason), and the usage block of a response's choices.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import numpy as np

from runner import Request
from runner.requests import Speculation
from server.errors import APIError, bad_request

SHUTDOWN = object()  # put in a sink when the server ends the requests still in flight


class Sink:
    """Events of one runner request, handed from the engine's thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.admitted_at: Optional[float] = None

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def admitted(self) -> None:
        self.admitted_at = time.perf_counter()


class Choice:
    """One choice of a response: its text so far, logprobs, finish reason (the runner applies its
    stop strings: ``Request.stop``)."""

    def __init__(self, index: int, request: Request, names: dict[str, str]):
        self.index, self.request, self.names = index, request, names  # names: see protocol.bad_request
        # per kept token: id, log-probability, alternatives, offset of its text in the output (the
        # detokenizer's: a character split over byte pieces belongs to its last piece)
        self.text, self.tokens, self.logprobs, self.tops, self.offsets = "", [], [], [], []
        self.prompt_logprobs = None  # its prompt's PromptLogprobs, if its request scored it
        self.cached_tokens = 0  # its prompt's tokens read from the prefix cache
        self.speculation = None  # its request's Speculation, on its last event if it speculated
        self.finish_reason: Optional[str] = None
        self.failed = False  # it ended with an error of its own

    def add(self, event, top: int) -> str:
        """The new text this event releases; records its token (unless a stop string took all of
        its text: the stop string is not part of the output)."""
        piece = event.text
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        if event.speculation is not None:
            self.speculation = event.speculation
        if event.token_id is not None and not (event.stop_reason is not None and not piece):
            self.offsets.append(len(self.text))
            self.tokens.append(event.token_id)
            self.logprobs.append(event.logprob)
            self.tops.append([(t, float(np.log(max(p, 1e-45)))) for t, p in event.top_tokens[:top]])
        if event.finish_reason and self.finish_reason is None:
            if event.finish_reason == "error":
                self.failed = True
                if event.error_field is not None:  # its own input's fault (a schema the engine gave up on)
                    raise bad_request(ValueError(event.error), self.names)
                # a 500 the openai clients do not retry (they honour x-should-retry): the same
                # request would fail the same way, and a retry would cost the server it again
                raise APIError(500, f"the request failed while being served: {event.error}", None,
                               type="server_error", headers={"x-should-retry": "false"})
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
        self.text += piece
        return piece

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def usage_of(prompt_tokens: int, choices: list[Choice], n: int) -> dict:
    """OpenAI's usage block of a response whose choices come ``n`` per prompt: with the prompt
    tokens read from the prefix cache (``prompt_tokens_details.cached_tokens``), each prompt's
    counted once (its copies share one prefill)."""
    completion = sum(len(c.tokens) for c in choices)
    cached = sum(max(c.cached_tokens for c in choices[i: i + n]) for i in range(0, len(choices), n))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    speculated = [c.speculation for c in choices if c.speculation is not None]
    if speculated:  # ours: the choices' speculative decoding, summed (known once they ended)
        total = Speculation(*(sum(getattr(s, f) for s in speculated) for f in ("steps", "tokens", "drafted", "accepted")))
        usage["speculative_decoding"] = {
            "decode_steps": total.steps, "decode_tokens": total.tokens, "draft_tokens": total.drafted,
            "accepted_tokens": total.accepted, "acceptance_rate": round(total.acceptance_rate, 4),
            "tokens_per_step": round(total.tokens_per_step, 4)}
    return usage
