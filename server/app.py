"""The OpenAI-compatible HTTP server: a client of the runner's engine like any other.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (each
streamed as server-sent events when asked), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus, vLLM's names), ``POST /tokenize``, ``POST /detokenize``. The engine runs its rounds
in a background thread; each HTTP request submits its runner requests with a sink that hands the
events to the event loop, so no handler ever blocks the loop on the device. This module reads and
checks requests; running their choices and answering them is ``server/flows.py``'s.

What one request may cost is bounded before it costs it: the body is counted while it is read
(413 past ``max_body_bytes``, chunked or not), a request whose choices could never be admitted is
a 400 and one that cannot be admitted now a 503 before any prompt is tokenized, prompt scoring
(``echo`` with ``logprobs``: computed by the engine as part of the request's prefill,
``Request.prompt_logprobs``) has a token budget, and tokenizing, templating and building requests
run in worker threads (SentencePiece releases the GIL), so the event loop keeps answering other
clients. Errors take OpenAI's shape: 400 naming the field for any bad parameter (the same checks
as ``Request``) or malformed JSON, 401 without the API key, 404 for another model, 413, 415 for a
body that is not ``application/json`` (so a web page cannot post to the API without a CORS
preflight), 503 with ``Retry-After`` only when waiting would help. A client that disconnects,
streamed or not, cancels its requests: their slots are free at the next round.

Operations, each off or quiet by default: an access log (``http.AccessLog``), a stats line every
``stats_interval`` seconds while there is activity (``metrics.StatsLine``), and cross-origin
access (CORS) for ``allowed_origins``. Without CORS a browser keeps the pages of other origins
from the API, as the CORS rules have it: no response carries ``Access-Control-Allow-Origin`` and a
preflight (``OPTIONS``, which an ``Authorization`` header or a JSON body needs) is a 405. With
them, Starlette's ``CORSMiddleware`` answers the preflights (before the key is checked: a browser
sends none with them) and marks every response to an allowed origin, streams and errors included.
Both middlewares wrap the whole app, its handler of unexpected errors too, so a 500 is logged and
marked like any other response.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import pathlib
import re
import tempfile
import threading
import time
from typing import Optional, Sequence

import pydantic
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from runner import InferenceRunner, Request
from server.chat import ChatTemplate
from server.http import AccessLog
from server.metrics import Metrics, StatsLine
from server.errors import APIError, bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.choices import SHUTDOWN, Sink
from server.flows import ClientGone, Flows
from server.responses_api import ResponsesRequest

log = logging.getLogger("grok_runner.server")

CHAT_PAGE = pathlib.Path(__file__).with_name("static") / "chat.html"
# a body up to this size is read into memory; a larger one is spooled to a temporary file while it
# arrives and waits for its turn there (uvicorn's own buffer of a connection is this size too)
BODY_IN_MEMORY = 64 << 10
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")  # scheme://host[:port], as a browser's Origin header has it


class _Turn:
    """A large body's turn (one of ``Server._large_bodies``): taken once its upload is complete
    (``Server._read_body``), released once its prompts are token ids or refused, or when its
    request ends, whichever comes first; a small body never takes one.

    While a large body waits for its turn it costs a file on disk, not memory: what concurrent
    oversized requests cost at once is what the ones holding a turn cost (each up to
    ``max_body_bytes`` read back, parsed and normalized), however many there are. Uploads
    themselves never wait, so a client trickling its body delays nobody's turn."""

    def __init__(self, semaphore: asyncio.Semaphore):
        self.semaphore, self.held = semaphore, False

    async def take(self) -> None:
        await self.semaphore.acquire()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.semaphore.release()

    def __enter__(self) -> "_Turn":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_origins(origins) -> tuple[str, ...]:
    """``allowed_origins`` as the browser's ``Origin`` header spells them (scheme and host in
    lower case); none: CORS off."""
    if origins is None:
        return ()
    if not isinstance(origins, (list, tuple)) or not all(isinstance(o, str) for o in origins):
        raise ValueError(f"allowed_origins must be a list of origins (or [\"*\"]), got {origins!r}")
    bad = [o for o in origins if o != "*" and not ORIGIN.fullmatch(o.lower())]
    if bad:
        raise ValueError(f"allowed_origins: {bad[0]!r} is not an origin: expected scheme://host[:port] with no "
                         f"path (as https://example.com), or *")
    return tuple(o.lower() for o in origins)


