"""``EngineCore``: the one owner of a runner's device state, and the scheduling loop over it.

Each round: apply the submissions and cancellations that clients queued, admit waiting requests
into free slots (prefill), dispatch one decode call for every active slot, then turn the previous
calls' outputs into ``TokenEvent``s, each delivered to its own request's client. The host reads a
call's tokens only after the next call was dispatched (one call of pipelining, as the reference),
so the device never waits for the host.

Clients (``RunStream``, ``InferenceRunner.generate``, ``sample_from_model``, the HTTP server)
only ``submit`` requests with a sink for their events and ``cancel`` them; both are thread-safe
and queue a command that the next round applies. Rounds run in one thread at a time: in a
background thread after ``start()``, or else in whichever client thread waits for events
(``wait_for``): any client's rounds serve every client's requests.

A failure belongs to its request. Anything raised while admitting or emitting one request (its
prefill arguments, its detokenizer, a host-side bug) ends that request alone with an ``error``
event and frees its slot; the other requests' tokens are unchanged, and every output read back
from the device is processed, so the host's view of each slot never falls behind the device's.
A failure of a whole device call ends every request it served, with a fresh decode state.

Several hosts: with ``broadcast`` (the server sets it when ``jax.process_count() > 1``), process 0
takes the requests and, at the start of every round, broadcasts the commands it drained (its
submissions and cancellations) to all processes; every process applies the same commands and so
runs the same device calls. The other processes call ``follow()``, which runs rounds until
process 0 stops; their events go nowhere. While idle, process 0 still runs an empty round every
``HEARTBEAT`` seconds, so the followers' collectives never wait long.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
import zlib
from typing import Callable, Optional, Protocol

import jax
import numpy as np

from runner.requests import Request, TokenEvent
from runner.state import MAX_STOP_IDS, DecodeOutput, PrefillArgs
from runner.tokenizer import IncrementalDetokenizer

log = logging.getLogger("grok_runner")

HEARTBEAT = 1.0  # seconds between empty rounds of an idle broadcasting core


class Sink(Protocol):
    """Where a request's events go; ``put`` is called from the thread running the rounds."""

    def put(self, event: TokenEvent) -> None: ...


class _Nowhere:
    """The sink of a follower process's requests (process 0 answers the clients)."""

    def put(self, event: TokenEvent) -> None:
        pass


