"""``Engine``: the rounds over one model's device state, and the API its clients call.

A round is three calls, each an object with one job (vLLM v1's ``step()``):

1. ``Scheduler.schedule()`` (``runner/scheduler.py``): the requests, slots and KV blocks (the
   prefix cache's index included) -> a ``RoundPlan``: one prefill call holding the prompt chunks
   of several requests, its forks, one decode call for every decoding slot.
2. The ``Executor`` (``runner/executor.py``) runs it: the plan's rows become host arrays
   (``runner/batches.py``), each call is dispatched on the device state, and comes back as a
   ``Call`` in flight.
3. The update: each call's outputs, once read, fold into the scheduler's state
   (``Scheduler.update_from_decode``) and, through the ``OutputProcessor`` (``runner/outputs.py``),
   into each request's events, delivered to its own client.

The host reads a call's outputs only after the next round's calls were dispatched (pipelining,
as the reference), so the device never waits for the host; it reads them call by call, so a
request's first token leaves when its prefill call ends.

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

Several hosts (``runner/wire.py``): with ``broadcast`` (the server sets it when
``jax.process_count() > 1``), process 0 takes the requests and broadcasts the commands it drained
at the start of every round; every process applies the same commands and so runs the same
device calls. The other processes call ``follow()``, which runs rounds until process 0 stops.
While idle, process 0 still runs an empty round every ``HEARTBEAT`` seconds, so the followers'
collectives never wait long.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Optional, Protocol

import jax

from runner.batches import prefill_row, request_row
from runner.executor import Executor
from runner.outputs import OutputProcessor
from runner.requests import Request, TokenEvent
from runner.scheduler import PrefillRow, RequestState, RoundPlan, Scheduler
from runner.wire import Nowhere, broadcast

log = logging.getLogger("grok_runner")

HEARTBEAT = 1.0  # seconds between empty rounds of an idle broadcasting engine


class Sink(Protocol):
    """Where a request's events go; ``put`` is called from the thread running the rounds."""

    def put(self, event: TokenEvent) -> None: ...


