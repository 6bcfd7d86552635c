"""Where the app meets the network: uvicorn, with what one connection may cost bounded in time.

uvicorn alone holds a connection that sends nothing (or half a request head) for ever, and waits
for a stalled upload for ever, also while shutting down, so a few idle sockets can exhaust the
process's file descriptors and one stalled client can keep the process from exiting.
``GuardedH11Protocol`` is uvicorn's h11 protocol with one more timer, the read timeout: a
request's head must arrive complete within ``read_timeout`` seconds of the connection opening (or
of the previous response ending), and while its body is being read no more than ``read_timeout``
seconds may pass between two pieces of it (nginx's ``client_header_timeout`` and
``client_body_timeout``). The timer never runs while the server itself is busy (a request being
answered, or reading paused because the app has not consumed what arrived). A connection closed
by it is logged with its address and why. Between requests uvicorn's keep-alive timeout applies.

``serve_forever`` runs uvicorn until SIGINT or SIGTERM, then drains: no new connections, new
requests on open ones are answered 503, and requests in flight may finish for up to
``shutdown_timeout`` seconds. After that every request still in flight is ended (a stream with
an error event, a whole response with a 503), uploads still arriving are closed, and the process
returns: a shutdown always ends, within the drain timeout plus a few seconds. A second signal
exits at once.

The process's logs: ``configure_logging(level)`` (``--log-level``), and ``AccessLog``, the
middleware of the optional access log (``--access-log``): a line per request with its duration,
which uvicorn's own access log does not have (that one stays off).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import resource
import signal
import sys
import threading
import time
from typing import Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("grok_runner.server")
access_log = logging.getLogger("grok_runner.server.access")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
BACKSTOP = 3.0  # seconds after the drain timeout before uvicorn cancels the tasks still running


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """How long the server waits on a client, and on itself when stopping (seconds)."""

    read_timeout: float = 15.0  # a request's head complete, or the next piece of its body
    keep_alive_timeout: float = 5.0  # an idle connection between two requests (uvicorn's)
    shutdown_timeout: float = 10.0  # the drain on SIGTERM before requests in flight are ended

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"Limits.{field.name} must be a positive number of seconds, got {value!r}")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read timeout (see the module docstring)."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._timer: Optional[object] = None  # an asyncio.TimerHandle while we wait on the client
        self._phase: Optional[str] = None  # "head" or "body": what we wait for; None: not waiting

    # the protocol's events: after each, see what we now wait for
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch(progress=False)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(progress=False)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._phase = None
        super().connection_lost(exc)

    def _waiting_for(self) -> Optional[str]:
        if self.transport is None or self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            return "head"
        if state is h11.SEND_BODY:  # also after an early answer (a 413): uvicorn reads the rest and drops it
            return "body"
        return None

    def _watch(self, progress: bool) -> None:
        """The head has one deadline from its start; the body a deadline per piece."""
        phase = self._waiting_for()
        if phase != self._phase or (phase == "body" and progress):
            self._disarm()
            self._phase = phase
            if phase is not None:
                self._timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        phase = self._waiting_for()
        if phase is None:
            self._phase = None
            return
        if self.flow.read_paused:  # the app has not taken what arrived: not the client's delay
            self._timer = self.loop.call_later(self.read_timeout, self._timed_out)
            return
        what = "the request head was not complete" if phase == "head" else "no more of the request body came"
        client = "%s:%d" % self.client if self.client else "a client"
        log.info("closed the connection from %s: %s within %g s (read timeout)", client, what, self.read_timeout)
        self.close_reading()

    def close_reading(self) -> None:
        """Close this connection (a stalled upload's handler then sees the client gone)."""
        self._disarm()
        self._phase = None
        if not self.transport.is_closing():
            self.transport.close()

    def receiving(self) -> bool:
        """Whether a request of this connection is still being uploaded."""
        return self._waiting_for() == "body"


def uvicorn_config(app, limits: Limits = Limits(), **kwargs) -> uvicorn.Config:
    """The uvicorn config every server of ours runs with (``python run.py serve`` and the tests).
    uvicorn leaves logging alone (no handlers or levels of its own): its records go where
    ``configure_logging`` sends ours, in our format; its access log is off (``AccessLog``)."""
    return uvicorn.Config(app, http=functools.partial(GuardedH11Protocol, read_timeout=limits.read_timeout),
                          timeout_keep_alive=limits.keep_alive_timeout,
                          timeout_graceful_shutdown=limits.shutdown_timeout + BACKSTOP,
                          **{"log_config": None, "log_level": None, "access_log": False, **kwargs})


def configure_logging(level: str = "info") -> None:
    """The server process's logging (``--log-level``): lines on stderr with time, level and logger;
    the server's own (``grok_runner.server``: connections closed, clients gone, the drain, the
    access log and the stats line) at ``level``. The runner's and uvicorn's follow it at debug and
    from warning up, and stay at warning at info: their info lines repeat what the command prints
    (the backend and KV reports, uvicorn's start-up banner). Other libraries: warning and up."""
    if not isinstance(level, str) or level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    value = getattr(logging, level.upper())
    logging.basicConfig(format=LOG_FORMAT, stream=sys.stderr)  # a no-op where the root has a handler already
    logging.getLogger().setLevel(max(value, logging.WARNING))
    logging.getLogger("grok_runner.server").setLevel(value)
    others = value if value != logging.INFO else logging.WARNING
    for name in ("grok_runner", "uvicorn", "uvicorn.error", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(others)


class AccessLog:
    """ASGI middleware: one INFO line per HTTP request on ``grok_runner.server.access`` once its
    response has ended (a stream: its last event), as
    ``127.0.0.1:52044 "POST /v1/completions" 200 812.4 ms cmpl-4f0c...``: the client, the method,
    the path as sent (percent-encoded, without its query string), the status, the milliseconds
    from the request's head to the end of its response, and the response's id where it has one
    (``request.state.request_id``). Never a header or a body, so never the API key. A client that
    left first is marked ``client gone`` (and ``-`` for the status it never got)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, done, gone = None, False, False

        async def sending(message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start" and not gone:
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        async def receiving():
            nonlocal gone
            message = await receive()
            # after the response uvicorn answers every receive with a disconnect: not a client leaving
            gone = gone or (message["type"] == "http.disconnect" and not done)
            return message

        try:
            await self.app(scope, receiving, sending)
        except Exception:
            status = status or 500  # unanswered: uvicorn answers 500
            raise
        finally:
            client = "%s:%d" % tuple(scope["client"][:2]) if scope.get("client") else "-"
            # as received, any byte outside printable ASCII escaped: a path cannot break the line
            path = (scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
            path = "".join(chr(b) if 0x20 < b < 0x7f else f"\\x{b:02x}" for b in path)
            request_id = scope.get("state", {}).get("request_id")
            access_log.info("%s \"%s %s\" %s %.1f ms%s%s", client, scope["method"], path,
                            status or "-", (time.perf_counter() - start) * 1e3,
                            f" {request_id}" if request_id else "", " client gone" if gone else "")


def close_uploads(userver: uvicorn.Server) -> int:
    """On the server's event loop: close every connection still uploading a request."""
    stalled = [c for c in list(userver.server_state.connections)
               if isinstance(c, GuardedH11Protocol) and c.receiving()]
    for connection in stalled:
        connection.close_reading()
    return len(stalled)


def raise_file_limit() -> None:
    """Let the process hold as many sockets as the system allows it (the soft limit, often 1,024,
    raised to the hard one): idle clients then run out of time before the server runs out of
    descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open files: soft limit raised from %d to %d", soft, hard)
        except (ValueError, OSError) as e:
            log.warning("open files: could not raise the soft limit %d to %d: %s", soft, hard, e)


class ShutdownHandle:
    """Graceful shutdown of a uvicorn server that runs in its own thread (``serve_forever``, and
    the tests): ``begin()`` stops new work, ``expire()`` ends what the drain did not finish."""

    def __init__(self, server, userver: uvicorn.Server):
        self.server, self.userver = server, userver

    def begin(self) -> None:
        self.server.begin_drain()
        self.userver.should_exit = True

    def expire(self) -> None:
        loop = self.server.loop
        ended = self.server.end_inflight()
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._close_uploads)
            except RuntimeError:  # the loop closed meanwhile: nothing left to close
                pass
        if ended:
            log.warning("shutdown: the drain timeout passed; ended %d request(s) still in flight", ended)

    def _close_uploads(self) -> None:
        closed = close_uploads(self.userver)
        if closed:
            log.warning("shutdown: closed %d connection(s) still uploading a request", closed)


def serve_forever(server, host: str, port: int, limits: Limits = Limits(),
                  build: Optional[Callable[[], None]] = None) -> int:
    """Serve ``server`` on ``host:port`` until SIGINT or SIGTERM, then shut down as the module
    docstring says and return: 0 after a drain (requests ended by its timeout included, and
    logged), 1 if a second signal forced the exit or the server could not start or stop.
    With ``build``, ``server`` is a ``server.starting.Starting``: the port opens at once and
    ``build()`` runs in a thread beside it (it makes the model ready and attaches the server);
    if it raises, the port closes and the process returns 2 (or the code of a ``SystemExit``,
    with which ``build`` says it has told the user why; anything else is logged)."""
    raise_file_limit()
    userver = uvicorn.Server(uvicorn_config(server.app, limits, host=host, port=port))
    # uvicorn off the main thread: the signals stay ours (uvicorn installs none off it)
    thread = threading.Thread(target=userver.run, name="uvicorn", daemon=True)
    signals: list[int] = []
    arrived = threading.Event()
    failed: list[BaseException] = []

    def run_build():
        while not userver.started and thread.is_alive():
            time.sleep(0.01)
        if not thread.is_alive():
            return
        try:
            build()
        except BaseException as e:  # noqa: B036 - reported, and the server stopped, by the main thread
            failed.append(e)
            arrived.set()

    def on_signal(signum, frame):
        signals.append(signum)
        arrived.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    handle = ShutdownHandle(server, userver)
    thread.start()
    if build is not None:  # the model made ready beside the open port (a daemon: a signal need not wait for it)
        threading.Thread(target=run_build, name="start", daemon=True).start()
    try:
        while thread.is_alive() and not arrived.wait(0.2):
            pass
        if failed:  # the model could not be made ready: the port closed, 2 (``build`` said why with SystemExit)
            error = failed[0]
            if not isinstance(error, SystemExit):
                log.error("the start failed", exc_info=error)
            userver.should_exit = True
            thread.join(10)
            return error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 2
        if not signals:  # uvicorn ended by itself: it could not bind, or failed
            return 0 if userver.started else 1
        log.info("shutting down: letting requests in flight finish for up to %g s", limits.shutdown_timeout)
        handle.begin()
        deadline = time.monotonic() + limits.shutdown_timeout
        expired = False
        while thread.is_alive():
            if len(signals) > 1:
                log.warning("a second signal: exiting now")
                userver.force_exit = True
                return 1
            if not expired and time.monotonic() >= deadline:
                handle.expire()
                expired = True
            if time.monotonic() >= deadline + BACKSTOP + 10:
                log.error("the server did not stop %g s after the drain timeout; exiting", BACKSTOP + 10)
                return 1
            arrived.clear()
            arrived.wait(0.1)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