class Inbox:
    """A sink for one client: its requests' events in order, and which of them are still live."""

    def __init__(self):
        self.events: collections.deque[TokenEvent] = collections.deque()
        self.live: set[str] = set()

    def put(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason:
            self.live.discard(event.request_id)

    def submit(self, core: "EngineCore", request: Request) -> None:
        """``core.submit(request, self)``, counting the request live here first (its events may
        come before submit returns, from a round in another thread)."""
        rid = getattr(request, "request_id", None)
        fresh = isinstance(rid, str) and rid not in self.live
        if fresh:
            self.live.add(rid)
        try:
            core.submit(request, self)
        except BaseException:
            if fresh:
                self.live.discard(rid)
            raise


def default_seed(request: Request) -> int:
    """The seed of a request that names none: derived from its id, so every process of a
    multi-host run draws the same tokens (each runs the same scheduler on the same requests)."""
    return zlib.crc32(request.request_id.encode())


def prefill_args(eos_token: int, slot: int, chunk: np.ndarray, length: int, reset: bool,
                 request: Request) -> PrefillArgs:
    """The device arguments of one prompt chunk of ``request`` (padded ``chunk``, ``length`` real
    tokens) for ``slot``; ``reset`` on its first chunk."""
    stop = [eos_token] + sorted(set(request.stop_token_ids) - {eos_token})
    stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop_ids[: len(stop)] = stop
    seed = request.rng_seed if request.rng_seed is not None else default_seed(request)
    return PrefillArgs(slot=np.int32(slot), tokens=chunk[None].astype(np.int32), length=np.int32(length),
                       reset=np.bool_(reset), temperature=np.float32(request.temperature),
                       nucleus_p=np.float32(request.nucleus_p), top_k=np.int32(request.top_k),
                       seed=np.uint32(seed), max_len=np.int32(request.max_len), stop_ids=stop_ids)


@dataclasses.dataclass(eq=False)
class _Slot:
    """A request occupying a batch slot."""

    request: Request
    sink: Sink
    detokenizer: Optional[IncrementalDetokenizer]
    position: int  # an upper bound on the slot's next cache position (the host lags the device)
    generated: int = 0
    finished: bool = False


class EngineCore:
    """Slots, the waiting queue and the decode state of one ``InferenceRunner``."""

    def __init__(self, runner):
        self.runner = runner  # an initialised InferenceRunner: its ModelRunner, buckets and tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Sink] = {}  # submitted and not yet ended, by id (guarded by _ids)
        self._ids = threading.Lock()
        self._round_lock = threading.Lock()  # one thread runs rounds at a time
        self._changed = threading.Condition()  # notified after every round and command
        self._waiting: collections.deque[tuple[Request, list[int], Sink]] = collections.deque()
        self._slots: list[Optional[_Slot]] = [None] * runner.batch_size
        self._pending: list[tuple[object, list[tuple[int, _Slot]]]] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.broadcast = False  # several processes: process 0's commands go to all (see above)
        self._stopped = False  # a follower saw process 0 stop

    # ---- what clients call, from any thread ----------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        """Queue ``request``; its events go to ``sink``. A bad request (or an id already live)
        raises ``ValueError`` here, and nothing else changes."""
        ids = self.runner.prepare(request)
        with self._ids:
            if request.request_id in self._live:
                raise ValueError(f"Request.request_id {request.request_id!r} is already in use by a live request")
            self._live[request.request_id] = sink
        self._commands.put(("submit", request, ids, sink))
        self._notify()

    def cancel(self, request_id: str) -> bool:
        """End a waiting or running request at the next round (finish reason ``cancelled``);
        False if no live request has this id."""
        with self._ids:
            if request_id not in self._live:
                return False
        self._commands.put(("cancel", request_id))
        self._notify()
        return True

    def is_live(self, request_id: str) -> bool:
        with self._ids:
            return request_id in self._live

    def capacity(self) -> int:
        """Free slots less waiting requests: how many more could start at the next round."""
        return self._slots.count(None) - len(self._waiting) - self._commands.qsize()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests now: in slots, and submitted but not yet in one."""
        with self._ids:
            live = len(self._live)
        running = sum(s is not None for s in self._slots)
        return running, max(0, live - running)

    def idle(self) -> bool:
        """No request live (an output still pending on the device can only be of ended ones)."""
        with self._ids:
            return not self._live

    def wait_for(self, ready: Callable[[], bool], timeout: float = 0.05) -> None:
        """Return once ``ready()``; meanwhile run rounds in this thread unless another thread (the
        background loop, another client) is running them."""
        while not ready():
            if self._thread is None and self._round_lock.acquire(blocking=False):
                try:
                    self._round()
                finally:
                    self._round_lock.release()
                self._notify()
            else:
                with self._changed:
                    self._changed.wait(timeout)

    # ---- the background loop ---------------------------------------------------------------------
    def start(self) -> None:
        """Run rounds in a background thread from now on (serving); ``stop()`` ends it."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._notify()
            thread.join()
            if self.broadcast:  # the followers end with this round
                self._commands.put(("stop",))
                with self._round_lock:
                    self._round()

    def follow(self) -> None:
        """On a process other than 0 with ``broadcast``: run the rounds process 0 broadcasts,
        until it stops."""
        if not self.broadcast or jax.process_index() == 0:
            raise RuntimeError("follow() is for processes other than 0 of a broadcasting core")
        while not self._stopped:
            with self._round_lock:
                self._round()

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            idle = self.idle() and self._commands.empty()
            if idle and not (self.broadcast and time.monotonic() - last > HEARTBEAT):
                with self._changed:
                    self._changed.wait(0.05)
                continue
            with self._round_lock:
                self._round()
            last = time.monotonic()
            self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---- one round ---------------------------------------------------------------------------------
    def _round(self) -> None:
        self._apply_commands()
        ready, self._pending = self._pending, []
        r = self.runner
        try:
            self._admit()
            active = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.finished]
            if active:
                steps = r.decode_steps
                kv_len = r.kv_bucket_for(max(s.position for _, s in active) + steps)
                r.state, out = r.runner.sample_step(r.runner.params, r.state, kv_len=kv_len, steps=steps)
                for _, s in active:
                    s.position += steps
                self._pending.append((out, active))
            ready = jax.device_get(ready)  # one host sync a round, after the next call is dispatched
        except Exception as e:  # a device call failed: its outputs, and the state, are lost
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self._read(ready)

    def _apply_commands(self) -> None:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if self.broadcast:
            commands = self._broadcast(commands)
        for command in commands:
            if command[0] == "submit":
                self._waiting.append(command[1:])
            elif command[0] == "cancel":
                self._cancel(command[1])
            else:  # "stop": process 0 is done
                self._stopped = True

    def _broadcast(self, commands: list) -> list:
        """Process 0's commands, on every process (a collective: every process calls it once a
        round). Requests travel as their fields and prompt ids; a follower's have no sink."""
        from jax.experimental import multihost_utils

        if jax.process_index() == 0:
            wire = [["submit", dataclasses.asdict(c[1]), c[2]] if c[0] == "submit" else list(c) for c in commands]
            data = np.frombuffer(json.dumps(wire).encode(), np.uint8)
        else:
            data = np.zeros((0,), np.uint8)
        size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
        # padded to a power of two (at least 4 KiB): each buffer size is one more compiled collective
        buffer = np.zeros((max(4096, 1 << (size - 1).bit_length()),), np.uint8)
        buffer[: data.size] = data
        data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size]
        if jax.process_index() == 0:
            return commands
        out = []
        for c in json.loads(data.tobytes().decode()):
            if c[0] == "submit":
                with self._ids:
                    self._live[c[1]["request_id"]] = _Nowhere()
                out.append(("submit", Request(**c[1]), c[2], _Nowhere()))
            else:
                out.append(tuple(c))
        return out

    def _cancel(self, request_id: str) -> None:
        for i, (request, _, sink) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                self._end(sink, TokenEvent(request, 0, None, "", 0.0, (), "cancelled"))
                return
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request.request_id == request_id and not slot.finished:
                self._free(index, slot)
                self._end(slot.sink, TokenEvent(slot.request, slot.generated, None, self._flush(slot), 0.0, (),
                                                "cancelled"))
                return

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            request, ids, sink = self._waiting.popleft()
            index = self._slots.index(None)
            dispatched = False
            try:
                detokenizer = (IncrementalDetokenizer(self.runner.tokenizer, ids)
                               if self.runner.tokenizer is not None else None)
                eos = self.runner.config.eos_token
                calls = [(prefill_args(eos, index, chunk, length, n == 0, request), kv_len)
                         for n, (chunk, length, kv_len) in enumerate(self.runner.prefill_chunks(ids))]
                out = None
                for args, kv_len in calls:
                    dispatched = True
                    self.runner.state, out = self.runner.runner.prefill_memory(
                        self.runner.runner.params, self.runner.state, args, kv_len=kv_len)
            except Exception as e:
                if dispatched:  # a device call failed: not this request's fault alone
                    raise
                self._error(request, sink, 0, e)
                continue
            slot = _Slot(request, sink, detokenizer, position=len(ids))
            self._slots[index] = slot
            admitted = getattr(sink, "admitted", None)  # a sink may time its request's wait for a slot
            if admitted is not None:
                admitted()
            self._pending.append((out, [(0, slot)]))  # the first token is row 0 of the prefill output

    def _read(self, ready) -> None:
        """Turn device outputs into events. Every row is read, whatever one request's emit does."""
        for out, rows in ready:
            if isinstance(out, DecodeOutput):
                sample, valid = out.sample, out.valid
            else:  # a prefill's first token: one step, row 0
                sample = jax.tree_util.tree_map(lambda a: a[None], out)
                valid = np.ones((1, len(rows)), bool)
            for step in range(valid.shape[0]):
                for row, slot in rows:
                    if valid[step, row] and not slot.finished:
                        try:
                            self._emit(slot, sample, step, row)
                        except Exception as e:
                            index = self._slots.index(slot) if slot in self._slots else None
                            if index is not None:
                                self._free(index, slot)
                            slot.finished = True
                            self._error(slot.request, slot.sink, slot.generated, e)

    def _emit(self, slot: _Slot, sample, step: int, row: int) -> None:
        # The same rule ends the request on the device (engine.decode), so both agree.
        token = int(sample.token_id[step, row])
        slot.generated += 1
        request = slot.request
        reason = ("eos" if token == self.runner.config.eos_token else "stop" if token in request.stop_token_ids
                  else "length" if slot.generated >= request.max_len else None)
        text = "" if reason in ("eos", "stop") or slot.detokenizer is None else slot.detokenizer.add(token)
        if reason is not None:
            text += self._flush(slot)
        top = tuple(zip(sample.top_k_token_ids[step, row].tolist(), sample.top_k_probs[step, row].tolist()))
        event = TokenEvent(request, slot.generated - 1, token, text, float(sample.logprob[step, row]), top, reason)
        if reason is not None:
            self._free(self._slots.index(slot), slot, release=False)  # the device stopped it itself
            self._end(slot.sink, event)
        else:
            slot.sink.put(event)

    def _error(self, request: Request, sink: Sink, index: int, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        log.warning("request %s failed: %s", request.request_id, message)
        self._end(sink, TokenEvent(request, index, None, "", 0.0, (), "error", error=message))

    def _fail_all(self, message: str) -> None:
        log.error("a device call failed; ending every request it served: %s", message)
        for index, slot in enumerate(self._slots):
            if slot is not None and not slot.finished:
                slot.finished = True
                self._slots[index] = None
                self._end(slot.sink, TokenEvent(slot.request, slot.generated, None, "", 0.0, (), "error",
                                                error=message))
        self._pending = []
        self.runner.state = self.runner.runner.new_state()

    def _end(self, sink: Sink, event: TokenEvent) -> None:
        """Deliver a request's last event; its id is free for a new request from then on."""
        with self._ids:
            self._live.pop(event.request_id, None)
        sink.put(event)

    def _free(self, index: int, slot: _Slot, release: bool = True) -> None:
        slot.finished = True
        self._slots[index] = None
        if release:
            r = self.runner
            r.state = r.runner.release_slot(r.state, np.int32(index))

    @staticmethod
    def _flush(slot: _Slot) -> str:
        return slot.detokenizer.flush() if slot.detokenizer is not None else ""
