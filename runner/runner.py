"""``InferenceRunner``: batch slots, pad buckets, a request queue and the streaming ``run()``.

A fixed number of slots decode together. A submitted request is validated and tokenized, waits in
a FIFO queue, and when a slot is free its prompt is prefilled there (padded to the smallest
bucket that holds it; a prompt longer than the largest bucket is prefilled in chunks, never
truncated). Every round then runs one decode step for all slots and streams one ``TokenEvent`` per
generated token; a request that ends (EOS, a stop token, ``max_len`` or cancellation) frees its
slot for the next waiting request while the others keep decoding.

The host reads a step's tokens only after the next step has been dispatched, so the device never
waits for the host (one step of pipelining, as the reference); a slot that finished meanwhile
simply has that extra step's output ignored.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import zlib
from typing import Iterable, Optional, Sequence

import jax
import numpy as np

from model.sharding import make_mesh
from runner.engine import MAX_STOP_IDS, DecodeOutput, ModelRunner
from runner.requests import Request, TokenEvent
from runner.tokenizer import IncrementalDetokenizer, Tokenizer


def default_seed(request: Request) -> int:
    """The seed of a request that names none: derived from its id, so every process of a
    multi-host run draws the same tokens (each runs the same scheduler on the same requests)."""
    return zlib.crc32(request.request_id.encode())


def default_pad_sizes(sequence_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of four from ``smallest`` up to ``sequence_len`` (itself included): a prompt is padded
    by at most 4x, and there are few buckets to compile at start-up."""
    sizes, size = [], smallest
    while size < sequence_len:
        sizes.append(size)
        size *= 4
    return tuple(sizes) + (sequence_len,)