def edge(allowed_origins=None, access_log: bool = False) -> list:
    """The operations' middleware, innermost first: CORS for ``allowed_origins`` (checked by
    ``check_origins``), then the access log, outermost so that preflights are logged too. The
    server's app and the start-up's 503s (``server.starting``) are both served behind it."""
    outer = []
    allowed_origins = check_origins(allowed_origins)
    if allowed_origins:
        # any request header: the key is a bearer token and no cookie is allowed, and OpenAI's
        # JavaScript client sends headers of its own (x-stainless-*); Retry-After and
        # x-should-retry readable by the page, as the OpenAI clients read them
        outer.append(functools.partial(CORSMiddleware, allow_origins=allowed_origins,
                                       allow_methods=["GET", "POST"], allow_headers=["*"],
                                       expose_headers=["Retry-After", "x-should-retry"],
                                       allow_private_network=True, max_age=600))
    if access_log:
        outer.append(AccessLog)
    return outer


class _App(FastAPI):
    """FastAPI with the middleware ``outer`` (innermost first) around its whole stack: Starlette
    puts added middleware inside its handler of unexpected errors, whose 500 would then go
    unlogged by the access log and without the CORS header."""

    def __init__(self, outer: list, **kwargs):
        self.outer = outer
        super().__init__(**kwargs)

    def build_middleware_stack(self):
        app = super().build_middleware_stack()
        for middleware in self.outer:
            app = middleware(app)
        return app


