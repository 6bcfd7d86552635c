"""A request's choices run and answered: the runner requests of a body submitted (``Flows._submit``),
each choice's events read as they come (``_events``: its text, tokens and finish, a failure its
own), and the answer made in the body's shape (``server/responses.py``, ``server/responses_api.py``):
whole once every choice has ended (``_run_all``), or streamed as server-sent events (``_stream``).
One flow for every endpoint: completions, chat completions and the Responses API differ only in
how a body becomes runner requests and in the shape of the answer. A client that leaves cancels
its requests.

``Flows`` is a part of ``server.app.Server``: it uses the server's runner, metrics and limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from runner import Request
from server.choices import SHUTDOWN, Choice, Sink, usage_of
from server.errors import APIError, bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import ChatShape, CompletionShape
from server.responses_api import ResponsesRequest, ResponsesShape

log = logging.getLogger("grok_runner.server")


class ClientGone(Exception):
    """The client closed its connection before its answer: nothing to send, one line to log."""


class Flows:
    """How ``server.app.Server`` runs a request's choices and answers them."""

    # ---- running choices -------------------------------------------------------------------------
    def _submit(self, requests: list[Request], names: dict[str, str], loop) -> list[Sink]:
        """Every request checked before any is submitted; then, if the load allows all of them,
        all submitted. Runs in a worker thread (a request may hold many prompts)."""
        for r in requests:
            try:
                self.runner.prepare(r)
            except ValueError as e:
                raise bad_request(e, names) from None
        sinks = []
        with self._admission:  # no other request admitted between this load check and these submissions
            self._check_load(len(requests))
            try:
                for r in requests:
                    sink = Sink(loop)
                    with self._inflight_lock:
                        self._inflight.add(sink)
                    self.runner.engine.submit(r, sink)
                    sinks.append(sink)
            except ValueError as e:
                for r in requests[: len(sinks)]:
                    self.runner.engine.cancel(r.request_id)
                with self._inflight_lock:
                    self._inflight.difference_update(sinks)
                raise bad_request(e, names) from None
        return sinks

    async def _events(self, choice: Choice, sink: Sink, top: int, arrived: float):
        """The text pieces of one choice as they come: all the events waiting at once make one
        piece (a decode call brings several tokens together; one chunk each would cost the HTTP
        path a JSON dump and a client parse per token). Cancels its request if the consumer
        stops early (a disconnect)."""
        request, last, counted = choice.request, None, 0
        try:
            while not choice.done:
                events = [await sink.queue.get()]
                while not sink.queue.empty():
                    events.append(sink.queue.get_nowait())
                now = time.perf_counter()
                piece = ""
                tokens = sum(1 for e in events if e is not SHUTDOWN and e.token_id is not None)
                for event in events:
                    if choice.done:
                        break
                    if event is SHUTDOWN:
                        raise APIError(503, "the server is shutting down: this request was ended before it "
                                       "finished", None, type="service_unavailable")
                    if event.token_id is not None:
                        if last is None:
                            self.metrics.ttft.observe(now - arrived)
                            if sink.admitted_at is not None:
                                self.metrics.queue.observe(max(0.0, sink.admitted_at - arrived))
                            last, tokens = now, tokens - 1
                        elif tokens:
                            # the tokens that arrive together (a decode call's) share the gap
                            # since the last ones: the histogram's sum is the time between
                            # tokens, its count the tokens
                            self.metrics.itl.observe((now - last) / tokens)
                    piece += choice.add(event, top)
                if last is not None:  # the next tokens' gap counts from these
                    last = now
                # counted as they reach the client, so the stats line's throughput is of each interval
                self.metrics.generation_tokens.inc(len(choice.tokens) - counted)
                counted = len(choice.tokens)
                yield piece
        finally:
            with self._inflight_lock:
                self._inflight.discard(sink)
            self.metrics.generation_tokens.inc(len(choice.tokens) - counted)
            if choice.speculation is not None:
                self.metrics.speculated(choice.speculation)
            if not choice.done or self.runner.engine.is_live(request.request_id):
                self.runner.engine.cancel(request.request_id)
            if choice.done:
                self.metrics.e2e.observe(time.perf_counter() - arrived)
            # error: it failed while being served; abort: the client left, or the server ended it
            self.metrics.finished(choice.finish_reason if choice.done else "error" if choice.failed else "abort")

    async def _run_all(self, choices, sinks, top, arrived, http: HTTPRequest):
        """Every choice to its end, for a whole (not streamed) response; if the client
        disconnects first, every choice's request is cancelled."""
        async def drain(choice, sink):
            async for _ in self._events(choice, sink, top, arrived):
                pass

        async def disconnect():  # the body is read: the next message is the client leaving
            while (await http.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(drain(c, s)) for c, s in zip(choices, sinks)]
        watch = asyncio.ensure_future(disconnect())
        try:
            pending = set(tasks)
            while pending:
                done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
                if watch in done:
                    self._log_gone(http, len(choices))
                    raise ClientGone()
                for t in done:
                    t.result()  # a choice that failed fails the response
        finally:
            for t in (*tasks, watch):
                t.cancel()  # a task's cancellation cancels its runner request (_events)

    @staticmethod
    def _log_gone(http: HTTPRequest, requests: int) -> None:
        client = "%s:%d" % http.client if http.client else "a client"
        log.info("%s disconnected before its answer to %s; %d request(s) cancelled", client, http.url.path, requests)

    async def _stream(self, choices, sinks, top, arrived, chunk, usage, http: HTTPRequest,
                      frame: Callable[[dict], str] = lambda item: f"data: {json.dumps(item)}\n\n",
                      done: str = "data: [DONE]\n\n"):
        """SSE: every choice's pieces as ``chunk(choice, piece, first)`` dicts (or lists of them),
        then the usage chunk (when asked) and ``done``, each dict as ``frame`` writes it (the chat
        API's ``data:`` lines; the Responses API's named events). A disconnect cancels every
        choice's request."""
        out: asyncio.Queue = asyncio.Queue()

        async def pump(choice, sink):
            first = True
            try:
                async for piece in self._events(choice, sink, top, arrived):
                    if piece or choice.done or first:
                        made = chunk(choice, piece, first)
                        for item in made if isinstance(made, list) else [made]:
                            await out.put(item)
                        first = False
            except APIError as e:
                await out.put({"error": e.body()["error"]})
            finally:
                await out.put(None)

        tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(choices, sinks)]

        async def body():
            open_, complete = len(tasks), False
            try:
                while open_:
                    item = await out.get()
                    if item is None:
                        open_ -= 1
                        continue
                    yield frame(item)
                if usage is not None:
                    made = usage()
                    for item in made if isinstance(made, list) else [made]:
                        yield frame(item)
                if done:
                    yield done
                complete = True
            finally:  # the client went away (or we are done): no request outlives its response
                if not complete and any(not t.done() for t in tasks):
                    self._log_gone(http, len(tasks))
                for t in tasks:
                    t.cancel()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _stream_done(chunks: list[dict], usage) -> StreamingResponse:
        """SSE of a response computed whole: its chunks, the usage chunk (when asked), ``[DONE]``."""
        lines = [f"data: {json.dumps(c)}\n\n" for c in chunks + ([usage()] if usage is not None else [])]
        return StreamingResponse(iter(lines + ["data: [DONE]\n\n"]), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _prepare(self, prompts: list, make_runs, names: dict[str, str]) -> tuple[list[list[int]], list[Request]]:
        """In a worker thread: each prompt tokenized once and checked, and the runner requests of
        every choice (made from the ids, so nothing tokenizes them again)."""
        ids = [self._prompt_ids(p, names) for p in prompts]
        return ids, [r for i in ids for r in make_runs(i)]

    # ---- completions ---------------------------------------------------------------------------------
    async def _completions(self, body: CompletionRequest, http: HTTPRequest, arrived: float, turn):
        body.check()
        prompts = body.prompts()
        self._check_capacity(len(prompts) * body.n, "n" if body.n > 1 and len(prompts) == 1 else "prompt")
        # max_tokens 0 (with echo): the prompt alone; scored by a one-token request whose token is dropped
        echo_only = body.max_tokens == 0
        max_tokens = 1 if echo_only else body.max_tokens or 16
        # echo with logprobs: each prompt token scored as part of its request's prefill
        echo_logprobs = body.echo and body.logprobs is not None
        scored = body.logprobs if echo_logprobs else None
        names = body.api_names("prompt")
        ids, runs = await asyncio.to_thread(
            self._prepare, prompts, lambda i: body.requests(i, max_tokens, "prompt", body.logprobs, scored), names)
        turn.release()  # the body is ids now
        if echo_logprobs:
            self._check_scored(ids)
        if echo_only and not echo_logprobs:
            runs = []  # nothing to compute
        choices, sinks = await self._start(runs, names, sum(len(i) for i in ids), len(prompts) * body.n)
        prompt_text = [p if isinstance(p, str) else self.runner.tokenizer.decode(p) for p in prompts]
        shape = CompletionShape(body, self.model_name, self.runner.tokenizer, prompt_text,
                                lambda: usage_of(sum(len(i) for i in ids), choices, body.n), echo_logprobs)
        if not echo_only:
            return await self._answer(body, shape, choices, sinks, body.logprobs or 0, arrived, http)
        http.state.request_id = shape.id  # for the access log
        await self._run_all(choices, sinks, body.logprobs or 0, arrived, http)
        for c in choices:  # the scoring request's token is not part of the answer
            c.text, c.tokens, c.logprobs, c.tops, c.offsets, c.finish_reason = "", [], [], [], [], "length"
        if body.stream:
            return self._stream_done([shape.chunk(c, "", True) for c in choices],
                                     shape.final if body.include_usage() else None)
        return shape.response(choices)

    async def _start(self, runs: list[Request], names: dict[str, str], prompt_tokens: int, count: int):
        """Submit ``runs`` (one a choice) and count their prompt tokens; the choices (``count`` empty
        ones where nothing runs: an echo of prompts alone) and their sinks."""
        sinks = await asyncio.to_thread(self._submit, runs, names, asyncio.get_running_loop())
        self.metrics.prompt_tokens.inc(prompt_tokens)
        choices = ([Choice(k, r, names) for k, r in enumerate(runs)] if runs else
                   [Choice(k, None, names) for k in range(count)])
        return choices, sinks

    async def _answer(self, body, shape, choices, sinks, top: int, arrived: float, http: HTTPRequest):
        """The answer of either endpoint in its ``shape`` (``server/responses.py``): streamed as SSE
        chunks (with the usage chunk when asked), or whole once every choice has ended."""
        http.state.request_id = shape.id  # for the access log
        if body.stream:
            final = shape.final if body.include_usage() or getattr(shape, "final_always", False) else None
            framing = {"frame": shape.frame, "done": shape.done} if hasattr(shape, "frame") else {}
            return await self._stream(choices, sinks, top, arrived, shape.chunk, final, http, **framing)
        await self._run_all(choices, sinks, top, arrived, http)
        return shape.response(choices)

    def _check_scored(self, prompts: list[list[int]]) -> None:
        """Echo with logprobs scores at most ``max_scored_tokens`` prompt tokens a request."""
        total = sum(len(i) for i in prompts)
        if self.max_scored_tokens == 0:
            raise APIError(400, "echo: this server does not score prompts (started with --max-scored-tokens 0): "
                           "echo with logprobs is off", "echo")
        if total > self.max_scored_tokens:
            raise APIError(400, f"echo: with logprobs, a request may have at most {self.max_scored_tokens} prompt "
                           f"tokens scored (--max-scored-tokens), got {total}", "echo")

    # ---- chat ----------------------------------------------------------------------------------------
    async def _chat(self, body: ChatCompletionRequest, http: HTTPRequest, arrived: float, turn,
                    shape_of=None):
        """A chat completion, answered in ``ChatShape`` (or ``shape_of(usage)``'s shape: the
        Responses API's)."""
        body.check()
        self._check_capacity(body.n, "n")
        prompt = await asyncio.to_thread(self._render, body)

        def make_runs(ids):
            max_tokens = body.max_completion_tokens or body.max_tokens or max(
                1, self.runner.config.sequence_len - len(ids))
            return body.requests(ids, max_tokens, "messages", (body.top_logprobs or 0) if body.logprobs else None)

        names = body.api_names("messages")
        (ids,), runs = await asyncio.to_thread(self._prepare, [prompt], make_runs, names)
        turn.release()  # the body is ids now
        choices, sinks = await self._start(runs, names, len(ids), body.n)
        usage = lambda: usage_of(len(ids), choices, body.n)  # noqa: E731
        shape = (ChatShape(body, self.model_name, self.runner.tokenizer, usage) if shape_of is None
                 else shape_of(usage))
        return await self._answer(body, shape, choices, sinks, body.top_logprobs or 0, arrived, http)

    # ---- the Responses API ---------------------------------------------------------------------------
    async def _responses(self, request: ResponsesRequest, http: HTTPRequest, arrived: float, turn):
        """A Responses API request, served as the chat completion it asks for (``server.responses_api``)."""
        try:
            body = request.chat()
            return await self._chat(body, http, arrived, turn,
                                    shape_of=lambda usage: ResponsesShape(request, body, self.model_name, usage))
        except APIError as e:
            raise ResponsesRequest.renamed(e) from None
