"""``InferenceRunner``: a model served in batch slots with pad buckets, and its clients.

A fixed number of slots decode together. A submitted request is validated and tokenized, waits in
a FIFO queue, and once a slot is free its prompt is prefilled there in chunks of the pad buckets
(cut from its length alone, never truncated), several requests' chunks per prefill call under
the round's token budget (``runner/scheduler.py``). Every round then runs one decode call for
all slots and streams one ``TokenEvent`` per generated token; a request that ends (EOS, a stop
token, ``max_len``, cancellation or an error of its own) frees its slot for the next waiting
request while the others keep decoding.

The rounds belong to the runner's ``Engine`` (``runner/engine.py``: scheduler, executor, output
processor). The streams of ``run()``, ``generate()`` and ``sample_from_model()`` are the engine's
clients: each submits requests and reads only its own requests' events, so any number of them can
be live at once, in one thread or several, and each gets exactly the tokens it would get alone.

``InferenceRunner`` is frozen: its fields say what to serve and how (the reference runner's
names); ``initialize()`` attaches the ready ``Engine`` once."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterable, Optional, Sequence

import jax
import numpy as np

from model.sharding import make_mesh
from runner.engine import Engine, Inbox
from runner.executor import Executor
from runner.model_runner import ModelRunner
from runner.outputs import OutputProcessor
from runner.prefix_cache import PrefixCache
from runner.requests import MAX_SPECULATIVE, Request, TokenEvent
from runner.scheduler import Scheduler, chunk_lengths
from runner.startup import Startup
from runner.state import MAX_STOP_IDS
from tokenization import Tokenizer, load_tokenizer

log = logging.getLogger("grok_runner")

# Tokens a round may compute (prompt chunks + one per decoding slot) unless the runner is told
# otherwise: large enough that a chunk's time goes to its tokens, not to reading the weights;
# small enough that admitting a long prompt holds the running streams for one such chunk only.
DEFAULT_BATCHED_TOKENS = 512


def default_pad_sizes(sequence_len: int, budget: int = DEFAULT_BATCHED_TOKENS, smallest: int = 16) -> tuple[int, ...]:
    """Prompt buckets: powers of two from ``smallest`` up to the round's token budget (or
    ``sequence_len`` if shorter), which is the largest chunk a prompt is cut into. With the
    chunking (``runner.scheduler.chunk_lengths``) no prompt pads by more than an eighth of its
    length or 64 positions: a 128-token prompt is one call of 128, a 1,056-token one 512 + 512 + 32."""
    top = min(budget, sequence_len)
    sizes, size = [], smallest
    while size < top:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (top,)


def default_kv_buckets(sequence_len: int) -> tuple[int, ...]:
    """KV lengths a call may attend over: powers of four from 64, and ``sequence_len``."""
    sizes, size = [], min(64, sequence_len)
    while size < sequence_len:
        sizes.append(size)
        size *= 4
    return tuple(sizes) + (sequence_len,)


@dataclasses.dataclass
class Completion:
    request: Request
    token_ids: list[int]
    text: str
    logprobs: list[float]  # each token's log-probability, if Request.logprobs asked (else empty)
    finish_reason: str
    error: Optional[str] = None  # with finish_reason "error": what went wrong


@dataclasses.dataclass(frozen=True)
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
    # Decode steps per device call: more amortise the host's work per call, fewer stream tokens
    # sooner and let a new request in sooner (2: measured at 1 request/s on the bench config,
    # TTFT p50 429 -> 297 ms against 4, TPOT 42 -> 40 ms; BENCHMARKS.md).
    decode_steps: int = 2
    # The token budget of a round (vLLM's max_num_batched_tokens): prompt chunks are cut to
    # buckets no larger, and a round's prefill call holds at most this many positions.
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    # Whether requests may ask for prompt log-probabilities (Request.prompt_logprobs): the
    # prefill variants that score every position are compiled at start only if so (the server's
    # echo with logprobs needs them). Off by default: it adds a compiled variant per one-row shape.
    score_prompts: bool = False
    # The prefix cache (runner/prefix_cache.py): a pool of this many blocks of prefix_block_size
    # prompt positions, reused by any request whose prompt starts with the same tokens. Off (0) by
    # default here: the pool is device memory beyond the slots' own KV, which a library caller
    # sized its batch by, and its calls often share no prefix; ``serve`` turns it on (run.py).
    # "auto": as many blocks as the slots hold positions (batch_size x sequence_len), doubling the KV.
    prefix_cache_blocks: int | str = 0
    prefix_cache_bytes: int = 0  # or a pool of as many blocks as this many bytes hold
    prefix_block_size: int = 16
    # Speculative decoding by n-gram lookup (runner/speculative.py): the most draft tokens a step
    # may verify, and each request's default (``Request.speculative``: a request may ask for
    # fewer, or 0). Its decode variants are compiled at start only if > 0. Off (0) by default:
    # BENCHMARKS.md measures where it helps.
    speculative: int = 0
    # A directory of compiled steps (``runner.executables``): a start loads each variant it
    # holds instead of tracing and compiling it, and stores the ones it compiles (without the
    # warm-up, each as it is first called). Default: $GROK_RUNNER_COMPILE_CACHE, else None (off);
    # the variable gives every runner of a program (or of the test suite) one store.
    compile_cache: Optional[str] = dataclasses.field(
        default_factory=lambda: os.environ.get("GROK_RUNNER_COMPILE_CACHE") or None)

    def initialize(self, warmup: bool = True, startup: Optional[Startup] = None) -> "InferenceRunner":
        """Make it ready to serve (the reference's call): restore the model onto the mesh, build the
        engine (``Engine``: scheduler, executor, output processor) and, with ``warmup``, compile
        every variant the scheduler can ask for (or load it from ``compile_cache``); without it,
        each variant is made ready the first time it is called (``Engine.on_demand``). The fields
        never change; the engine is attached once (``engine``). ``startup`` is told each phase
        and counts the compiled steps (``runner.startup``). Returns the runner."""
        if getattr(self, "_engine", None) is not None:
            raise RuntimeError("InferenceRunner.initialize() was already called")
        startup = startup or Startup.quiet()
        object.__setattr__(self, "_engine", _build_engine(self, startup))
        if warmup:
            self.compile(startup)
        else:
            self.engine.on_demand(self.compile_cache)
        return self

    @property
    def engine(self) -> Engine:
        engine = getattr(self, "_engine", None)
        if engine is None:
            raise RuntimeError("the InferenceRunner is not ready: call initialize() first")
        return engine

    @property
    def config(self):
        """The served model's ``ModelConfig`` (as restored, in the activations' dtype)."""
        return self.engine.executor.config

    @property
    def num_slots(self) -> int:
        """The batch slots it serves in (``batch_size``, or ``runner.bs_per_device`` x devices)."""
        return self.engine.executor.batch_size

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        return self.engine.outputs.tokenizer

    def compile(self, startup: Optional[Startup] = None) -> int:
        """Compile (or load from ``compile_cache``) every variant a request can reach now
        (``Engine.compile``), so serving never compiles. Returns how many there are."""
        startup = startup or Startup.quiet()
        with startup.phase("compile"):
            done = self.engine.compile(self.score_prompts, self.compile_cache, startup)
        later = f", {done['later']} loading after the start" if done["later"] else ""
        startup.note("compile", f"{done['loaded'] + done['compiled'] + done['later']} steps: {done['loaded']} "
                                f"loaded, {done['compiled']} compiled{later}")
        return done["loaded"] + done["compiled"] + done["later"]

    def compile_ahead(self, startup: Optional[Startup] = None) -> dict:
        """Compile every step a server of these settings builds (``compile``) into
        ``compile_cache`` from the checkpoint's headers alone: no weight is read and nothing is
        allocated (``Executor.create(abstract=True)``), so a deployment can fill the store while
        its weights are still on their way, and its first start loads every step. The XLA
        backend only (``runner.backend="xla"``, or a mesh of accelerators). Returns how many
        steps were already stored and how many were compiled; the runner stays uninitialised."""
        if self.compile_cache is None:
            raise ValueError("compile_ahead needs compile_cache (the directory a server's start loads its steps from)")
        if jax.process_count() > 1:
            raise ValueError("compile_ahead runs in one process: on several hosts every process compiles its own "
                             "steps (JAX's persistent cache keeps them)")
        startup = startup or Startup.quiet()
        engine = _build_engine(self, startup, abstract=True)
        with startup.phase("compile"):
            done = engine.compile(self.score_prompts, self.compile_cache, startup)
        startup.note("compile", f"{done['loaded'] + done['compiled']} steps: {done['loaded']} already stored, "
                                f"{done['compiled']} compiled")
        return {"loaded": done["loaded"], "compiled": done["compiled"]}  # nothing is left for later here

    def _check_pad_sizes(self, sequence_len: int) -> tuple[int, ...]:
        s = sequence_len
        if self.pad_sizes is None:
            return default_pad_sizes(s, self.max_num_batched_tokens)
        sizes = tuple(self.pad_sizes)
        if not sizes or any(not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not 0 < p <= s
                            for p in sizes):
            raise ValueError(f"pad_sizes must be positive integers <= sequence_len ({s}), got {self.pad_sizes!r}")
        return tuple(sorted(set(int(p) for p in sizes)))

    def _scheduler(self, config, batch_size: int, prefix: Optional[PrefixCache] = None,
                   kv_buckets: Optional[tuple[int, ...]] = None) -> Scheduler:
        """The scheduler of these settings for ``config`` in ``batch_size`` slots: a server's, and
        what ``runner.compiled`` counts a server's compiled steps from. ``kv_buckets``: the KV
        lengths a decode call attends over (default: ``default_kv_buckets``)."""
        kv_buckets = kv_buckets or default_kv_buckets(config.sequence_len)
        return Scheduler(batch_size, self._check_pad_sizes(config.sequence_len), kv_buckets,
                         config.sequence_len, self.max_num_batched_tokens, self.decode_steps, prefix,
                         speculative=self.speculative)

    def _check_fields(self) -> None:
        """``ValueError`` naming the first field that is out of range, before anything is loaded."""
        blocks, size = self.prefix_cache_blocks, self.prefix_block_size
        checks = [("prefix_cache_bytes", self.prefix_cache_bytes, 0, ""), ("prefix_block_size", size, 1, "")]
        if blocks != "auto":
            checks.append(("prefix_cache_blocks", blocks, 0, ' or "auto"'))
        for name, value, low, also in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}{also}, got {value!r}")
        if blocks and self.prefix_cache_bytes:
            raise ValueError(f"give prefix_cache_blocks ({blocks}) or prefix_cache_bytes "
                             f"({self.prefix_cache_bytes}), not both")
        budget = self.max_num_batched_tokens
        if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {budget!r}")
        if not isinstance(self.decode_steps, int) or self.decode_steps <= 0:
            raise ValueError(f"decode_steps must be a positive integer, got {self.decode_steps!r}")
        if (not isinstance(self.speculative, int) or isinstance(self.speculative, bool)
                or not 0 <= self.speculative <= MAX_SPECULATIVE):
            raise ValueError(f"speculative must be an integer in [0, {MAX_SPECULATIVE}] (the most draft tokens a "
                             f"step; 0 = off), got {self.speculative!r}")

    @property
    def state(self):
        """The decode state (the executor owns it; read it, never set it)."""
        return self.engine.executor.state

    @property
    def checkpoint_path(self) -> Optional[str]:
        return self.runner.checkpoint_path

    def backend_report(self) -> str:
        """Which backend runs the model and why (``Executor.backend_report``)."""
        return self.engine.executor.backend_report()

    def kv_report(self) -> str:
        """What the KV cache holds (``Executor.kv_report``)."""
        return self.engine.executor.kv_report()

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there) since start."""
        prefix = self.engine.scheduler.prefix
        return (prefix.queries, prefix.hits) if prefix is not None else (0, 0)

    def prefix_cache_usage(self) -> Optional[tuple[int, int]]:
        """(blocks the prefix cache holds, blocks in its pool), or None without a prefix cache."""
        prefix = self.engine.scheduler.prefix
        return (len(prefix), prefix.num_blocks) if prefix is not None else None

    def usage(self) -> tuple[int, int, int, int]:
        """(running requests, waiting requests, KV positions they hold, positions the slots hold)."""
        return self.engine.counts() + self.engine.scheduler.kv_usage()

    def logits(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Logits ``[B, T, V]`` of whole sequences, without a cache (scoring; ``Executor.forward``)."""
        executor = self.engine.executor
        return np.asarray(executor.forward(executor.params, tokens, lengths))

    # ---- requests ------------------------------------------------------------------------------
    def prepare(self, request: Request) -> list[int]:
        """Check ``request`` against this model and return its prompt ids; ``ValueError`` if bad."""
        if not isinstance(request, Request):
            raise ValueError(f"expected a Request, got {type(request).__name__}")
        if isinstance(request.prompt, str):
            if self.tokenizer is None:
                raise ValueError("Request.prompt is text but this runner has no tokenizer: pass token ids")
            ids = self._encode(request.prompt)
            if not ids:
                raise ValueError(f"Request.prompt {request.prompt[:100]!r} encodes to no tokens")
        else:
            ids = list(request.prompt)
        self.check_prompt_length(len(ids))
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
        if request.prompt_logprobs is not None and not self.score_prompts:
            raise ValueError("Request.prompt_logprobs needs a runner made with score_prompts=True (its scoring "
                             "prefill variants are compiled at start), got a runner without")
        if request.stop and self.tokenizer is None:
            raise ValueError("Request.stop needs a runner with a tokenizer (stop strings are matched on the text)")
        if request.json_schema is not None:
            self.grammar_of(request)  # compiled (and cached) now: a schema it cannot take is this request's error
        if request.speculative and request.speculative > self.speculative:
            raise ValueError(f"Request.speculative={request.speculative}: this runner verifies at most "
                             f"{self.speculative} draft tokens a step (InferenceRunner(speculative=...), "
                             f"--speculative; 0 = off)")
        return ids

    def check_prompt_length(self, tokens: int, bound: str = "") -> None:
        """ValueError if a prompt of ``tokens`` tokens (at least that many, found as ``bound``
        says, if given) leaves no room in the context for one generated token."""
        room = self.config.sequence_len - 1
        if tokens > room:
            count = f"at least {tokens} tokens ({bound})" if bound else f"{tokens} tokens"
            raise ValueError(f"Request.prompt has {count}, more than sequence_len ({self.config.sequence_len}) "
                             f"leaves room for: at most {room}, and one generated token")

    def _encode(self, text: str) -> list[int]:
        """``text``'s ids; a text of more characters than the context has positions is first
        bounded from below (``Tokenizer.min_tokens``) and refused if it cannot fit, so what an
        oversized prompt costs is its normalization, never its ids (about 44 bytes a character:
        177 MB for a 4 MB prompt)."""
        if len(text) >= self.config.sequence_len:
            bound = self.tokenizer.min_tokens(text)
            if bound >= self.config.sequence_len:
                self.check_prompt_length(bound, self.tokenizer.min_tokens_reason(text))
        return self.tokenizer.encode(text)

    def grammar_of(self, request: Request):
        """``request``'s compiled JSON grammar (``runner.grammar``; cached by schema)."""
        if self.tokenizer is None:
            raise ValueError("Request.json_schema needs a runner with a tokenizer (the grammar is over its pieces)")
        from runner import grammar  # llguidance is imported by the first request that asks for it

        try:
            return grammar.for_tokenizer(self.tokenizer, self.config.vocab_size).compile_grammar(
                "json_schema", request.json_schema)
        except ValueError as e:
            raise ValueError(f"Request.json_schema: {e}") from None

    def run(self, requests: Optional[Iterable[Request]] = None) -> "RunStream":
        """Stream ``TokenEvent``s for ``requests`` (an iterable, pulled as slots free up), and for any
        request ``send()``/``submit()``ted to the returned stream.

        With ``requests`` the stream ends when all are done; without, it is a server: ``next()``
        returns None whenever it is idle, like the reference's generator (prime it with ``next``).
        """
        return RunStream(self, requests)

    def generate(self, prompts: Sequence, **settings) -> list[Completion]:
        """Complete every prompt (text, ids or a ``Request``) with the same settings; results in
        prompt order. Every request is checked before any runs (``ValueError``); other clients'
        requests may be in flight meanwhile."""
        requests = [p if isinstance(p, Request) else Request(p, **settings) for p in prompts]
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Request.request_id: the requests' ids must differ, got {ids!r}")
        for r in requests:
            self.prepare(r)
        inbox, results = Inbox(), {r.request_id: Completion(r, [], "", [], "") for r in requests}
        try:
            for r in requests:
                inbox.submit(self.engine, r)
            while inbox.live or inbox.events:
                self.engine.wait_for(lambda: bool(inbox.events))
                event = inbox.events.popleft()
                done = results[event.request_id]
                if event.token_id is not None:
                    done.token_ids.append(event.token_id)
                    if event.logprob is not None:
                        done.logprobs.append(event.logprob)
                done.text += event.text
                if event.finish_reason:
                    done.finish_reason, done.error = event.finish_reason, event.error
        finally:
            for request_id in list(inbox.live):  # an interrupted caller leaves nothing running
                self.engine.cancel(request_id)
        return [results[r.request_id] for r in requests]

    def complete(self, request: Request) -> Completion:
        """One request to its end, beside whatever else is in flight."""
        return self.generate([request])[0]

    def prefill_chunks(self, ids: list[int]) -> list[int]:
        """The chunk lengths the scheduler cuts ``ids`` into (``runner.scheduler.chunk_lengths``)."""
        return chunk_lengths(len(ids), self.engine.scheduler.chunk_sizes)


def _build_engine(spec: InferenceRunner, startup: Startup, abstract: bool = False) -> Engine:
    """``spec`` served: its fields checked, its model restored onto the mesh (``Executor``), its
    tokenizer, its scheduler (with the prefix cache's index) and the engine over them. With
    ``abstract``, an engine to compile with alone: nothing read or allocated, no tokenizer."""
    spec._check_fields()
    mesh = spec.mesh or spec.runner.mesh
    if mesh is None:
        shape = tuple(a * b for a, b in zip(spec.local_mesh_config, spec.between_hosts_config))
        mesh = make_mesh(shape, jax.devices()[: shape[0] * shape[1]])
    _preflight(spec, mesh)
    size = spec.prefix_block_size
    executor = Executor.create(spec.runner, mesh, spec.batch_size, spec.prefix_cache_blocks, size,
                               spec.prefix_cache_bytes, startup=startup, abstract=abstract)
    config = executor.config
    kv_buckets = default_kv_buckets(config.sequence_len)
    prefix = None
    if executor.prefix_blocks:
        if any(kv % size for kv in kv_buckets):
            raise ValueError(f"prefix_block_size {size} must divide every KV bucket {kv_buckets} "
                             f"(sequence_len {config.sequence_len})")
        identity = repr((config, spec.runner.checkpoint_path)).encode()  # blocks of one model
        prefix = PrefixCache(executor.prefix_blocks, size, identity)
    path = None if abstract else spec.tokenizer_path or executor.tokenizer_path
    tokenizer = load_tokenizer(path) if path is not None else None
    if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"tokenizer {path} has {tokenizer.vocab_size} pieces but the model's "
                         f"vocab_size is {config.vocab_size}")
    # A decode step whose attention reads the live positions alone costs the same over the whole
    # cache: one decode variant, not one a KV bucket (fewer steps to compile or load at start).
    # (A speculative step verifies several tokens a row, through XLA's attention: it keeps the buckets.)
    live = not spec.speculative and executor.selection.backend.decode_reads_live_keys(config)
    if live:
        log.info("decode steps attend over one KV length (%d): the backend's attention reads the live "
                 "positions only", config.sequence_len)
    scheduler = spec._scheduler(config, executor.batch_size, prefix, (config.sequence_len,) if live else None)
    outputs = OutputProcessor(tokenizer, config.eos_token, spec.grammar_of)
    return Engine(scheduler, executor, outputs, spec.prepare)


