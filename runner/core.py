"""``EngineCore``: the rounds over a runner's device state, the only code that changes it (through
the ``ModelRunner`` that holds it).

Each round: apply the submissions and cancellations that clients queued, ask the ``Scheduler``
(``runner/scheduler.py``) for the round's plan, dispatch it (one prefill call holding the prompt
chunks of several requests, then one decode call for every decoding slot), then turn the
previous calls' outputs into ``TokenEvent``s, each delivered to its own request's client. The host reads a
call's tokens only after the next round's calls were dispatched (pipelining, as the reference),
so the device never waits for the host; it reads them call by call, so a request's first token
leaves when its prefill call ends.

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
from typing import Callable, Optional, Protocol

import jax
import numpy as np

from runner.requests import PromptLogprob, Request, RequestError, Speculation, TokenEvent
from runner.scheduler import RoundPlan, Scheduler, Sequence, finish_reason, prefill_row, request_row
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


class EngineCore:
    """The rounds over one model's device state: ``model`` (a ``ModelRunner``: the state and the
    jitted steps), ``scheduler`` (the requests and slots, and each round's plan), ``prepare``
    (checks a request and returns its prompt ids) and ``tokenizer`` (None: no text)."""

    def __init__(self, model, scheduler: Scheduler, prepare: Callable[[Request], list[int]], tokenizer=None,
                 grammar_of: Optional[Callable[[Request], object]] = None):
        self.model, self.scheduler, self.prepare, self.tokenizer = model, scheduler, prepare, tokenizer
        self.grammar_of = grammar_of  # a request's compiled JSON grammar (Request.json_schema)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Sink] = {}  # submitted and not yet ended, by id (guarded by _ids)
        self._ids = threading.Lock()
        self._round_lock = threading.Lock()  # one thread runs rounds at a time
        self._changed = threading.Condition()  # notified after every round and command
        # outputs not read yet: (a call's output, its columns' sequences, a scoring prefill's
        # PromptScores with each row's first prompt position or None, the structured outputs it
        # samples a token of: their ``unread`` counts it, and for a decode call the positions each
        # row may advance at most with the call's index, else None)
        self._pending: list[tuple[object, dict[int, Sequence], Optional[tuple], list[Sequence], Optional[dict]]] = []
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
        if self.scheduler.free_slots() or self._only_constrained():
            # A slot is free, so a request arriving now could start at once: read the calls in
            # flight first, and plan this round after them. With every slot taken nothing new can
            # start, and this round is dispatched before they are read, so the device never waits
            # for the host (measured at 1 request/s: TTFT p50 297 -> 235 ms; BENCHMARKS.md). A
            # structured output's next mask needs its last token read: when every slot holds one,
            # reading first lets each take a token a call; beside free requests they keep the
            # pipeline, and a structured output whose last token is unread waits a call (``_masks``).
            if not self._read_all(ready):
                return
            ready = []
            self._apply_commands()
        try:
            plan = self.scheduler.schedule()
            if plan.prefill:
                self._dispatch_prefill(plan)
            if plan.decode:
                mask, stepping = self._masks(plan.decode)
                out = self.model.run_decode(plan.decode_kv_len, plan.decode_steps, mask, plan.decode_speculative)
                self._pending.append((out, {s.slot: s for s in plan.decode}, None, stepping,
                                      (plan.decode_bounds, plan.decode_call)))
        except Exception as e:  # a device call failed: its outputs, and the state, are lost
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        # The previous round's outputs (when every slot is taken), read once this round's calls
        # are queued behind them.
        self._read_all(ready)

    def _only_constrained(self) -> bool:
        running = self.scheduler.running()
        return bool(running) and all(s.matcher is not None for s in running)

    def _masks(self, decoding: list[Sequence]):
        """The decode call's ``TokenMask`` (host arrays; None if no row has a grammar) and the
        structured outputs it samples: each whose tokens are all read takes one step under its
        grammar's mask of allowed next tokens; one with a token still in flight is held."""
        constrained = [s for s in decoding if s.matcher is not None]
        if not constrained:
            return None, []
        from runner.grammar import fill_masks

        mask = self.model.host_mask()
        stepping = [s for s in constrained if not s.unread]
        if stepping:
            fill_masks([(s.slot, s.matcher) for s in stepping], mask.words)
        mask.on[[s.slot for s in stepping]] = True
        mask.hold[[s.slot for s in constrained if s.unread]] = True
        for s in stepping:
            s.unread += 1
        return mask, stepping

    def _read_all(self, ready) -> bool:
        """Read ``ready`` (dispatched calls' outputs) one call at a time, so a prefill's first
        tokens go out when it ends, not after the decode call that follows it. False if a device
        call failed (every request it served has ended)."""
        for out, columns, scoring, sampled, bounds in ready:
            try:
                out, scoring = jax.device_get((out, scoring))
            except Exception as e:
                self._fail_all(f"{type(e).__name__}: {e}")
                return False
            if scoring is not None:
                self._read_scores(*scoring, columns)
            if bounds is not None:
                self._read_decode(out, columns, *bounds)
            self._read(out, columns)
            for sequence in sampled:
                sequence.unread -= 1
        return True

    def _dispatch_prefill(self, plan: RoundPlan) -> None:
        """The plan's prefill call, then its forks. A request whose row cannot be made (its
        detokenizer, a host-side bug) ends alone, its row left as padding."""
        scheduler = self.scheduler
        batch = scheduler.empty_batch(plan.rows, plan.bucket)
        columns = {}
        for i, row in enumerate(plan.prefill):
            def make_row(i=i, row=row):
                prefill_row(batch, i, row, scheduler.eos_token)
                self._first_mask(batch, i, row.sequence)
                for block, index in scheduler.saves(row):  # last: nothing can fail after it
                    batch.save[i, block] = index

            try:
                self._starting(row.sequence, row.start == row.sequence.cached, make_row)
            except Exception as e:
                if scheduler.prefix is not None:  # blocks it may have taken are never written
                    scheduler.prefix.drop(batch.save[i][batch.save[i] < scheduler.pool_blocks].tolist())
                    batch.save[i] = scheduler.pool_blocks
                batch.slots[i] = self.scheduler.batch_size
                batch.lengths[i] = 0
                batch.cached[i] = 0
                batch.last[i] = batch.reset[i] = False
                self._free(row.sequence, release=False)
                self._error(row.sequence.request, row.sequence.sink, 0, e)
                continue
            columns[i] = row.sequence
        out, logits, scores = self.model.run_prefill(batch, plan.prefill_kv_len, plan.score)
        if scheduler.prefix is not None:  # the blocks it writes: later calls may read them
            scheduler.prefix.commit()
        chunks = {i: (plan.prefill[i].start, plan.prefill[i].length) for i in columns}
        # a request's first token is its row's sample
        sampled = [s for i, s in columns.items() if batch.masked[i]]
        self._pending.append((out, columns, None if scores is None else (scores, chunks), sampled, None))
        for fork in plan.forks:
            sequence, leader = fork.sequence, plan.prefill[fork.row].sequence
            if leader.finished:  # the leader's row was not computed: the copy prefills itself
                self.scheduler.unfork(sequence)
                continue
            if sequence.scored:  # its leader's scores, complete when its first token is read
                sequence.scores = leader.scores
            one = scheduler.empty_batch(1, 1)
            one.reset[0] = one.last[0] = True
            try:
                def make_one(sequence=sequence):
                    request_row(one, 0, sequence, self.scheduler.eos_token)
                    self._first_mask(one, 0, sequence)

                self._starting(sequence, True, make_one)
            except Exception as e:
                self._free(sequence, release=False)
                self._error(sequence.request, sequence.sink, 0, e)
                continue
            self._pending.append((self.model.run_fork(logits, fork.row, leader.slot, one), {0: sequence}, None,
                                  [sequence] if one.masked[0] else [], None))

    @staticmethod
    def _first_mask(batch, i: int, sequence: Sequence) -> None:
        """Row ``i``'s mask: a structured output's first token, where its last chunk samples it."""
        if sequence.matcher is not None and batch.last[i]:
            sequence.matcher.fill_mask(batch.mask[i])
            batch.masked[i] = True
            sequence.unread += 1

    def _starting(self, sequence: Sequence, first: bool, make_row: Callable[[], None]) -> None:
        """Before ``sequence``'s row is dispatched: on its first chunk its detokenizer and its
        grammar's matcher, and its sink told that it left the queue."""
        if first and sequence.request.json_schema is not None:
            from runner.grammar import Matcher

            sequence.matcher = Matcher(self.grammar_of(sequence.request))
        if first:
            sequence.detokenizer = (IncrementalDetokenizer(self.tokenizer, sequence.ids, skip_special_tokens=
                                                           sequence.request.skip_special_tokens)
                                    if self.tokenizer is not None else None)
        make_row()
        admitted = getattr(sequence.sink, "admitted", None)  # a sink may time its request's wait
        if first and admitted is not None:
            admitted()

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
                self.scheduler.add(*command[1:])
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
        sequence = self.scheduler.find(request_id)
        if sequence is None:
            return
        self._free(sequence, release=sequence.slot is not None)
        self._end(sequence.sink, TokenEvent(sequence.request, sequence.generated, None, self._flush(sequence),
                                            0.0, (), "cancelled"))

    def _read(self, out, columns: dict[int, Sequence]) -> None:
        """Turn one call's outputs into events. Every row is read, whatever one request's emit does."""
        for step in range(out.valid.shape[0]):
            for column, sequence in columns.items():
                if out.valid[step, column] and not sequence.finished:
                    try:
                        self._emit(sequence, out, step, column)
                    except Exception as e:
                        self._free(sequence)
                        self._error(sequence.request, sequence.sink, sequence.generated, e)

    @staticmethod
    def _read_decode(out, columns: dict[int, Sequence], bounds: dict[int, int], call: int) -> None:
        """What decode call ``call`` did for each row, before its tokens are emitted: the positions
        it was planned to advance at most become the tokens it generated (``Sequence.decode_steps``
        is exact again once read), and a speculating request's ``Speculation`` grows and whether
        its next step may draft is recorded (``Sequence.may_draft``)."""
        generated = out.valid.sum(axis=0)
        per_step = out.valid.reshape(len(out.drafted), -1, out.valid.shape[1]) if out.drafted is not None else None
        for column, sequence in columns.items():
            n = int(generated[column])
            sequence.decode_steps -= bounds[column] - n
            if not sequence.speculative:
                continue
            if out.ready is not None:
                sequence.ready = {c: r for c, r in sequence.ready.items() if c > call - 4}  # the few it may still ask for
                sequence.ready[call] = bool(out.ready[column])
                sequence.accepting = {c: a for c, a in sequence.accepting.items() if c > call - 4}
                sequence.accepting[call] = out.accepted is not None and bool(out.accepted[:, column].sum() > 0)
            was = sequence.speculation
            if out.drafted is None:  # a plain call: a token a step
                sequence.speculation = dataclasses.replace(was, steps=was.steps + n, tokens=was.tokens + n)
            else:
                sequence.speculation = Speculation(
                    steps=was.steps + int(per_step[:, :, column].any(axis=1).sum()), tokens=was.tokens + n,
                    drafted=was.drafted + int(out.drafted[:, column].sum()),
                    accepted=was.accepted + int(out.accepted[:, column].sum()))

    def _read_scores(self, scores, chunks: dict[int, tuple[int, int]], columns: dict[int, Sequence]) -> None:
        """A scoring prefill's ``PromptScores`` into each row's request: for each position of its
        chunk (``chunks``: first prompt position, length), the prompt token after it with its
        log-probability and alternatives (the chunk's last position scores the next chunk's
        first token; the prompt's last position has nothing to score)."""
        for column, sequence in columns.items():
            if sequence.finished:
                continue
            (start, length), k, ids = chunks[column], sequence.request.prompt_logprobs, sequence.ids
            if start == 0:
                sequence.scores.append(PromptLogprob(ids[0], None, ()))
            n = min(length, len(ids) - 1 - start)
            chosen = scores.logprob[column, :n].tolist()
            top_ids, top_probs = scores.top_ids[column, :n, :k].tolist(), scores.top_probs[column, :n, :k].tolist()
            sequence.scores += [PromptLogprob(ids[start + j + 1], chosen[j], tuple(zip(top_ids[j], top_probs[j])))
                                for j in range(n)]

    def _emit(self, sequence: Sequence, out, step: int, column: int) -> None:
        sample, request = out.sample, sequence.request
        token = int(sample.token_id[step, column])
        sequence.generated += 1
        # the device applied the stop rule (runner.state.ends); here it is only named
        reason = finish_reason(token, request, self.scheduler.eos_token) if out.ended[step, column] else None
        grammar_done = False
        if sequence.matcher is not None and reason != "stop":  # a stop token of the caller's ends it anywhere
            # The mask allowed this token. The matcher refuses it, or EOS before the document is
            # complete, only when the engine gave up on the schema (a limit hit in some later row
            # than TokenGrammar._probe computes): the request's own failure, never a silent end.
            if not sequence.matcher.accept(token):
                why = sequence.matcher.error or f"it refused token {token}, which its own mask allowed"
                raise RequestError("json_schema", f"the grammar engine gave up on the schema after "
                                   f"{sequence.generated - 1} tokens: {why}")
            grammar_done = reason is None and sequence.matcher.done
            reason = "stop" if grammar_done else reason  # the document is complete: the request ends here
        stopped = reason in ("eos", "stop") and not grammar_done  # a stop token's text is not part of the output
        text = "" if stopped or sequence.detokenizer is None else sequence.detokenizer.add(token)
        if reason is not None:
            text += self._flush(sequence)
        logprob, top = None, ()
        if request.logprobs is not None:  # else the call computed none for this row
            logprob = float(sample.logprob[step, column])
            k = request.logprobs
            top = tuple(zip(sample.top_k_token_ids[step, column, :k].tolist(),
                            sample.top_k_probs[step, column, :k].tolist()))
        prompt = tuple(sequence.scores) if sequence.scored and sequence.generated == 1 else None
        event = TokenEvent(request, sequence.generated - 1, token, text, logprob, top, reason,
                           prompt_logprobs=prompt, cached_tokens=sequence.cached,
                           speculation=sequence.speculation if reason is not None and sequence.speculative else None)
        if reason is not None:
            self._free(sequence, release=grammar_done)  # the device stopped it itself, unless the grammar did
            self._end(sequence.sink, event)
        else:
            sequence.sink.put(event)

    def _error(self, request: Request, sink: Sink, index: int, error: Exception) -> None:
        field = error.field if isinstance(error, RequestError) else None
        message = str(error) if field is not None else f"{type(error).__name__}: {error}"
        log.warning("request %s failed: %s", request.request_id, message)
        self._end(sink, TokenEvent(request, index, None, "", 0.0, (), "error", error=message, error_field=field))

    def _fail_all(self, message: str) -> None:
        log.error("a device call failed; ending every request it served: %s", message)
        for sequence in self.scheduler.running():
            self.scheduler.finish(sequence)
            self._end(sequence.sink, TokenEvent(sequence.request, sequence.generated, None, "", 0.0, (), "error",
                                                error=message))
        self._pending = []
        self.model.reset_state()
        if self.scheduler.prefix is not None:  # the pool was lost with the state
            self.scheduler.prefix.clear()

    def _end(self, sink: Sink, event: TokenEvent) -> None:
        """Deliver a request's last event; its id is free for a new request from then on."""
        with self._ids:
            self._live.pop(event.request_id, None)
        sink.put(event)

    def _free(self, sequence: Sequence, release: bool = True) -> None:
        """End ``sequence`` in the scheduler; with ``release`` its slot also stops on the device."""
        slot = sequence.slot if sequence in self.scheduler.running() else None
        self.scheduler.finish(sequence)
        if release and slot is not None:
            self.model.release(slot)

    @staticmethod
    def _flush(sequence: Sequence) -> str:
        return sequence.detokenizer.flush() if sequence.detokenizer is not None else ""