def _smallest_at_least(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the sorted ``sizes`` that is >= ``n``, else the largest."""
    return next((size for size in sizes if size >= n), sizes[-1])


def default_kv_buckets(sequence_len: int) -> tuple[int, ...]:
    """KV lengths a decode step may attend over: powers of four from 64, and ``sequence_len``."""
    return default_pad_sizes(sequence_len, smallest=min(64, sequence_len))


@dataclasses.dataclass(eq=False)
class _Slot:
    """A request occupying a batch slot."""

    request: Request
    prompt_ids: list[int]
    detokenizer: Optional[IncrementalDetokenizer]
    position: int  # an upper bound on the slot's next cache position (the host lags the device)
    generated: int = 0
    finished: bool = False


@dataclasses.dataclass
class Completion:
    request: Request
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str


@dataclasses.dataclass
class InferenceRunner:
    """Serves a model: ``initialize()`` once, then ``run()`` (or ``generate``/``sample_from_model``).

    The fields keep Grok-1's names: ``runner`` (a ``ModelRunner``), ``tokenizer_path``,
    ``local_mesh_config`` x ``between_hosts_config`` (the mesh shape, if ``mesh`` is not given),
    ``pad_sizes``. ``batch_size`` defaults to ``runner.bs_per_device`` x devices.
    """

    runner: ModelRunner
    name: str = "local"
    load: Optional[str] = None  # the reference's field; the checkpoint is runner.checkpoint_path
    tokenizer_path: Optional[str] = None
    local_mesh_config: tuple[int, int] = (1, 1)
    between_hosts_config: tuple[int, int] = (1, 1)
    pad_sizes: Optional[Sequence[int]] = None
    batch_size: Optional[int] = None
    mesh: Optional[jax.sharding.Mesh] = None
    # Decode steps per device call: more amortises host dispatch, fewer streams tokens sooner
    # and lets a waiting request into a freed slot sooner.
    decode_steps: int = 4

    def initialize(self, warmup: bool = True) -> None:
        mesh = self.mesh or self.runner.mesh
        if mesh is None:
            shape = tuple(a * b for a, b in zip(self.local_mesh_config, self.between_hosts_config))
            devices = jax.devices()[: shape[0] * shape[1]]
            mesh = make_mesh(shape, devices)
        self.runner.initialize(mesh, self.batch_size)
        self.mesh, self.config = self.runner.mesh, self.runner.model
        self.batch_size = self.runner.batch_size
        self.pad_sizes = self._check_pad_sizes(self.pad_sizes)
        self.kv_buckets = default_kv_buckets(self.config.sequence_len)
        if not isinstance(self.decode_steps, int) or self.decode_steps <= 0:
            raise ValueError(f"decode_steps must be a positive integer, got {self.decode_steps!r}")
        path = self.tokenizer_path or self.runner.tokenizer_path
        self.tokenizer = Tokenizer(path) if path is not None else None
        if self.tokenizer is not None and self.tokenizer.vocab_size != self.config.vocab_size:
            raise ValueError(f"tokenizer {path} has {self.tokenizer.vocab_size} pieces but the model's "
                             f"vocab_size is {self.config.vocab_size}")
        self.state = self.runner.new_state()
        if warmup:
            self._warmup()

    def _check_pad_sizes(self, pad_sizes) -> tuple[int, ...]:
        s = self.config.sequence_len
        if pad_sizes is None:
            return default_pad_sizes(s)
        sizes = tuple(pad_sizes)
        if not sizes or any(not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not 0 < p <= s
                            for p in sizes):
            raise ValueError(f"pad_sizes must be positive integers <= sequence_len ({s}), got {pad_sizes!r}")
        return tuple(sorted(set(int(p) for p in sizes)))

    def _warmup(self) -> None:
        """Compile every function for every bucket now, so serving never compiles.

        Each variant is traced here, then all are compiled side by side on the host's cores
        (XLA compiles without the GIL); the calls that follow find them compiled.
        """
        dummy = Request([1], temperature=1.0, max_len=2)
        prefills = [(np.ones((bucket,), np.int32), True, bucket) for bucket in self.pad_sizes]
        if self.pad_sizes[-1] < self.config.sequence_len:  # continuation chunks of long prompts
            prefills.append((np.ones((self.pad_sizes[-1],), np.int32), False, self.config.sequence_len))
        lowered = [self.runner.prefill_memory.variant(kv_len=kv_len).lower(
            *self._prefill_args(0, chunk, 1, reset, dummy, 0)) for chunk, reset, kv_len in prefills]
        lowered += [self.runner.sample_step.variant(kv_len=kv_len, steps=self.decode_steps).lower(
            self.runner.params, self.state) for kv_len in self.kv_buckets]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda low: low.compile(), lowered))
        for chunk, reset, kv_len in prefills:
            self.state, _ = self._prefill(0, chunk, 1, reset, dummy, 0, kv_len)
        for kv_len in self.kv_buckets:
            self.state, out = self.runner.sample_step(self.runner.params, self.state, kv_len=kv_len,
                                                      steps=self.decode_steps)
        self.state = self.runner.release_slot(self.state, np.int32(0))
        jax.block_until_ready((self.state, out))

    # ---- requests ------------------------------------------------------------------------------
    def prepare(self, request: Request) -> list[int]:
        """Check ``request`` against this model and return its prompt ids; ``ValueError`` if bad."""
        if not isinstance(request, Request):
            raise ValueError(f"expected a Request, got {type(request).__name__}")
        if isinstance(request.prompt, str):
            if self.tokenizer is None:
                raise ValueError("Request.prompt is text but this runner has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(request.prompt)
            if not ids:
                raise ValueError(f"Request.prompt {request.prompt!r} encodes to no tokens")
        else:
            ids = list(request.prompt)
        v = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"Request.prompt has token ids outside [0, {v}): {bad[:5]}")
        bad = [t for t in request.stop_token_ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"Request.stop_token_ids has ids outside [0, {v}): {bad[:5]}")
        if len(set(request.stop_token_ids) - {self.config.eos_token}) > MAX_STOP_IDS - 1:
            raise ValueError(f"Request.stop_token_ids: at most {MAX_STOP_IDS - 1} stop tokens, "
                             f"got {len(request.stop_token_ids)}")
        total = len(ids) + request.max_len
        if total > self.config.sequence_len:
            raise ValueError(f"Request.max_len: the prompt ({len(ids)} tokens) plus max_len "
                             f"({request.max_len}) is {total}, more than sequence_len "
                             f"({self.config.sequence_len})")
        return ids

    def run(self, requests: Optional[Iterable[Request]] = None) -> "RunStream":
        """Stream ``TokenEvent``s for ``requests`` (an iterable, pulled as slots free up), and for any
        request ``send()``/``submit()``ted to the returned stream.

        With ``requests`` the stream ends when all are done; without, it is a server: ``next()``
        returns None whenever it is idle, like the reference's generator (prime it with ``next``).
        """
        return RunStream(self, requests)

    def generate(self, prompts: Sequence, **settings) -> list[Completion]:
        """Complete every prompt (text or ids) with the same settings; results in prompt order."""
        requests = [p if isinstance(p, Request) else Request(p, **settings) for p in prompts]
        for r in requests:
            self.prepare(r)  # every request is checked before any runs
        results = {r.request_id: Completion(r, [], "", [], "") for r in requests}
        for event in self.run(requests):
            done = results[event.request_id]
            if event.token_id is not None:
                done.token_ids.append(event.token_id)
                done.logprobs.append(event.logprob)
            done.text += event.text
            if event.finish_reason:
                done.finish_reason = event.finish_reason
        return [results[r.request_id] for r in requests]

    # ---- device calls ----------------------------------------------------------------------------
    def _prefill(self, slot: int, chunk: np.ndarray, length: int, reset: bool, request: Request, seed: int,
                 kv_len: int):
        return self.runner.prefill_memory(*self._prefill_args(slot, chunk, length, reset, request, seed),
                                          kv_len=kv_len)

    def _prefill_args(self, slot: int, chunk: np.ndarray, length: int, reset: bool, request: Request, seed: int):
        stop = [self.config.eos_token] + sorted(set(request.stop_token_ids) - {self.config.eos_token})
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop_ids[: len(stop)] = stop
        return (self.runner.params, self.state, np.int32(slot), chunk[None].astype(np.int32),
                np.int32(length), np.bool_(reset), np.float32(request.temperature),
                np.float32(request.nucleus_p), np.int32(request.top_k), np.uint32(seed),
                np.int32(request.max_len), stop_ids)

    def kv_bucket_for(self, length: int) -> int:
        return _smallest_at_least(self.kv_buckets, length)

    def bucket_for(self, length: int) -> int:
        return _smallest_at_least(self.pad_sizes, length)

    def prefill_chunks(self, ids: list[int]) -> list[tuple[np.ndarray, int, int]]:
        """The prompt as (padded chunk, real length, kv_len) triples: the first chunk in the
        smallest bucket that holds it (attending over that bucket), the rest of a long prompt in
        largest-bucket chunks attending over the whole memory."""
        largest, chunks = self.pad_sizes[-1], []
        for start in range(0, len(ids), largest):
            part = ids[start:start + largest]
            size = self.bucket_for(len(part)) if start == 0 else largest
            padded = np.zeros((size,), np.int32)
            padded[: len(part)] = part
            chunks.append((padded, len(part), size if start == 0 else self.config.sequence_len))
        return chunks


class RunStream:
    """The iterator ``run()`` returns: a generator-compatible stream of ``TokenEvent``s."""

    def __init__(self, runner: InferenceRunner, requests: Optional[Iterable[Request]]):
        self.runner = runner
        self._source = iter(requests) if requests is not None else None
        self._queue: collections.deque[tuple[Request, list[int]]] = collections.deque()
        self._slots: list[Optional[_Slot]] = [None] * runner.batch_size
        self._pending: list[tuple[object, list[tuple[int, _Slot]]]] = []
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._cancelled: set[str] = set()

    # ---- the generator protocol -----------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Optional[TokenEvent]:
        while not self._events:
            self._pull()
            if self._idle():
                if self._source is None:
                    return None  # server mode: nothing to do until a request is sent
                raise StopIteration
            self._round()
        return self._events.popleft()

    def send(self, request: Optional[Request]) -> Optional[TokenEvent]:
        if request is not None:
            self.submit(request)
        return next(self)

    def close(self) -> None:
        for request, _ in list(self._queue):
            self.cancel(request.request_id)
        for slot in self._slots:
            if slot is not None:
                self.cancel(slot.request.request_id)
        self._source = iter(())

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request``; a bad one raises ``ValueError`` here and disturbs nothing."""
        ids = self.runner.prepare(request)
        self._queue.append((request, ids))
        return request

    def cancel(self, request_id: str) -> bool:
        """End a waiting or running request now; its last event has finish_reason 'cancelled'."""
        for i, (request, _) in enumerate(self._queue):
            if request.request_id == request_id:
                del self._queue[i]
                self._events.append(TokenEvent(request, 0, None, "", 0.0, (), "cancelled"))
                return True
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request.request_id == request_id and not slot.finished:
                self._finish(index, slot)
                self._events.append(TokenEvent(slot.request, slot.generated, None, self._flush(slot),
                                               0.0, (), "cancelled"))
                return True
        return False

    def _pull(self) -> None:
        """Top the queue up from the source iterable while slots are free."""
        free = sum(s is None for s in self._slots)
        while self._source is not None and len(self._queue) < free:
            request = next(self._source, None)
            if request is None:
                self._source = iter(())
                return
            self.submit(request)

    def _idle(self) -> bool:
        return not self._queue and not self._pending and all(s is None for s in self._slots)

    # ---- one round: admit, decode, read back ---------------------------------------------------------
    def _round(self) -> None:
        r = self.runner
        ready = self._pending
        self._pending = []
        self._admit()
        active = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.finished]
        if active:
            steps = r.decode_steps
            kv_len = r.kv_bucket_for(max(s.position for _, s in active) + steps)
            r.state, out = r.runner.sample_step(r.runner.params, r.state, kv_len=kv_len, steps=steps)
            for _, s in active:
                s.position += steps
            self._pending.append((out, active))
        self._read(ready)

    def _admit(self) -> None:
        r = self.runner
        while self._queue and None in self._slots:
            request, ids = self._queue.popleft()
            index = self._slots.index(None)
            seed = request.rng_seed if request.rng_seed is not None else default_seed(request)
            out = None
            for n, (chunk, length, kv_len) in enumerate(r.prefill_chunks(ids)):
                r.state, out = r._prefill(index, chunk, length, n == 0, request, seed, kv_len)
            detok = IncrementalDetokenizer(r.tokenizer, ids) if r.tokenizer is not None else None
            slot = _Slot(request, ids, detok, position=len(ids))
            self._slots[index] = slot
            self._pending.append((out, [(0, slot)]))  # the first token is row 0 of the prefill output

    def _read(self, ready) -> None:
        """Turn device outputs into events: one host sync per call, after the next is dispatched."""
        for out, rows in jax.device_get(ready):
            if isinstance(out, DecodeOutput):
                sample, valid = out.sample, out.valid
            else:  # a prefill's first token: one step, row 0
                sample = jax.tree_util.tree_map(lambda a: a[None], out)
                valid = np.ones((1, len(rows)), bool)
            for step in range(valid.shape[0]):
                for row, slot in rows:
                    if valid[step, row] and not slot.finished:
                        self._emit(slot, sample, step, row)

    def _emit(self, slot: _Slot, sample, step: int, row: int) -> None:
        # The same rule ends the request on the device (engine.sample_step), so both agree.
        token = int(sample.token_id[step, row])
        slot.generated += 1
        request = slot.request
        reason = ("eos" if token == self.runner.config.eos_token else "stop" if token in request.stop_token_ids
                  else "length" if slot.generated >= request.max_len else None)
        text = "" if reason in ("eos", "stop") or slot.detokenizer is None else slot.detokenizer.add(token)
        if reason is not None:
            self._finish(self._slots.index(slot), slot, release=False)  # the device stopped it itself
            text += self._flush(slot)
        top = tuple(zip(sample.top_k_token_ids[step, row].tolist(), sample.top_k_probs[step, row].tolist()))
        self._events.append(TokenEvent(request, slot.generated - 1, token, text,
                                       float(sample.logprob[step, row]), top, reason))

    def _finish(self, index: int, slot: _Slot, release: bool = True) -> None:
        slot.finished = True
        self._slots[index] = None
        if release:
            r = self.runner
            r.state = r.runner.release_slot(r.state, np.int32(index))

    @staticmethod
    def _flush(slot: _Slot) -> str:
        return slot.detokenizer.flush() if slot.detokenizer is not None else ""


def sample_from_model(server: RunStream, prompt, max_len: int, temperature: float) -> str:
    """Grok-1's helper: complete ``prompt`` with nucleus_p 1 and seed 42; returns the text."""
    request = Request(prompt, temperature=temperature, nucleus_p=1.0, rng_seed=42, max_len=max_len)
    server.submit(request)
    pieces = []
    while True:
        event = next(server)
        if event is None:
            raise RuntimeError("the runner went idle before the request finished")
        if event.request is request:
            pieces.append(event.text)
            if event.finish_reason:
                return "".join(pieces)


DEFAULT_MODEL = "austen-moe"  # checkpoints/austen-moe: the small trained model the project ships


def default_checkpoint() -> Optional[str]:
    """The shipped default model's directory, if it exists."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "checkpoints", DEFAULT_MODEL)
    return path if os.path.exists(os.path.join(path, "config.json")) else None