class Server(Flows):
    """``app`` serves ``runner`` (initialised) as ``model_name``. Operations (see the module
    docstring): ``access_log``, ``stats_interval`` (seconds; 0: no stats line) and
    ``allowed_origins`` (origins as ``https://host[:port]``, or ``["*"]``; None: no CORS)."""

    def __init__(self, runner: InferenceRunner, model_name: str, api_key: Optional[str] = None,
                 max_waiting: int = 256, max_body_bytes: int = 4 << 20, chat_template: ChatTemplate | None = None,
                 max_scored_tokens: Optional[int] = None, private_docs_and_metrics: bool = False,
                 access_log: bool = False, stats_interval: float = 10.0,
                 allowed_origins: Optional[Sequence[str]] = None):
        if runner.tokenizer is None:
            raise ValueError("the server needs a runner with a tokenizer (text in, text out)")
        for name, value in (("max_waiting", max_waiting), ("max_body_bytes", max_body_bytes),
                            ("max_scored_tokens", max_scored_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError(f"api_key must be a non-empty string or None, got {api_key!r}")
        if private_docs_and_metrics and api_key is None:
            raise ValueError("private_docs_and_metrics needs an api_key")
        if not isinstance(access_log, bool):
            raise ValueError(f"access_log must be True or False, got {access_log!r}")
        if (not isinstance(stats_interval, (int, float)) or isinstance(stats_interval, bool)
                or not 0 <= stats_interval < float("inf")):
            raise ValueError(f"stats_interval must be a number of seconds >= 0 (0: no stats line), got "
                             f"{stats_interval!r}")
        self.access_log, self.stats_interval = access_log, stats_interval
        self.allowed_origins = check_origins(allowed_origins)
        self.runner, self.model_name, self.api_key = runner, model_name, api_key
        self._key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        # prompt tokens one request may have scored (echo with logprobs): a full decode batch's worth;
        # none on a runner that does not score prompts (its scoring prefill is not compiled)
        self.max_scored_tokens = (0 if not runner.score_prompts else
                                  runner.num_slots * runner.config.sequence_len if max_scored_tokens is None
                                  else max_scored_tokens)
        self.private = private_docs_and_metrics
        self.chat_template = chat_template or ChatTemplate.for_checkpoint(
            getattr(runner, "checkpoint_path", None))
        self.metrics = Metrics(model_name)
        import jax

        if jax.process_count() > 1:  # process 0 serves; the others follow its rounds (runner/engine.py)
            if jax.process_index() != 0:
                raise ValueError("the HTTP server runs on process 0; the others call runner.engine.follow()")
            runner.engine.broadcast = True
        self.created = int(time.time())
        self.ready = False
        self.draining = False  # shutting down: no new requests (503), /health 503
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the event loop serving the app
        self._admission = threading.Lock()  # the load check and the submissions it admits, together
        self._inflight: set[Sink] = set()  # the sinks of submitted requests whose responses are not done
        self._inflight_lock = threading.Lock()
        # large bodies parsed and tokenized at once (see _Turn): one, so the memory they take is
        # one body's (a 4 MB prompt: about 25 MB; a 4 MB /tokenize: its 1M ids, about 180 MB)
        self._large_bodies = asyncio.Semaphore(1)
        self.app = self._build_app()

    def begin_drain(self) -> None:
        """From any thread: refuse new requests (503) and report not ready; those in flight go on."""
        self.draining = True

    def end_inflight(self) -> int:
        """From any thread: end every request in flight (a stream with an error event, a whole
        response with a 503) and cancel its runner requests; how many runner requests were ended."""
        self.draining = True
        with self._inflight_lock:
            sinks = list(self._inflight)
        for sink in sinks:
            sink.put(SHUTDOWN)
        return len(sinks)

    # ---- the app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            self.loop = asyncio.get_running_loop()
            self.runner.engine.start()
            self.ready = True
            stats = (asyncio.create_task(StatsLine(self.metrics, self.runner).run(self.stats_interval))
                     if self.stats_interval else None)
            try:
                yield
            finally:
                if stats is not None:
                    stats.cancel()
                    await asyncio.wait([stats])
                self.ready = False
                self.runner.engine.stop()

        outer = edge(self.allowed_origins, self.access_log)
        public_docs = {} if not self.private else {"docs_url": None, "redoc_url": None, "openapi_url": None}
        app = _App(outer, title="grok1-jax-runner", lifespan=lifespan, **public_docs)
        self._error_handlers(app)
        self._pages(app)
        self._api(app)
        return app

    @staticmethod
    def _error_handlers(app: FastAPI) -> None:
        """Every error in OpenAI's shape: ours, an unknown route or method, a bug (logged)."""

        @app.exception_handler(APIError)
        async def api_error(request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, e: StarletteHTTPException):  # an unknown route or method
            what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                    f"{request.url.path}"}.get(e.status_code, str(e.detail))
            error = APIError(e.status_code, what, None, code={404: "not_found", 405: "method_not_allowed"}.get(
                e.status_code))
            return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

        @app.exception_handler(Exception)
        async def internal_error(request, e: Exception):  # a bug: still OpenAI's shape, and logged
            log.exception("internal error")
            return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                                status_code=500)

        @app.exception_handler(ClientGone)
        async def client_gone(request, e: ClientGone):  # logged where it was noticed; nobody to answer
            return Response(status_code=400)

    def _pages(self, app: FastAPI) -> None:
        """The chat page, ``/health``, the docs (behind the key on a private server), ``/metrics``."""

        @app.get("/", include_in_schema=False)
        async def chat_page():  # a page to try the model in a browser: static, nothing fetched from outside
            # (the browser enforces it: the page may only talk to this server)
            return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"), headers={
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src "
                                           "'unsafe-inline'; connect-src 'self'; img-src data:",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

        @app.get("/health")
        async def health():
            return Response(status_code=200 if self.ready and not self.draining else 503)

        if self.private:  # the docs behind the key too
            @app.get("/openapi.json", include_in_schema=False)
            async def openapi(request: HTTPRequest):
                self._authorize(request)
                return JSONResponse(app.openapi())

            @app.get("/docs", include_in_schema=False)
            async def docs(request: HTTPRequest):
                self._authorize(request)
                return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

            @app.get("/redoc", include_in_schema=False)
            async def redoc(request: HTTPRequest):
                self._authorize(request)
                return get_redoc_html(openapi_url="/openapi.json", title=app.title)

        @app.get("/metrics")
        async def metrics(request: HTTPRequest):
            if self.private:
                self._authorize(request)
            self.metrics.update_load(*self.runner.usage())
            self.metrics.update_prefix_cache(*self.runner.prefix_cache_counts())
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _api(self, app: FastAPI) -> None:
        """The OpenAI API and the tokenizer's endpoints."""

        @app.get("/v1/models")
        async def models(request: HTTPRequest):
            self._authorize(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "grok1-jax-runner",
                                                "max_model_len": self.runner.config.sequence_len}]}

        def generating(path: str, model, flow, name: str) -> None:
            """A route that generates: its body parsed as ``model`` (a large one in its turn),
            then run and answered by ``flow`` (``server/flows.py``)."""
            async def endpoint(request: HTTPRequest):
                arrived = time.perf_counter()
                with _Turn(self._large_bodies) as turn:
                    body = await self._parse(request, model, turn)
                    return await flow(body, request, arrived, turn)

            app.post(path, name=name)(endpoint)

        generating("/v1/completions", CompletionRequest, self._completions, "completions")
        generating("/v1/chat/completions", ChatCompletionRequest, self._chat, "chat")
        generating("/v1/responses", ResponsesRequest, self._responses, "responses")

        @app.post("/tokenize")
        async def tokenize(request: HTTPRequest):
            with _Turn(self._large_bodies) as turn:  # all of it: the ids of a long text are its largest part
                body = await self._parse(request, TokenizeRequest, turn, needs_model=False)
                if (body.prompt is None) == (body.messages is None):
                    raise APIError(400, "tokenize needs exactly one of prompt and messages", "prompt")
                text = body.prompt if body.prompt is not None else await asyncio.to_thread(self._render, body)
                try:
                    ids = await asyncio.to_thread(self.runner.tokenizer.encode, text) if isinstance(text, str) else text
                except ValueError as e:  # the tokenizer failing on this text (a pattern past its limit)
                    raise APIError(400, str(e), "prompt" if body.prompt is not None else "messages") from None
                # JSONResponse directly: FastAPI's encoder walks a long list in Python, on the loop
                return JSONResponse({"tokens": ids, "count": len(ids),
                                     "max_model_len": self.runner.config.sequence_len})

        @app.post("/detokenize")
        async def detokenize(request: HTTPRequest):
            with _Turn(self._large_bodies) as turn:
                body = await self._parse(request, DetokenizeRequest, turn, needs_model=False)
                bad = [t for t in body.tokens if not 0 <= t < self.runner.config.vocab_size]
                if bad:
                    raise APIError(400, f"tokens: ids outside [0, {self.runner.config.vocab_size}): {bad[:5]}",
                                   "tokens")
                return {"prompt": self.runner.tokenizer.decode(body.tokens)}

    # ---- checks ------------------------------------------------------------------------------------
    def _authorize(self, request: HTTPRequest) -> None:
        """``Authorization: Bearer KEY``, the scheme in any case (RFC 7235); the key compared in
        constant time (of digests, so not even its length shows in the timing)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        if not (hmac.compare_digest(given, self._key_digest) and scheme.lower() == "bearer"):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", None,
                           type="authentication_error", code="invalid_api_key")

    async def _read_body(self, request: HTTPRequest, turn: "_Turn") -> bytes:
        """The body, counted as it arrives: past ``max_body_bytes`` a 413, whatever the framing
        (the rest is read and dropped by uvicorn, so the client sees the answer). Past
        ``BODY_IN_MEMORY`` bytes it goes to a temporary file as it arrives and is read back once
        complete and ``turn`` is taken (see ``_Turn``)."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body has {length} bytes, more than {limit}")
        with tempfile.SpooledTemporaryFile(max_size=BODY_IN_MEMORY) as body:
            size = 0
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"the request body has more than {limit} bytes")
                    body.write(chunk)
            except ClientDisconnect:
                client = "%s:%d" % request.client if request.client else "a client"
                log.info("%s left during the upload of %s, after %d bytes", client, request.url.path, size)
                raise ClientGone() from None
            if size > BODY_IN_MEMORY:
                await turn.take()
            body.seek(0)
            return body.read()

    async def _parse(self, request: HTTPRequest, model, turn: "_Turn", needs_model: bool = True):
        self._authorize(request)
        media = request.headers.get("content-type", "")
        if media.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}", None,
                           code="unsupported_media_type")
        raw = await self._read_body(request, turn)
        # a large body is parsed in a worker thread: the event loop keeps its turns (a 4 MB list
        # of ids takes 0.2-0.5 s), and its memory is the turn's
        body = await asyncio.to_thread(self._validate, raw, model) if turn.held else self._validate(raw, model)
        if needs_model and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves "
                           f"`{self.model_name}`)", "model", code="model_not_found")
        return body

    @staticmethod
    def _validate(raw: bytes, model):
        """The body as ``model``; 400 naming the field if it is not."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the request body is JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}", param) from None
        except RecursionError:
            raise APIError(400, "the request body is JSON nested too deeply") from None

    def _check_capacity(self, choices: int, param: str) -> None:
        """Before any work: a request of more choices than slots plus waiting places can never be
        admitted (400); one that cannot be admitted now waits for ``_check_load`` (503)."""
        slots = self.runner.num_slots
        if choices > slots + self.max_waiting:
            raise APIError(400, f"{param}: the request has {choices} choices (prompts x n), more than this server "
                           f"admits at once: {slots} slots + {self.max_waiting} waiting = "
                           f"{slots + self.max_waiting} (--batch-size, --max-waiting)", param)
        self._check_load(choices)

    def _check_load(self, new: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, type="service_unavailable")
        running, waiting = self.runner.engine.counts()
        limit = self.runner.num_slots + self.max_waiting
        if running + waiting + new > limit:
            raise APIError(503, f"the server is overloaded: {running} requests run and {waiting} wait for a "
                           f"slot, and {new} more would exceed {limit} ({self.runner.num_slots} slots + "
                           f"{self.max_waiting} waiting); retry later", None, type="server_overloaded",
                           headers={"Retry-After": "1"})

    def _render(self, body):
        """A body's messages as its prompt: text, or ids where the template wrote special tokens
        (``ChatTemplate.prompt``)."""
        try:
            return self.chat_template.prompt(tokenizer=self.runner.tokenizer, context=self.runner.config.sequence_len,
                                             **body.template_args())
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    def _prompt_ids(self, prompt, names: dict[str, str]) -> list[int]:
        try:
            if not isinstance(prompt, str):  # a list of ids too long is refused before each id is checked
                self.runner.check_prompt_length(len(prompt))
            return self.runner.prepare(Request(prompt, max_len=1))
        except ValueError as e:
            raise bad_request(e, names) from None