def _preflight(spec: InferenceRunner, mesh: jax.sharding.Mesh, abstract: bool = False) -> None:
    """Every check that needs no weights, before the restore, so that a wrong flag fails in seconds
    rather than after hundreds of GB are read: the checkpoint's headers against its config, the
    tokenizer against the vocabulary (``checkpoints.restore.inspect``), and the weights and the
    slots' KV against each device's memory (``device_memory``: what GPUs and TPUs report, a CPU
    device's share of the host's)."""
    if spec.runner.params is not None or spec.runner.checkpoint_path is None:
        return
    from checkpoints.restore import inspect
    from model.plan import memory_plan

    inspected = inspect(spec.runner.checkpoint_path, spec.runner.model, spec.tokenizer_path)
    memory = device_memory(mesh.devices.flat[0])
    if memory is None or (abstract and mesh.devices.flat[0].platform == "cpu"):
        return  # an abstract engine allocates nothing; on CPU it compiles for another machine
    config = inspected.config
    if spec.runner.dtype is not None:
        config = dataclasses.replace(config, fprop_dtype=spec.runner.dtype)
    batch = spec.batch_size or max(1, int(spec.runner.bs_per_device * mesh.size))
    plan = memory_plan(config, inspected.params, mesh_shape=(mesh.shape["data"], mesh.shape["model"]),
                       batch_size=batch, device_memory=memory, kv_dtype=spec.runner.kv_dtype,
                       rules=spec.runner.rules)
    if plan.weight_bytes + plan.kv_bytes > memory:
        gib = 2**30
        raise ValueError(
            f"{spec.runner.checkpoint_path}: {plan.weight_bytes / gib:,.1f} GiB of weights and "
            f"{plan.kv_bytes / gib:,.1f} GiB of KV for batch {batch} a device do not fit in its "
            f"{memory / gib:,.1f} GiB: use more devices on the mesh's model axis (--mesh), a smaller "
            f"--batch-size or --kv-dtype int8 (--plan shows the plan)")


