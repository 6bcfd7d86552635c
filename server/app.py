"""The OpenAI-compatible HTTP server: a client of the runner's engine core like any other.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent
events when asked), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, vLLM's
names), ``POST /tokenize``, ``POST /detokenize``. The engine core runs its rounds in a background
thread; each HTTP request submits its runner requests with a sink that hands the events to the
event loop, so no handler ever blocks the loop on the device. Errors take OpenAI's shape: 400
naming the field for any bad parameter (the same checks as ``Request``), 401 without the API key,
404 for another model, 413 for a body over ``max_body_bytes``, 503 with ``Retry-After`` when more
than ``max_waiting`` requests wait for a slot. A client that disconnects mid-stream cancels its
requests: their slots are free at the next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Optional

import numpy as np
import pydantic
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runner import InferenceRunner, Request
from server.chat import ChatTemplate
from server.metrics import Metrics
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             TokenizeRequest, bad_request)
from server.stops import StopMatcher

log = logging.getLogger("grok_runner.server")


class _Sink:
    """Events of one runner request, handed from the core's thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.admitted_at: Optional[float] = None

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def admitted(self) -> None:
        self.admitted_at = time.perf_counter()


class _Choice:
    """One choice of a response: its text so far, stop-string matching, logprobs, finish reason."""

    def __init__(self, index: int, request: Request, stops: list[str]):
        self.index, self.request = index, request
        self.matcher = StopMatcher(stops) if stops else None
        # per kept token: id, its text in the output (the detokenizer's delta: a character split
        # over byte pieces belongs to its last piece), log-probability, alternatives, text offset
        self.text, self.tokens, self.strs, self.logprobs, self.tops, self.offsets = "", [], [], [], [], []
        self.finish_reason: Optional[str] = None

    def add(self, event, top: int) -> str:
        """The new text this event releases (stop strings applied); records its token."""
        piece = event.text
        if self.matcher is not None:
            piece = self.matcher.feed(piece)
            if self.matcher.stopped:
                self.finish_reason = "stop"
        if event.token_id is not None and not (self.matcher is not None and self.matcher.stopped and not piece):
            self.offsets.append(len(self.text))
            self.tokens.append(event.token_id)
            self.strs.append(event.text)
            self.logprobs.append(event.logprob)
            self.tops.append([(t, float(np.log(max(p, 1e-45)))) for t, p in event.top_tokens[:top]])
        if event.finish_reason and self.finish_reason is None:
            if event.finish_reason == "error":
                raise APIError(500, f"the request failed while being served: {event.error}", None,
                               type="server_error")
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
            if self.matcher is not None:
                piece += self.matcher.flush()
        self.text += piece
        return piece

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Server:
    """``app`` serves ``runner`` (initialised) as ``model_name``."""

    def __init__(self, runner: InferenceRunner, model_name: str, api_key: Optional[str] = None,
                 max_waiting: int = 256, max_body_bytes: int = 4 << 20, chat_template: ChatTemplate | None = None):
        if runner.tokenizer is None:
            raise ValueError("the server needs a runner with a tokenizer (text in, text out)")
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.runner, self.model_name, self.api_key = runner, model_name, api_key
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        self.chat_template = chat_template or ChatTemplate.for_checkpoint(
            getattr(runner.runner, "checkpoint_path", None))
        self.metrics = Metrics(model_name)
        import jax

        if jax.process_count() > 1:  # process 0 serves; the others follow its rounds (runner/core.py)
            if jax.process_index() != 0:
                raise ValueError("the HTTP server runs on process 0; the others call runner.core.follow()")
            runner.core.broadcast = True
        self.created = int(time.time())
        self.ready = False
        self.app = self._build_app()

    # ---- the app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            self.runner.core.start()
            self.ready = True
            try:
                yield
            finally:
                self.ready = False
                self.runner.core.stop()

        app = FastAPI(title="grok1-jax-runner", lifespan=lifespan)

        @app.exception_handler(APIError)
        async def api_error(request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(Exception)
        async def internal_error(request, e: Exception):  # a bug: still OpenAI's shape, and logged
            log.exception("internal error")
            return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                                status_code=500)

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.ready else 503)

        @app.get("/metrics")
        async def metrics():
            running, waiting = self.runner.core.counts()
            self.metrics.update_load(running, waiting, self.runner.batch_size)
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models(request: HTTPRequest):
            self._authorize(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "grok1-jax-runner",
                                                "max_model_len": self.runner.config.sequence_len}]}

        @app.post("/v1/completions")
        async def completions(request: HTTPRequest):
            body = await self._parse(request, CompletionRequest)
            return await self._completions(body)

        @app.post("/v1/chat/completions")
        async def chat(request: HTTPRequest):
            body = await self._parse(request, ChatCompletionRequest)
            return await self._chat(body)

        @app.post("/tokenize")
        async def tokenize(request: HTTPRequest):
            body = await self._parse(request, TokenizeRequest, needs_model=False)
            if (body.prompt is None) == (body.messages is None):
                raise APIError(400, "tokenize needs exactly one of prompt and messages", "prompt")
            text = body.prompt if body.prompt is not None else self._render(body.messages)
            ids = self.runner.tokenizer.encode(text)
            return {"tokens": ids, "count": len(ids), "max_model_len": self.runner.config.sequence_len}

        @app.post("/detokenize")
        async def detokenize(request: HTTPRequest):
            body = await self._parse(request, DetokenizeRequest, needs_model=False)
            bad = [t for t in body.tokens if not 0 <= t < self.runner.config.vocab_size]
            if bad:
                raise APIError(400, f"tokens: ids outside [0, {self.runner.config.vocab_size}): {bad[:5]}", "tokens")
            return {"prompt": self.runner.tokenizer.decode(body.tokens)}

        return app

    # ---- checks ------------------------------------------------------------------------------------
    def _authorize(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", None,
                           type="authentication_error", code="invalid_api_key")

    async def _parse(self, request: HTTPRequest, model, needs_model: bool = True):
        self._authorize(request)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the request body has {length} bytes, more than {self.max_body_bytes}")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise APIError(413, f"the request body has {len(raw)} bytes, more than {self.max_body_bytes}")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}", param) from None
        if needs_model and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves "
                           f"`{self.model_name}`)", "model", code="model_not_found")
        return body

    def _check_load(self, new: int) -> None:
        _, waiting = self.runner.core.counts()
        if waiting + new > self.max_waiting:
            raise APIError(503, f"the server is overloaded: {waiting} requests wait for a slot (at most "
                           f"{self.max_waiting}); retry later", None, type="server_overloaded",
                           headers={"Retry-After": "1"})

    def _render(self, messages) -> str:
        try:
            return self.chat_template.render([{"role": m.role, "content": m.text()} for m in messages])
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    def _token_text(self, token: int) -> str:
        """A token's piece as text (SentencePiece's word marker as a space; a byte piece as
        ``<0xNN>``): the key of an alternative in ``top_logprobs``."""
        return self.runner.tokenizer.sp.id_to_piece(int(token)).replace("\u2581", " ")

    def _token_bytes(self, token: int) -> list[int]:
        piece = self.runner.tokenizer.sp.id_to_piece(int(token))
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return [int(byte.group(1), 16)] if byte else list(piece.replace("\u2581", " ").encode("utf-8"))

    def _prompt_ids(self, prompt, field: str) -> list[int]:
        try:
            return self.runner.prepare(Request(prompt, max_len=1))
        except ValueError as e:
            raise bad_request(e, field) from None

    # ---- running choices -------------------------------------------------------------------------
    def _submit(self, requests: list[Request], field: str) -> list[_Sink]:
        """Every request checked before any is submitted; then all submitted."""
        loop = asyncio.get_running_loop()
        for r in requests:
            try:
                self.runner.prepare(r)
            except ValueError as e:
                raise bad_request(e, field) from None
        self._check_load(len(requests))
        sinks = []
        try:
            for r in requests:
                sink = _Sink(loop)
                self.runner.core.submit(r, sink)
                sinks.append(sink)
        except ValueError as e:
            for r in requests[: len(sinks)]:
                self.runner.core.cancel(r.request_id)
            raise bad_request(e, field) from None
        return sinks

    async def _events(self, choice: _Choice, sink: _Sink, top: int, arrived: float):
        """The text pieces of one choice as they come: all the events waiting at once make one
        piece (a decode call brings several tokens together; one chunk each would cost the HTTP
        path a JSON dump and a client parse per token). Cancels its request if the consumer
        stops early (a disconnect) or a stop string matched."""
        request, last = choice.request, None
        try:
            while not choice.done:
                events = [await sink.queue.get()]
                while not sink.queue.empty():
                    events.append(sink.queue.get_nowait())
                now = time.perf_counter()
                piece = ""
                for event in events:
                    if choice.done:
                        break
                    if event.token_id is not None:
                        if last is None:
                            self.metrics.ttft.observe(now - arrived)
                            if sink.admitted_at is not None:
                                self.metrics.queue.observe(max(0.0, sink.admitted_at - arrived))
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                    piece += choice.add(event, top)
                yield piece
        finally:
            self.metrics.generation_tokens.inc(len(choice.tokens))
            if not choice.done or self.runner.core.is_live(request.request_id):
                self.runner.core.cancel(request.request_id)
            if choice.done:
                self.metrics.e2e.observe(time.perf_counter() - arrived)
            self.metrics.finished(choice.finish_reason if choice.done else "abort")  # abort: the client left

    async def _run_all(self, choices, sinks, top, arrived):
        async def drain(choice, sink):
            async for _ in self._events(choice, sink, top, arrived):
                pass
        await asyncio.gather(*(drain(c, s) for c, s in zip(choices, sinks)))

    async def _stream(self, choices, sinks, top, arrived, chunk, usage):
        """SSE: every choice's pieces as ``chunk(choice, piece, first)`` dicts, then the usage chunk
        (when asked) and ``[DONE]``. A disconnect cancels every choice's request."""
        out: asyncio.Queue = asyncio.Queue()

        async def pump(choice, sink):
            first = True
            try:
                async for piece in self._events(choice, sink, top, arrived):
                    if piece or choice.done or first:
                        await out.put(chunk(choice, piece, first))
                        first = False
            except APIError as e:
                await out.put({"error": e.body()["error"]})
            finally:
                await out.put(None)

        tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(choices, sinks)]

        async def body():
            open_ = len(tasks)
            try:
                while open_:
                    item = await out.get()
                    if item is None:
                        open_ -= 1
                        continue
                    yield f"data: {json.dumps(item)}\n\n"
                if usage is not None:
                    yield f"data: {json.dumps(usage())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): no request outlives its response
                for t in tasks:
                    t.cancel()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- completions ---------------------------------------------------------------------------------
    async def _completions(self, body: CompletionRequest):
        body.check()
        arrived = time.perf_counter()
        prompts = body.prompts()
        max_tokens = body.max_tokens or 16
        ids = [self._prompt_ids(p, "prompt") for p in prompts]
        runs = [r for p in prompts for r in body.requests(p, max_tokens, "prompt")]
        echo_logprobs = body.echo and body.logprobs is not None
        scores = [await self._prompt_logprobs(i, body.logprobs) for i in ids] if echo_logprobs else None
        sinks = self._submit(runs, "prompt")
        prompt_tokens = sum(len(i) for i in ids)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        choices = [_Choice(k, r, body.stops()) for k, r in enumerate(runs)]
        top = body.logprobs or 0
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_text = [p if isinstance(p, str) else self.runner.tokenizer.decode(p) for p in prompts]

        def logprobs_of(choice, start_token=0, start_text=0):
            if body.logprobs is None:
                return None
            return {"tokens": choice.strs[start_token:], "token_logprobs": choice.logprobs[start_token:],
                    "top_logprobs": [{self._token_text(t): lp for t, lp in top_} for top_ in choice.tops[start_token:]],
                    "text_offset": [start_text + o for o in choice.offsets[start_token:]]}

        def echoed(choice):
            p = choice.index // body.n
            return prompt_text[p] if body.echo else ""

        def usage():
            completion = sum(len(c.tokens) for c in choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        if body.stream:
            sent = {}

            def chunk(choice, piece, first):
                start = sent.get(choice.index, 0)
                sent[choice.index] = len(choice.tokens)
                text = (echoed(choice) if first else "") + piece
                return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [{"index": choice.index, "text": text,
                                     "logprobs": logprobs_of(choice, start, 0),
                                     "finish_reason": choice.finish_reason}]}

            final = (lambda: {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                              "choices": [], "usage": usage()}) if body.include_usage() else None
            return await self._stream(choices, sinks, top, arrived, chunk, final)

        await self._run_all(choices, sinks, top, arrived)
        out = []
        for c in choices:
            lp = logprobs_of(c, 0, len(echoed(c)))
            if echo_logprobs:
                p_ids, p_scores, p_tops = scores[c.index // body.n]
                offsets, at = [], 0
                for t in p_ids:
                    offsets.append(at)
                    at += len(self._token_text(t))
                lp = {"tokens": [self._token_text(t) for t in p_ids] + lp["tokens"],
                      "token_logprobs": p_scores + lp["token_logprobs"],
                      "top_logprobs": p_tops + lp["top_logprobs"],
                      "text_offset": offsets + lp["text_offset"]}
            out.append({"index": c.index, "text": echoed(c) + c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": out, "usage": usage()}

    async def _prompt_logprobs(self, ids: list[int], top: int):
        """Each prompt token's log-probability given the tokens before it (the first has none),
        and its top alternatives: one scoring forward, padded to a prompt bucket."""
        runner = self.runner
        size = runner.bucket_for(len(ids))
        if size < len(ids):
            raise APIError(400, f"prompt: echo with logprobs scores prompts of up to {size} tokens, got "
                           f"{len(ids)}", "prompt")
        tokens = np.zeros((1, size), np.int32)
        tokens[0, : len(ids)] = ids

        def score():
            logits = np.asarray(runner.runner.forward(runner.runner.params, tokens, np.array([len(ids)], np.int32)))
            logits = logits[0, : len(ids)].astype(np.float64)
            return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)

        logp = await asyncio.get_running_loop().run_in_executor(None, score)
        scores, tops = [None], [None]
        for i in range(1, len(ids)):
            scores.append(float(logp[i - 1, ids[i]]))
            best = np.argsort(-logp[i - 1])[:top]
            tops.append({self._token_text(t): float(logp[i - 1, t]) for t in best})
        return ids, scores, tops

    # ---- chat ----------------------------------------------------------------------------------------
    async def _chat(self, body: ChatCompletionRequest):
        body.check()
        arrived = time.perf_counter()
        prompt = self._render(body.messages)
        ids = self._prompt_ids(prompt, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens or max(
            1, self.runner.config.sequence_len - len(ids))
        runs = body.requests(prompt, max_tokens, "messages")
        sinks = self._submit(runs, "messages")
        self.metrics.prompt_tokens.inc(len(ids))
        choices = [_Choice(k, r, body.stops()) for k, r in enumerate(runs)]
        top = body.top_logprobs or 0
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def entry(t, lp, text=None):
            return {"token": self._token_text(t) if text is None else text, "logprob": lp,
                    "bytes": self._token_bytes(t)}

        def logprobs_of(choice, start=0):
            if not body.logprobs:
                return None
            return {"content": [{**entry(t, lp, text), "top_logprobs": [entry(a, alp) for a, alp in tops]}
                                for t, text, lp, tops in zip(choice.tokens[start:], choice.strs[start:],
                                                             choice.logprobs[start:], choice.tops[start:])]}

        def usage():
            completion = sum(len(c.tokens) for c in choices)
            return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}

        if body.stream:
            sent = {}

            def chunk(choice, piece, first):
                start = sent.get(choice.index, 0)
                sent[choice.index] = len(choice.tokens)
                delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                if choice.done and not piece and not first:
                    delta = {}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs_of(choice, start),
                                     "finish_reason": choice.finish_reason}]}

            final = (lambda: {"id": rid, "object": "chat.completion.chunk", "created": created,
                              "model": self.model_name, "choices": [], "usage": usage()}) \
                if body.include_usage() else None
            return await self._stream(choices, sinks, top, arrived, chunk, final)

        await self._run_all(choices, sinks, top, arrived)
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": logprobs_of(c), "finish_reason": c.finish_reason} for c in choices],
                "usage": usage()}


def serve_forever(app, host: str, port: int) -> None:
    """Serve ``app`` with uvicorn until SIGINT or SIGTERM, then shut down gracefully (the
    lifespan stops the engine core, which on several hosts also ends the followers) and return,
    so the caller can leave ``jax.distributed`` in step with the other processes."""
    import signal
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn")  # off the main thread: no signal capture there
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    thread.start()
    try:
        while thread.is_alive() and not stop.wait(0.2):
            pass
    finally:
        server.should_exit = True
        thread.join()
        for s, handler in previous.items():
            signal.signal(s, handler)
