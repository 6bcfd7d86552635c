"""The port from the first second: what answers while the model starts.

``python run.py serve`` opens its port before it restores and compiles anything, and serves
``Starting``: ``/health`` answers 503 with a JSON body that says which phase the start is in (and
its progress over the compiled steps), every other path 503 with ``Retry-After`` in OpenAI's error
shape, so a load balancer, a client or an orchestrator can tell "starting" from "dead" (vLLM and
llama-server answer 503 while loading too). Once the model is ready the server's own app is
attached (its lifespan run as uvicorn would run it) and answers everything from then on.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from runner.startup import Startup
    from server.app import Server

RETRY_AFTER = 5  # seconds a client is asked to wait before trying again while the model starts


class Starting:
    """The app ``serve_forever`` runs while the model starts, then the ``Server`` attached to it.
    It has the surface ``serve_forever``'s shutdown uses (``loop``, ``begin_drain``,
    ``end_inflight``), passed on to the server once there is one."""

    def __init__(self, startup: "Startup", edge: Sequence = ()):
        self.startup = startup
        answer = self._starting
        for middleware in edge:  # ``server.app.edge``: CORS and the access log, as the server's own
            answer = middleware(answer)
        self._answer = answer
        self.server: Optional["Server"] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop_server = None  # ends the attached server's lifespan (uvicorn's shutdown)
        self.draining = False

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        return self.server.loop if self.server is not None else self._loop

    def begin_drain(self) -> None:
        self.draining = True
        if self.server is not None:
            self.server.begin_drain()

    def end_inflight(self) -> int:
        return self.server.end_inflight() if self.server is not None else 0

    def attach(self, server: "Server", timeout: float = 60.0) -> None:
        """From another thread, once the model is ready: start ``server``'s lifespan (its engine)
        on the serving loop and hand it every request from now on."""
        if self._loop is None:
            raise RuntimeError("the server is not running")
        asyncio.run_coroutine_threadsafe(self._attach(server), self._loop).result(timeout)

    async def _attach(self, server: "Server") -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        outbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})
        task = asyncio.create_task(server.app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                                               "state": {}}, inbox.get, outbox.put))
        reply = await outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the server did not start: {reply.get('message', reply['type'])}")

        async def stop():
            await inbox.put({"type": "lifespan.shutdown"})
            await outbox.get()
            await task

        self._stop_server = stop
        self.server = server

    @property
    def app(self) -> "Starting":
        """The ASGI app uvicorn serves: this object."""
        return self

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup
            self._loop = asyncio.get_running_loop()
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            if self._stop_server is not None:
                await self._stop_server()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self.server is not None:
            return await self.server.app(scope, receive, send)
        if scope["type"] != "http":
            return  # a websocket: refused (closed unanswered) until the model is ready
        await self._answer(scope, receive, send)

    async def _starting(self, scope, receive, send) -> None:
        """503: /health with the start's phase, any other path with Retry-After."""
        status = self.startup.status()
        if self.draining:
            status["status"] = "stopping"
        if scope["path"] == "/health":
            body, headers = status, []
        else:
            phase = status["phase"] + (f", {status['progress']['done']} of {status['progress']['total']}"
                                       if "progress" in status else "")
            body = {"error": {"message": f"the model is starting ({phase}, {status['elapsed_s']} s so far); "
                                         f"try again in {RETRY_AFTER} s", "type": "unavailable",
                              "param": None, "code": "starting"}}
            headers = [(b"retry-after", str(RETRY_AFTER).encode())]
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers]})
        await send({"type": "http.response.body", "body": payload})