def device_memory(device) -> Optional[int]:
    """The bytes a device may hold: what it says (``memory_stats()["bytes_limit"]``: GPUs, TPUs),
    or for a CPU device its share of the host's memory (``host_memory``, shared by the process's
    CPU devices); None if neither is known."""
    if device.platform == "cpu":
        host = host_memory()
        return None if host is None else host // max(1, len(jax.local_devices(backend="cpu")))
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def host_memory() -> Optional[int]:
    """The host's physical memory, or the control group's limit where that is lower (a container);
    None where neither can be read. A CPU run is planned against it before anything is allocated:
    a config of 10^9 positions made the calibration ask for 59.6 GiB of caches on a 24 GiB host."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                sizes.append(int(text))
        except OSError:
            continue
    return min(sizes) if sizes else None


class RunStream:
    """The iterator ``run()`` returns: a generator-compatible stream of its own requests' events
    (a client of the runner's engine; other streams and ``generate`` may run beside it)."""

    def __init__(self, runner: InferenceRunner, requests: Optional[Iterable[Request]]):
        self.runner = runner
        self._core = runner.engine
        self._source = iter(requests) if requests is not None else None
        self._source_done = requests is None
        self._inbox = Inbox()

    # ---- the generator protocol -----------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Optional[TokenEvent]:
        inbox = self._inbox
        while not inbox.events:
            self._pull()
            if not inbox.live and not inbox.events:
                if self._source is None:
                    return None  # server mode: nothing to do until a request is sent
                if self._source_done:
                    raise StopIteration
            self._core.wait_for(lambda: bool(inbox.events) or self._can_pull())
        return inbox.events.popleft()

    def send(self, request: Optional[Request]) -> Optional[TokenEvent]:
        if request is not None:
            self.submit(request)
        return next(self)

    def close(self) -> None:
        """Cancel this stream's live requests and take no more from its source."""
        for request_id in list(self._inbox.live):
            self._core.cancel(request_id)
        self._source_done = True

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request``; a bad one (or one whose id is live) raises ``ValueError`` here and
        disturbs nothing."""
        self._inbox.submit(self._core, request)
        return request

    def cancel(self, request_id: str) -> bool:
        """End one of this stream's waiting or running requests; its last event has finish_reason
        'cancelled'. False if this stream has no such live request."""
        return request_id in self._inbox.live and self._core.cancel(request_id)

    def _can_pull(self) -> bool:
        return not self._source_done and self._core.capacity() > 0

    def _pull(self) -> None:
        """Submit from the source iterable while the core has room (a lazy source stays lazy),
        and at least one request when none of this stream's is live."""
        while not self._source_done and (self._core.capacity() > 0 or not self._inbox.live):
            request = next(self._source, None)
            if request is None:
                self._source_done = True
                return
            self.submit(request)


def sample_from_model(server: RunStream, prompt, max_len: int, temperature: float) -> str:
    """Grok-1's helper: complete ``prompt`` with nucleus_p 1 and seed 42; returns the text. It
    reads its own request's events only: the stream's other requests lose none of theirs."""
    request = Request(prompt, temperature=temperature, nucleus_p=1.0, rng_seed=42, max_len=max_len)
    done = server.runner.complete(request)
    if done.finish_reason == "error":
        raise RuntimeError(f"the request failed: {done.error}")
    return done.text


DEFAULT_MODEL = "austen-moe"  # checkpoints/austen-moe: the small trained model the project ships


def default_checkpoint() -> Optional[str]:
    """The shipped default model's directory, if it exists."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "checkpoints", DEFAULT_MODEL)
    return path if os.path.exists(os.path.join(path, "config.json")) else None