class Inbox:
    """A sink for one client: its requests' events in order, and which of them are still live."""

    def __init__(self):
        self.events: collections.deque[TokenEvent] = collections.deque()
        self.live: set[str] = set()

    def put(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason:
            self.live.discard(event.request_id)

    def submit(self, engine: "Engine", request: Request) -> None:
        """``engine.submit(request, self)``, counting the request live here first (its events may
        come before submit returns, from a round in another thread)."""
        rid = getattr(request, "request_id", None)
        fresh = isinstance(rid, str) and rid not in self.live
        if fresh:
            self.live.add(rid)
        try:
            engine.submit(request, self)
        except BaseException:
            if fresh:
                self.live.discard(rid)
            raise


@dataclasses.dataclass
class Call:
    """A device call in flight: its ``output`` (device arrays, read once the next round's calls are
    dispatched), the requests of its rows by column, those it samples a structured output's token
    of (their ``unread`` counts it), and what reading it needs: a scoring prefill's
    ``PromptScores`` with each row's (first prompt position, length); a decode call's index and
    the positions each of its rows may advance at most."""

    output: object
    rows: dict[int, RequestState]
    sampled: list[RequestState]
    scores: Optional[tuple] = None
    decode_call: Optional[int] = None
    bounds: Optional[dict[int, int]] = None


class Engine:
    """The rounds over one model's device state: ``scheduler`` (requests, slots, KV blocks: each
    round's plan), ``executor`` (the device state and the jitted steps), ``outputs`` (tokens to
    events), and ``prepare`` (checks a request and returns its prompt ids)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, outputs: OutputProcessor,
                 prepare: Callable[[Request], list[int]]):
        self.scheduler, self.executor, self.outputs, self.prepare = scheduler, executor, outputs, prepare
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Sink] = {}  # submitted and not yet ended, by id (guarded by _ids)
        self._ids = threading.Lock()
        self._round_lock = threading.Lock()  # one thread runs rounds at a time
        self._changed = threading.Condition()  # notified after every round and command
        self._in_flight: list[Call] = []  # dispatched, not read yet
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.broadcast = False  # several processes: process 0's commands go to all (see above)
        self._stopped = False  # a follower saw process 0 stop

    # ---- what clients call, from any thread ----------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        """Queue ``request``; its events go to ``sink``. A bad request (or an id already live)
        raises ``ValueError`` here, and nothing else changes."""
        ids = self.prepare(request)
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
        return self.scheduler.free_slots() - len(self.scheduler.waiting) - self._commands.qsize()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests now: in slots, and submitted but not yet in one."""
        with self._ids:
            live = len(self._live)
        running = len(self.scheduler.running())
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
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
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
            raise RuntimeError("follow() is for processes other than 0 of a broadcasting engine")
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

    def compile(self, score_prompts: bool, cache: Optional[str] = None, startup=None) -> dict:
        """Compile every variant the scheduler can ask the executor for (``Executor.compile``): its
        prefill shapes (the scoring ones with ``score_prompts``), its decode calls' KV lengths and
        steps, plain and, if requests may speculate, speculative; each loaded from the store in
        ``cache`` (``runner.executables``) where it holds it. Returns how many were loaded and
        compiled."""
        prefills, decodes = self.variants(score_prompts)
        return self.executor.compile(prefills, decodes, self.executor.store(cache), startup)

    def on_demand(self, cache: Optional[str] = None) -> None:
        """Serve without the warm-up: each variant compiled (or loaded from the store in ``cache``)
        the first time a round calls it (``Executor.on_demand``), so a caller that uses a few
        shapes (a test, a one-off script) compiles those alone."""
        self.executor.on_demand(self.executor.store(cache), self.variants(False)[1])

    def variants(self, score_prompts: bool) -> tuple[list, list]:
        """The prefill shapes and decode calls the scheduler can ask the executor for
        (``serving_variants``)."""
        return serving_variants(self.scheduler, score_prompts)

    # ---- one round: plan -> execute -> update ----------------------------------------------------
    def _round(self) -> None:
        self._apply_commands()
        ready, self._in_flight = self._in_flight, []
        if self.scheduler.free_slots() or self.scheduler.only_constrained():
            # A slot is free, so a request arriving now could start at once: read the calls in
            # flight first, and plan this round after them. With every slot taken nothing new can
            # start, and this round is dispatched before they are read, so the device never waits
            # for the host (measured at 1 request/s: TTFT p50 297 -> 235 ms; BENCHMARKS.md). A
            # structured output's next mask needs its last token read: when every slot holds one,
            # reading first lets each take a token a call; beside free requests they keep the
            # pipeline, and a structured output whose last token is unread waits a call
            # (``OutputProcessor.masks``).
            if not self._update(ready):
                return
            ready = []
            self._apply_commands()
        try:
            self._execute(self.scheduler.schedule())
        except Exception as e:  # a device call failed: its outputs, and the state, are lost
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        # The previous round's outputs (when every slot is taken), read once this round's calls
        # are queued behind them.
        self._update(ready)

    def _execute(self, plan: RoundPlan) -> None:
        """Dispatch the plan's calls: its prefill, then its forks, then its decode call."""
        if plan.prefill:
            self._execute_prefill(plan)
        if plan.decode:
            mask, stepping = self.outputs.masks(plan.decode, self.executor.host_mask)
            out = self.executor.sample_step(plan.decode_kv_len, plan.decode_steps, mask, plan.decode_speculative)
            self._in_flight.append(Call(out, {s.slot: s for s in plan.decode}, stepping,
                                        decode_call=plan.decode_call, bounds=plan.decode_bounds))

    def _execute_prefill(self, plan: RoundPlan) -> None:
        """The plan's prefill call, then its forks. A request whose row cannot be made (its
        detokenizer, a host-side bug) ends alone, its row left as padding."""
        batch = self.executor.empty_batch(plan.rows, plan.bucket)
        rows = {}
        for i, row in enumerate(plan.prefill):
            try:
                self._make_row(batch, i, row)
            except Exception as e:
                self.scheduler.row_dropped(batch.save[i])
                padding = self.executor.empty_batch(1, 1)
                for name in ("slots", "lengths", "cached", "last", "first", "save"):
                    getattr(batch, name)[i] = getattr(padding, name)[0]
                self._end_failed(row.sequence, 0, e, release=False)
                continue
            rows[i] = row.sequence
        out, logits, scores = self.executor.prefill_memory(batch, plan.score)
        self.scheduler.prefill_dispatched()  # the blocks it writes: later calls may read them
        chunks = {i: (plan.prefill[i].start, plan.prefill[i].length) for i in rows}
        sampled = [s for i, s in rows.items() if batch.masked[i]]  # a request's first token is its row's sample
        self._in_flight.append(Call(out, rows, sampled, None if scores is None else (scores, chunks)))
        for fork in plan.forks:
            sequence, leader = fork.sequence, plan.prefill[fork.row].sequence
            if leader.finished:  # the leader's row was not computed: the copy prefills itself
                self.scheduler.unfork(sequence)
                continue
            if sequence.scored:  # its leader's scores, complete when its first token is read
                sequence.scores = leader.scores
            one = self.executor.empty_batch(1, 1)
            one.first[0] = one.last[0] = True
            try:
                self.outputs.start(sequence)
                request_row(one, 0, sequence, self.outputs.eos_token)
                self.outputs.first_mask(one, 0, sequence)
                self._admitted(sequence, True)
            except Exception as e:
                self._end_failed(sequence, 0, e, release=False)
                continue
            out = self.executor.fork(logits, fork.row, leader.slot, one)
            self._in_flight.append(Call(out, {0: sequence}, [sequence] if one.masked[0] else []))

    def _make_row(self, batch, i: int, row: PrefillRow) -> None:
        """Row ``i`` of ``batch``: ``row``'s chunk (packed at its offset), its first mask, and the
        prefix blocks it saves."""
        first = row.start == row.sequence.cached
        if first:
            self.outputs.start(row.sequence)
        prefill_row(batch, i, row, self.outputs.eos_token)
        self.outputs.first_mask(batch, i, row.sequence)
        for block, index in self.scheduler.saves(row):  # last: nothing can fail after it
            batch.save[i, block] = index
        self._admitted(row.sequence, first)

    @staticmethod
    def _admitted(sequence: RequestState, first: bool) -> None:
        """Its sink told that it left the queue (a sink may time its request's wait)."""
        admitted = getattr(sequence.sink, "admitted", None)
        if first and admitted is not None:
            admitted()

    def _update(self, calls: list[Call]) -> bool:
        """Read ``calls`` one at a time, so a prefill's first tokens go out when it ends, not after
        the decode call that follows it; fold each into the scheduler and into events. False if a
        device call failed (every request it served has ended)."""
        for call in calls:
            try:
                out, scores = jax.device_get((call.output, call.scores))
            except Exception as e:
                self._fail_all(f"{type(e).__name__}: {e}")
                return False
            if scores is not None:
                self.outputs.scores(*scores, call.rows)
            if call.decode_call is not None:
                self.scheduler.update_from_decode(call.decode_call, call.bounds, out, call.rows)
            self._emit(out, call.rows)
            for sequence in call.sampled:
                sequence.unread -= 1
        return True

    def _emit(self, out, rows: dict[int, RequestState]) -> None:
        """One call's tokens as events. Every row is read, whatever one request's event does."""
        for step in range(out.valid.shape[0]):
            for column, sequence in rows.items():
                if not out.valid[step, column] or sequence.finished:
                    continue
                try:
                    event, grammar_done = self.outputs.token(sequence, out, step, column)
                except Exception as e:
                    self._end_failed(sequence, sequence.generated, e)
                    continue
                if event.finish_reason is not None:
                    self._free(sequence, release=grammar_done)  # the device stopped it itself, unless the grammar did
                    self._end(sequence.sink, event)
                else:
                    sequence.sink.put(event)

    # ---- commands ------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if self.broadcast:
            commands = broadcast(commands)
        for command in commands:
            if command[0] == "submit":
                if isinstance(command[3], Nowhere):  # a follower's copy of process 0's request
                    with self._ids:
                        self._live[command[1].request_id] = command[3]
                self.scheduler.add(*command[1:])
            elif command[0] == "cancel":
                self._cancel(command[1])
            else:  # "stop": process 0 is done
                self._stopped = True

    def _cancel(self, request_id: str) -> None:
        sequence = self.scheduler.find(request_id)
        if sequence is None:
            return
        self._free(sequence, release=sequence.slot is not None)
        self._end(sequence.sink, self.outputs.cancelled(sequence))

    # ---- ends ----------------------------------------------------------------------------------
    def _end_failed(self, sequence: RequestState, index: int, error: Exception, release: bool = True) -> None:
        """``sequence``'s request failed on its own: it ends alone, with an error event."""
        self._free(sequence, release=release)
        event = self.outputs.error(sequence.request, index, error)
        log.warning("request %s failed: %s", sequence.request.request_id, event.error)
        self._end(sequence.sink, event)

    def _fail_all(self, message: str) -> None:
        log.error("a device call failed; ending every request it served: %s", message)
        for sequence in self.scheduler.state_lost():
            self._end(sequence.sink, self.outputs.error(sequence.request, sequence.generated, message))
        self._in_flight = []
        self.executor.reset()

    def _end(self, sink: Sink, event: TokenEvent) -> None:
        """Deliver a request's last event; its id is free for a new request from then on."""
        with self._ids:
            self._live.pop(event.request_id, None)
        sink.put(event)

    def _free(self, sequence: RequestState, release: bool = True) -> None:
        """End ``sequence`` in the scheduler; with ``release`` its slot also stops on the device."""
        slot = sequence.slot if sequence in self.scheduler.running() else None
        self.scheduler.finish(sequence)
        if release and slot is not None:
            self.executor.release(slot)


def serving_variants(scheduler, score_prompts: bool) -> tuple[list, list]:
    """The prefill calls ``(rows, bucket, score)`` and decode calls ``(KV length, steps,
    speculative)`` ``scheduler`` can ask an executor for: what a server compiles before it serves
    (and ``grok-runner plan`` counts, from the same scheduler)."""
    prefills = [shape + (False,) for shape in sorted(scheduler.prefill_shapes())]
    if score_prompts:
        prefills += [shape + (True,) for shape in sorted(scheduler.prefill_shapes(score=True))]
    steps = sorted(scheduler.step_counts())
    # a plain call takes its steps as an argument: one variant a KV bucket, of the most steps
    decodes = [(kv, steps[-1], 0) for kv in scheduler.kv_buckets]
    if scheduler.speculative:
        decodes += [(kv, n, scheduler.speculative) for kv in scheduler.kv_buckets for n in steps]
    return prefills, decodes
