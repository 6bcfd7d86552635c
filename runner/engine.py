"""``ModelRunner``: parameters on a mesh and the four jit-compiled functions that serve them.

- ``forward(params, tokens, lengths)`` -> logits for whole sequences (scoring, tests, parity).
- ``new_memory()`` -> a zeroed ``KVMemory`` with its sharding (batch over ``data``, KV heads over
  ``model``).
- ``prefill_memory(params, state, batch, kv_len)`` -> writes the prompt chunks of several
  requests (``state.PrefillBatch``: one row per request with its slot, padded tokens and sampling
  settings) into their slots of the decode state, and samples the first token of each request
  whose last chunk it is; compiled once per (rows, pad bucket, KV-length bucket), and once more
  per one-row shape that also scores every prompt position (``score``: prompt log-probabilities).
- ``sample_step(params, state, mask, kv_len, steps)`` -> ``steps`` decode steps of every slot in
  one call (a scan on device, each slot stopping at its EOS, stop tokens or budget), attending to
  the first ``kv_len`` cache positions only, each structured output's row one step under its
  ``mask`` (``state.TokenMask``); compiled once per KV-length bucket.

The step functions themselves, ``prefill`` and ``decode``, are pure and at module level; this
class places the parameters, chooses the backend (``runner.selection``) and jits them. It also
owns the decode state (``runner/state.py``): one pytree donated to every call, so XLA updates it
in place; ``run_prefill``, ``run_decode``, ``release`` and ``reset_state`` are the only ways it
changes. All shardings are derived from
the rules in ``model/sharding.py``; sampled outputs are replicated so every host can read them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.memory import KV_DTYPES, KVMemory, kv_zeros, new_memory, set_at
from model.quant import quantize_params
from model.sharding import (DEFAULT_RULES, KV_MEMORY_AXES, activation_sharding, make_mesh, memory_specs,
                            param_shardings, spec_for)
from model.transformer import LanguageModel
from runner.sampling import (TOP_K, Constraints, SampleOutput, SampleSettings, filter_logits, sample_token,
                             score_positions)
from runner.selection import BACKENDS, Selection, choose, one_cpu_device, start
from runner.speculative import ngram_draft, verify
from runner.state import MAX_STOP_IDS, DecodeOutput, DecodeState, PrefillBatch, PrefixPool, TokenMask, ends

log = logging.getLogger("grok_runner")


@dataclasses.dataclass
class ModelRunner:
    """Model config + parameters + mesh, and the four compiled functions.

    Either ``checkpoint_path`` (restored on ``initialize``) or ``params`` (a pytree the caller
    already has; no file I/O) must be given. ``bs_per_device`` sizes the batch as in the reference.
    """

    model: ModelConfig | None = None
    checkpoint_path: str | None = None
    params: dict | None = None
    bs_per_device: float = 1.0
    mesh: Mesh | None = None
    rules: dict | None = None
    # Activation dtype override: "float32" or "bfloat16" (Grok-1's own: softmax, norms, RoPE and
    # the router stay float32). From a checkpoint on CPU the default is float32; with "bfloat16"
    # the float weights are restored in bf16 and the CPU backend's bf16 kernels read them.
    dtype: str | None = None
    # int8 weights -> float at load. Default: with the CPU backend on one CPU device, int8 weights
    # stay int8 and the int8 panel kernels read them where the calibration takes them (the rest
    # are dequantised once, by the backend's prepare); with XLA on a CPU, dequantised at load;
    # kept int8 elsewhere.
    dequantize: bool | None = None
    # Quantise the float weights of the experts and attention projections to int8 at load:
    # None, or "int8" (symmetric, per output channel, float32 scales: model.quant.quantize_params).
    quantize: str | None = None
    # What the KV cache (and the prefix pool) holds: None, the activations' dtype; "int8", int8
    # values and a float32 scale a token and KV head (model.memory.QuantizedKV): 3.8x the tokens
    # of a float32 cache in the same bytes at key_size 64, at a bounded error (README).
    kv_dtype: str | None = None
    # Where the operations run (backends/): "xla" (pure JAX, any mesh), "cpu" (one CPU device, every
    # C++ kernel; ValueError where it cannot run), or "auto": the CPU backend on one CPU device
    # with each kernel taken only where measured faster than XLA's op on this CPU, XLA elsewhere.
    # Default: $GROK_RUNNER_BACKEND, else "auto" (the variable runs a whole program, or the test
    # suite, on one backend).
    backend: str = dataclasses.field(default_factory=lambda: os.environ.get("GROK_RUNNER_BACKEND") or "auto")
    # Prompt tokens per prefill call and cache positions per decode step that the calibration
    # times the kernels at (default: 256 of each, or sequence_len if shorter).
    calibration_tokens: int | None = None
    tokenizer_path: str | None = dataclasses.field(default=None, init=False)
    # What initialize chose: the backend, why, and each CPU kernel's Choice (runner.selection.Selection)
    selection: Selection | None = dataclasses.field(default=None, init=False)

    def initialize(self, mesh: Mesh | None = None, batch_size: int | None = None, prefix_blocks: int | str = 0,
                   prefix_block_size: int = 16, prefix_bytes: int = 0) -> None:
        """Restore (or place) the parameters, choose the backend and build the compiled functions
        and the decode state, with a prefix pool (``runner.prefix_cache``) of ``prefix_blocks``
        blocks of ``prefix_block_size`` positions ("auto": as many as the slots hold positions), or
        of as many as ``prefix_bytes`` hold (0: none)."""
        self.prefix_blocks, self.prefix_block_size = prefix_blocks, prefix_block_size
        if self.backend not in BACKENDS:
            raise ValueError(f"ModelRunner.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"ModelRunner.kv_dtype must be None or one of {KV_DTYPES}, got {self.kv_dtype!r}")
        self.mesh = mesh or self.mesh or make_mesh((1, 1), jax.devices()[:1])
        self.rules = DEFAULT_RULES if self.rules is None else self.rules
        start(self.backend, self.mesh)  # the kernels' compiler runs while the checkpoint is restored
        if self.params is None:
            self._restore()
        elif self.model is None:
            raise ValueError("ModelRunner.model (a ModelConfig) is required with params")
        if self.quantize is not None:
            if self.quantize != "int8":
                raise ValueError(f"ModelRunner.quantize must be None or 'int8', got {self.quantize!r}")
            self.params = quantize_params(self.params)
        if self.dtype is not None:
            self.model = dataclasses.replace(self.model, fprop_dtype=self.dtype)
        self.batch_size = batch_size or max(1, int(self.bs_per_device * self.mesh.size))
        data = self.mesh.shape["data"]
        if self.batch_size % data:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by the mesh's data axis ({data})")
        if prefix_blocks == "auto":  # once the checkpoint's sequence_len is known
            self.prefix_blocks = -(-self.batch_size * self.model.sequence_len // prefix_block_size)
        elif prefix_bytes and not prefix_blocks:
            self.prefix_blocks = prefix_bytes // self.prefix_block_bytes()
        self.selection = choose(self.backend, self.mesh, self.model, self.params, self.batch_size,
                                self.calibration_tokens, self.kv_dtype)
        for line in self.selection.report().splitlines():
            log.info("%s", line)
        log.info("%s", self.kv_report())
        # shardings of the canonical parameters; the backend's layout is derived from them in place
        self.param_shardings = param_shardings(self.params, self.mesh, self.rules)
        self.params = self.selection.backend.prepare(jax.device_put(self.params, self.param_shardings))
        self._build()

    def prefix_block_bytes(self) -> int:
        """Bytes of one prefix pool block: K and V of every layer over ``prefix_block_size`` positions."""
        return self.model.kv_bytes_per_token(self.cache_dtype()) * self.prefix_block_size

    def backend_report(self) -> str:
        """The backend and why; for the CPU backend one line per kernel: taken or XLA's op, and the
        measured ratio or the reason."""
        return self.selection.report()

    def cache_dtype(self) -> str:
        """What the KV cache and the prefix pool hold: ``kv_dtype``, by default the activations'."""
        return jnp.dtype(self.model.dtype if self.kv_dtype is None else self.kv_dtype).name

    def kv_report(self) -> str:
        """One line: what the KV cache (and the prefix pool) holds, and its bytes a token."""
        kv = self.cache_dtype()
        scales = " (int8 values and a float32 scale a token and KV head)" if kv == "int8" else ""
        return f"KV cache: {kv}, {self.model.kv_bytes_per_token(kv):,} bytes a token{scales}"

    def _restore(self) -> None:
        from checkpoints import restore

        if self.checkpoint_path is None:
            raise ValueError("ModelRunner needs checkpoint_path or params")
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        kernels_may_read_int8 = self.backend != "xla" and one_cpu_device(self.mesh)
        dequantize = on_cpu and not kernels_may_read_int8 if self.dequantize is None else self.dequantize
        # On CPU the float weights are held in the activations' dtype: float32 unless bf16 was asked for.
        held = (jnp.bfloat16 if self.dtype == "bfloat16" else np.float32) if on_cpu else None
        restored = restore(self.checkpoint_path, mesh=self.mesh, config=self.model, rules=self.rules,
                           dequantize=dequantize, dtype=held)
        self.model, self.params = restored.config, restored.params
        if self.dtype is None and on_cpu:
            self.dtype = "float32"
        self.tokenizer_path = restored.tokenizer_path

    # ---- shardings ---------------------------------------------------------------------------
    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def state_shardings(self, memory: KVMemory) -> DecodeState:
        batch = spec_for(("batch",), self.rules)
        mem = memory_specs(memory, self.rules, self.mesh)
        named = lambda tree: jax.tree_util.tree_map(self._named, tree, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
        return DecodeState(
            memory=named(mem),
            tokens=self._named(batch),
            settings=SampleSettings(*(self._named(batch) for _ in dataclasses.fields(SampleSettings))),
            keys=self._named(P(*batch, None)),
            active=self._named(batch),
            remaining=self._named(batch),
            stop_ids=self._named(P(*batch, None)),
            unstoppable=self._named(batch),
            counts=self._named(P(*batch, None)),
            seen=self._named(P(*batch, None)),
            history=self._named(P(*batch, None)),
            speculative=self._named(batch),
            draft_len=self._named(batch),
            wait=self._named(batch),
            misses=self._named(batch),
            pool=self._pool_shardings(),
        )

    def _pool_shardings(self) -> PrefixPool | None:
        """The prefix pool's: its blocks replicated over ``data`` (any slot may read any block),
        its KV heads split like the cache's."""
        if not self.prefix_blocks:
            return None
        block = self._named(P(None, *spec_for(KV_MEMORY_AXES[1:], self.rules)))
        shape = jax.eval_shape(self._new_pool)
        return jax.tree_util.tree_map(lambda _: block, shape)

    def _new_pool(self) -> PrefixPool:
        c = self.model
        shape = (self.prefix_blocks, c.num_kv_heads, self.prefix_block_size, c.key_size)
        return PrefixPool(k=tuple(kv_zeros(shape, self.cache_dtype()) for _ in range(c.num_layers)),
                          v=tuple(kv_zeros(shape, self.cache_dtype()) for _ in range(c.num_layers)))

    # ---- the four functions ------------------------------------------------------------------
    def _build(self) -> None:
        config, b = self.model, self.batch_size
        backend = self.selection.backend
        module = LanguageModel(config, backend)

        def apply(*args):
            with activation_sharding(self.mesh, self.rules):  # active while tracing only
                return module.apply(*args)

        sampler = backend
        params_sh = jax.tree_util.tree_map(lambda a: a.sharding, self.params)  # the backend's layout, placed
        abstract_memory = jax.eval_shape(lambda: new_memory(config, b, dtype=self.kv_dtype))
        state_sh = self.state_shardings(abstract_memory)
        replicated = self._named(P())
        out_sh = SampleOutput(*(replicated for _ in range(4)))

        def forward(params, tokens, lengths):
            return apply({"params": params}, tokens, None, lengths).logits

        def _new_memory():
            return new_memory(config, b, dtype=self.kv_dtype)

        rows = jax.tree_util.tree_map(lambda _: replicated, jax.eval_shape(lambda: self._empty_rows()))
        mask_sh = TokenMask(words=state_sh.counts, on=state_sh.active, hold=state_sh.active)
        step_out_sh = DecodeOutput(out_sh, replicated, replicated)
        self.forward = jax.jit(forward, in_shardings=(params_sh, None, None))
        self.new_memory = jax.jit(_new_memory, out_shardings=state_sh.memory)
        self.new_pool = jax.jit(self._new_pool, out_shardings=state_sh.pool) if self.prefix_blocks else None
        # One jitted function per static setting (KV length, or KV length x steps), each with
        # explicit shardings (a prefill's is also compiled per shape of its batch); made on first
        # use, which warm-up does for every variant the scheduler can ask for.
        self.prefill_memory = _PerStatic(lambda kv_len, score=False: jax.jit(
            functools.partial(prefill, apply, sampler, kv_len=kv_len, score=score),
            in_shardings=(params_sh, state_sh, rows),
            out_shardings=(state_sh, step_out_sh, replicated, replicated), donate_argnums=1))
        spec_out_sh = DecodeOutput(out_sh, replicated, replicated, replicated, replicated, replicated)
        decode_out_sh = DecodeOutput(out_sh, replicated, replicated, ready=replicated)
        self.sample_step = _PerStatic(lambda kv_len, steps, speculative=0: jax.jit(
            functools.partial(decode, apply, sampler, kv_len=kv_len, steps=steps, speculative=speculative),
            in_shardings=(params_sh, state_sh, mask_sh),
            out_shardings=(state_sh, spec_out_sh if speculative else decode_out_sh), donate_argnums=1))
        self.no_mask = jax.device_put(self.host_mask(), mask_sh)  # a decode call's mask when no row has one
        self._mask_shardings = mask_sh
        self.fork_slot = jax.jit(functools.partial(fork, sampler),
                                 in_shardings=(state_sh, replicated, replicated, replicated, rows),
                                 out_shardings=(state_sh, step_out_sh), donate_argnums=0)
        self.release_slot = jax.jit(DecodeState.release, in_shardings=(state_sh, replicated),
                                    out_shardings=state_sh, donate_argnums=0)
        self._state_shardings = state_sh
        self.state = self.new_state()

    # ---- the decode state, and the calls that change it ----------------------------------------
    def run_prefill(self, batch: PrefillBatch, kv_len: int, score: bool = False):
        """Dispatch one prefill call on the state (``prefill``); its outputs are not waited for:
        the sampled tokens, each row's last logits (left on the device for ``run_fork``) and,
        with ``score``, its positions' ``PromptScores`` (else None)."""
        self.state, out, logits, scores = self.prefill_memory(self.params, self.state, batch, kv_len=kv_len,
                                                              score=score)
        return out, logits, scores

    def run_fork(self, logits, row: int, source: int, batch: PrefillBatch) -> DecodeOutput:
        """Dispatch a copy of slot ``source`` into the one-row ``batch``'s slot, its first token
        sampled from row ``row`` of ``logits`` (``fork``); not waited for."""
        self.state, out = self.fork_slot(self.state, logits, np.int32(row), np.int32(source), batch)
        return out

    def run_decode(self, kv_len: int, steps: int, mask: TokenMask | None = None, speculative: int = 0) -> DecodeOutput:
        """Dispatch ``steps`` decode steps of every slot (``decode``), the rows of ``mask`` that are
        on (host arrays, ``host_mask``) one step under it, or with ``speculative`` (no mask) steps
        that verify up to that many draft tokens a slot; not waited for."""
        mask = self.no_mask if mask is None else jax.device_put(mask, self._mask_shardings)
        statics = dict(kv_len=kv_len, steps=steps, **({"speculative": speculative} if speculative else {}))
        self.state, out = self.sample_step(self.params, self.state, mask, **statics)
        return out

    def host_mask(self, rows: int | None = None) -> TokenMask:
        """A ``TokenMask`` of ``rows`` rows (default: the batch) with every row off, as host arrays."""
        rows = self.batch_size if rows is None else rows
        return TokenMask(words=np.zeros((rows, -(-self.model.vocab_size // 32)), np.uint32),
                         on=np.zeros((rows,), bool), hold=np.zeros((rows,), bool))

    def _empty_rows(self) -> PrefillBatch:
        """A one-row, one-token prefill batch: the structure of every prefill batch."""
        from runner.scheduler import empty_batch

        return empty_batch(1, 1, self.batch_size, vocab_size=self.model.vocab_size)

    def release(self, slot: int) -> None:
        """Stop ``slot`` generating at once (its request was cancelled or failed)."""
        self.state = self.release_slot(self.state, np.int32(slot))

    def reset_state(self) -> None:
        """A fresh state, every slot free (after a device call failed and took the state with it)."""
        self.state = self.new_state()

    def new_state(self) -> DecodeState:
        """A fresh decode state: zeroed memory, every slot free."""
        b = self.batch_size
        sh = self._state_shardings
        return DecodeState(
            memory=self.new_memory(),
            tokens=jax.device_put(np.zeros((b,), np.int32), sh.tokens),
            settings=jax.device_put(SampleSettings.host(b), sh.settings),
            keys=jax.device_put(np.zeros((b, 2), np.uint32), sh.keys),
            active=jax.device_put(np.zeros((b,), bool), sh.active),
            remaining=jax.device_put(np.zeros((b,), np.int32), sh.remaining),
            stop_ids=jax.device_put(np.full((b, MAX_STOP_IDS), -1, np.int32), sh.stop_ids),
            unstoppable=jax.device_put(np.zeros((b,), np.int32), sh.unstoppable),
            counts=jax.device_put(np.zeros((b, self.model.vocab_size), np.int32), sh.counts),
            seen=jax.device_put(np.zeros((b, self.model.vocab_size), bool), sh.seen),
            history=jax.device_put(np.full((b, self.model.sequence_len), -1, np.int32), sh.history),
            speculative=jax.device_put(np.zeros((b,), np.int32), sh.speculative),
            draft_len=jax.device_put(np.zeros((b,), np.int32), sh.draft_len),
            wait=jax.device_put(np.zeros((b,), np.int32), sh.wait),
            misses=jax.device_put(np.zeros((b,), np.int32), sh.misses),
            pool=self.new_pool() if self.new_pool is not None else None,
        )


def prefill(apply, sampler, params, state: DecodeState, batch: PrefillBatch, kv_len: int, score: bool = False):
    """The prompt chunks of ``batch`` (``P`` rows, one request each, in distinct slots) into their
    slots of ``state``, and the first token of each request whose last chunk it is sampled; the
    rows attend to (and are copied in and out over) the first ``kv_len`` cache positions only.
    With ``score`` (static) every position is unembedded and scored against ``batch.targets``
    (``PromptScores``, else None): prompt log-probabilities, as part of the prefill.
    ``apply(variables, tokens, memory, lengths, last_only, kv_len)`` is the model; ``sampler`` the
    backend that ``sample_token`` cuts and summarises on. Pure: jitted with ``state`` donated."""
    memory, b = state.memory, state.tokens.shape[0]
    slots = batch.slots  # b for a padding row: read as zeros, written nowhere

    def rows(full):
        return jnp.take(full[:, :, :kv_len], slots, axis=0, mode="fill", fill_value=0)

    step = jnp.take(memory.step, slots, mode="fill", fill_value=0)
    k, v = jax.tree_util.tree_map(rows, (memory.k, memory.v))  # arrays, or int8 records (QuantizedKV)
    if state.pool is not None:  # a first chunk after a cached prefix starts from its blocks
        k, v = read_prefix(state.pool, batch, k, v, kv_len)
    starts = jnp.where(batch.reset, batch.cached, step)
    sub = KVMemory(k=k, v=v, step=starts)
    out = apply({"params": params}, batch.tokens, sub, batch.lengths, not score, kv_len)
    if state.pool is not None:
        state = state.replace(pool=save_prefix(state.pool, batch, out.memory, kv_len))
    if score:
        scores = score_positions(out.logits, batch.targets, sampler)
        logits = jnp.take_along_axis(out.logits, jnp.maximum(batch.lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    else:
        scores, logits = None, out.logits[:, -1]

    def put(full, new):
        return set_at(full, (slots, slice(None), slice(None, kv_len)), new)

    k, v = jax.tree_util.tree_map(put, (memory.k, memory.v), (out.memory.k, out.memory.v))
    memory = KVMemory(k=k, v=v, step=memory.step.at[slots].set(out.memory.step, mode="drop"))
    state = state.with_prompts(batch, starts)
    keys, sample_keys = _seeded(batch)
    # Only a request's last chunk samples: a call of middle chunks never draws or summarises.
    # (The logits are also returned: a request with the same prompt forks from them, ``fork``.)
    draw = functools.partial(sample_token, logits, batch.settings, sample_keys, sampler,
                             _first_rules(batch, state.seen, slots))
    nothing = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(draw))
    first = jax.lax.cond(jnp.any(batch.last), draw, lambda: nothing)
    state, output = _start(state.replace(memory=memory), batch, first, keys)
    # padded to the batch size: one compiled fork serves prefill calls of any row count
    logits_BV = jnp.zeros((b, logits.shape[-1]), logits.dtype).at[: logits.shape[0]].set(logits)
    return state, output, logits_BV, scores


def read_prefix(pool: PrefixPool, batch: PrefillBatch, k_rows, v_rows, kv_len: int):
    """The rows' caches ``[P, K, kv_len, H]`` per layer with positions ``[0, batch.cached)`` of
    each row taken from its pool blocks ``batch.read`` (a copy: the row never refers to the pool
    again). Skipped when no row starts from a cached prefix."""
    nb = kv_len // pool.block_size
    blocks = batch.read[:, :nb]
    hit_PS = jnp.arange(kv_len)[None, :] < batch.cached[:, None]

    def one(pool_NKbH, rows_PKSH):
        got = pool_NKbH[blocks]  # [P, nb, K, b, H]
        p, _, k, size, h = got.shape
        got_PKSH = got.transpose(0, 2, 1, 3, 4).reshape(p, k, nb * size, h)
        return jnp.where(hit_PS[:, None, :, None], got_PKSH.astype(rows_PKSH.dtype), rows_PKSH)

    def read():
        return jax.tree_util.tree_map(one, (pool.k, pool.v), (k_rows, v_rows))

    return jax.lax.cond(jnp.any(batch.cached > 0), read, lambda: (k_rows, v_rows))


def save_prefix(pool: PrefixPool, batch: PrefillBatch, rows: KVMemory, kv_len: int) -> PrefixPool:
    """``pool`` with block j of each row's cache (``rows``: ``[P, K, kv_len, H]`` per layer, as the
    call left it) written to pool block ``batch.save[p, j]`` where that is a block (the rest is
    dropped). The call reads the pool (``read_prefix``) before it writes it."""
    nb = kv_len // pool.block_size
    to = batch.save[:, :nb].reshape(-1)

    def one(pool_NKbH, rows_PKSH):
        p, k, _, h = rows_PKSH.shape
        blocks = rows_PKSH.reshape(p, k, nb, pool.block_size, h).transpose(0, 2, 1, 3, 4)
        return set_at(pool_NKbH, to, blocks.reshape(p * nb, k, pool.block_size, h))

    k, v = jax.tree_util.tree_map(one, (pool.k, pool.v), (rows.k, rows.v))
    return PrefixPool(k=k, v=v)


def _seeded(batch: PrefillBatch):
    """Each row's PRNG key from now on, and the key of its first draw. The keys derive from the
    seed alone, so chunking or forking never changes a request's samples."""
    split = jax.vmap(jax.random.split)(batch.seed)  # [P, 2, 2]
    return split[:, 0], split[:, 1]


def _first_rules(batch: PrefillBatch, seen_BV, seen_rows) -> Constraints:
    """The ``Constraints`` of each row's first token: no output yet, its prompt's tokens (row
    ``seen_rows[p]`` of ``seen_BV``), its stop ids banned if it has a ``min_tokens``, its mask."""
    seen = jnp.take(seen_BV, seen_rows, axis=0, mode="fill", fill_value=False)
    return Constraints(counts=jnp.zeros(seen.shape, jnp.int32), seen=seen,
                       banned=jnp.where((batch.min_tokens > 0)[:, None], batch.stop_ids, -1),
                       mask=batch.mask, masked=batch.masked)


def _start(state: DecodeState, batch: PrefillBatch, first, keys):
    """``state.start`` for ``batch``'s last-chunk rows, and the call's output: one step of P rows."""
    ended = batch.last & ends(first.token_id, batch.stop_ids, batch.max_len - 1)
    output = DecodeOutput(jax.tree_util.tree_map(lambda a: a[None], first), batch.last[None], ended[None])
    return state.start(batch, first, keys), output


def fork(sampler, state: DecodeState, logits_BV, row, source, batch: PrefillBatch):
    """Slot ``source``'s cache copied into the slot of the one-row ``batch`` (a request with the
    same prompt), and that request started with its first token sampled from ``logits_BV[row]``
    (the last logits of the prefill that wrote ``source``) under its own settings and seed: what
    its own prefill would have computed, bit for bit. Pure: jitted with ``state`` donated."""
    memory, dst = state.memory, batch.slots[0]

    def copy(full):
        return full.at[dst].set(full[source])

    memory = jax.tree_util.tree_map(copy, memory)
    state = state.replace(memory=memory, seen=copy(state.seen), counts=state.counts.at[dst].set(0),
                          history=copy(state.history))
    keys, sample_keys = _seeded(batch)
    first = sample_token(logits_BV[row][None], batch.settings, sample_keys, sampler,
                         _first_rules(batch, state.seen, source[None]))
    return _start(state, batch, first, keys)


def decode(apply, sampler, params, state: DecodeState, mask: TokenMask, kv_len: int, steps: int,
           speculative: int = 0):
    """``steps`` decode steps of every slot (a scan on device), attending to the first ``kv_len``
    cache positions; each slot stops where ``ends`` says. A row whose ``mask`` is on takes the
    first step only, under its mask; one it holds takes none. With ``speculative`` (static, > 0;
    no mask), each step is ``speculate``'s: up to that many draft tokens a slot verified in one
    forward. Pure, like ``prefill``."""
    if speculative:
        def one_speculative(state, _):
            return speculate(apply, sampler, params, state, mask, kv_len, speculative)

        state, out = jax.lax.scan(one_speculative, state, jnp.arange(steps))
        flat = lambda a: a.reshape(steps * (speculative + 1), *a.shape[2:])  # noqa: E731: [n, k + 1, ...] -> [n (k + 1), ...]
        return state, DecodeOutput(jax.tree_util.tree_map(flat, out.sample), flat(out.valid), flat(out.ended),
                                   out.drafted, out.accepted, out.ready[-1])

    def one(state, step):
        split = jax.vmap(jax.random.split)(state.keys)  # [B, 2, 2]
        keys, sample_keys = split[:, 0], split[:, 1]
        valid = state.active & ~mask.hold & ~(mask.on & (step > 0))
        lengths = valid.astype(jnp.int32)  # free, finished, prefilling and waiting slots do not advance
        out = apply({"params": params}, state.tokens[:, None], state.memory, lengths, False, kv_len)
        rules = state.constraints(mask.replace(on=mask.on & (step == 0)))
        sample = sample_token(out.logits[:, 0], state.settings, sample_keys, sampler, rules)
        tokens = jnp.where(valid, sample.token_id, state.tokens)
        remaining = state.remaining - lengths
        ended = valid & ends(tokens, state.stop_ids, remaining)
        b = tokens.shape[0]
        rows = jnp.where(valid, jnp.arange(b), b)
        state = state.replace(memory=out.memory, tokens=tokens, keys=jnp.where(valid[:, None], keys, state.keys),
                              remaining=remaining, active=state.active & ~ended,
                              unstoppable=state.unstoppable - lengths,
                              counts=state.counts.at[rows, tokens].add(1, mode="drop"),
                              history=state.history.at[rows, out.memory.step].set(tokens, mode="drop"))
        draft_len, wait = _count_down(state, valid)
        return state.replace(draft_len=draft_len, wait=wait), (sample, valid, ended)

    state, (samples, valid, ended) = jax.lax.scan(one, state, jnp.arange(steps))
    return state, DecodeOutput(samples, valid, ended, ready=_ready(state))


# Steps a slot whose drafting stalled (a draft refused whole, or nothing to follow) decodes plainly
# before it drafts one token again: 16, doubled for each stall in a row up to 16 x 2^3 (a
# request whose text never repeats costs one probe every 128 tokens at most).
PROBE_AFTER, MAX_DOUBLINGS = 16, 3


def speculate(apply, sampler, params, state: DecodeState, mask: TokenMask, kv_len: int, k: int):
    """One speculative step of every slot: each drafts up to ``min(k, its draft_len)`` tokens from
    its own history (``ngram_draft``), the step's token and the draft go through one forward with
    the cache (``k + 1`` positions a row, the draft's own length of them real), ``verify`` keeps
    the draft's accepted prefix and the token after it, and the row's ``step`` is rolled back to
    just past what it kept (the cache beyond it is stale, never attended). A row without a draft
    samples its one token as a plain step does (``sample_token``, its own key, its rules), so a
    request that does not speculate keeps its tokens beside those that do (up to float rounding:
    its logits come from a forward over k + 1 positions). Greedy rows keep the argmax at every
    position: plain decoding's tokens.

    A row's draft length grows by one after a fully accepted draft and falls to what was accepted
    otherwise, and to 0 when its last tokens occurred nowhere before; at 0 it waits
    ``PROBE_AFTER`` steps (plain ones too; doubled for each stall in a row, up to
    ``MAX_DOUBLINGS`` times) before it tries one token again. While no row may draft, the host
    dispatches plain calls (``DecodeOutput.ready``), so failing drafts cost little. No
    ``lax.cond`` picks a one-position forward where no row has a draft: on XLA:CPU the cond added
    1.7 plain steps' time to a step of the bench config (BENCHMARKS.md).

    ``mask`` is the call's, all off: the host never makes a call with a structured output
    speculative. Returns the state and a ``DecodeOutput`` of ``[k + 1, B]`` tokens (with
    drafted/accepted)."""
    b, t = state.tokens.shape[0], k + 1
    step_B = state.memory.step
    split = jax.vmap(jax.random.split)(state.keys)
    keys, sample_keys = split[:, 0], split[:, 1]
    # a row at the end of the attended positions waits for a call over more of them
    valid_B = state.active & (step_B < kv_len)
    draft_BK, found_B = ngram_draft(state.history, step_B + 1, k)
    room_B = jnp.minimum(state.remaining - 1, kv_len - step_B - 1)  # tokens it may still add after the first
    count_B = jnp.where(valid_B, jnp.clip(jnp.minimum(jnp.minimum(found_B, state.draft_len), room_B), 0, k), 0)
    top = min(TOP_K, state.counts.shape[1])
    real_BK = jnp.arange(k)[None, :] < count_B[:, None]
    tokens_BT = jnp.concatenate([state.tokens[:, None], jnp.where(real_BK, draft_BK, 0)], axis=1)
    out = apply({"params": params}, tokens_BT, state.memory, jnp.where(valid_B, count_B + 1, 0), False, kv_len)
    raw_BTV = out.logits.astype(jnp.float32)
    # the plain step's sample for every row (the rows without a draft keep it), its rules at position 0
    plain = sample_token(raw_BTV[:, 0], state.settings, sample_keys, sampler, state.constraints(mask))
    settings_R = jax.tree_util.tree_map(lambda a: jnp.repeat(a, t, axis=0), state.settings)
    flat_RV = raw_BTV.reshape(b * t, -1)
    filtered = filter_logits(flat_RV, settings_R, sampler).reshape(b, t, -1)
    accepted_B, next_B = verify(jax.nn.softmax(filtered, axis=-1), draft_BK, count_B,
                                state.settings.temperature <= 0, sample_keys, argmax_BT=jnp.argmax(raw_BTV, axis=-1))
    drafting = count_B > 0
    next_B = jnp.where(drafting, next_B, plain.token_id)
    accepted_B = jnp.where(drafting, accepted_B, 0)
    # the row's tokens this step: its accepted draft, then the token after it
    j = jnp.arange(t)[None, :]
    emitted_BT = jnp.where(j < accepted_B[:, None], jnp.pad(draft_BK, ((0, 0), (0, 1))), next_B[:, None])

    # reported log-probabilities: the model's own at each position
    def summary():
        top_logits, top_ids, lse, _ = sampler.logits_summary(flat_RV, top)
        chosen = jnp.take_along_axis(flat_RV, emitted_BT.reshape(-1, 1), axis=-1)[:, 0] - lse
        return (chosen.reshape(b, t), top_ids.astype(jnp.int32).reshape(b, t, top),
                jnp.exp(top_logits - lse[:, None]).reshape(b, t, top))

    def none():
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, top), jnp.int32), jnp.zeros((b, t, top), jnp.float32)

    logprob_BT, top_ids_BTk, top_probs_BTk = jax.lax.cond(jnp.any(state.settings.logprobs >= 0), summary, none)
    sample = SampleOutput(token_id=emitted_BT.T, logprob=logprob_BT.T, top_k_token_ids=top_ids_BTk.transpose(1, 0, 2),
                          top_k_probs=top_probs_BTk.transpose(1, 0, 2))
    # which of the row's k + 1 tokens it keeps: its accepted draft and the next, up to one that ends it
    remaining_BT = state.remaining[:, None] - (j + 1)
    ends_BT = ends(emitted_BT.reshape(-1), jnp.repeat(state.stop_ids, t, axis=0), remaining_BT.reshape(-1)).reshape(b, t)
    candidate_BT = valid_B[:, None] & (j <= accepted_B[:, None])
    ended_B = jnp.any(candidate_BT & ends_BT, axis=1)
    first_end_B = jnp.argmax(candidate_BT & ends_BT, axis=1)
    kept_BT = candidate_BT & (~ended_B[:, None] | (j <= first_end_B[:, None]))
    n_B = jnp.sum(kept_BT, axis=1).astype(jnp.int32)  # tokens kept (0 for a row that did not step)
    last_B = jnp.take_along_axis(emitted_BT, jnp.maximum(n_B - 1, 0)[:, None], axis=1)[:, 0]
    # the state: the cache rolled back to the kept tokens, the history and the adaptive draft length
    rows_BT = jnp.where(kept_BT, jnp.arange(b)[:, None], b)
    grow = drafting & (accepted_B == count_B)
    unmatched = valid_B & (state.draft_len > 0) & (found_B == 0)  # nothing to follow: as good as refused
    draft_len = jnp.where(drafting, jnp.where(grow, jnp.minimum(state.draft_len + 1, state.speculative), accepted_B),
                          jnp.where(unmatched, 0, state.draft_len))
    stalled = (drafting | unmatched) & (draft_len == 0)
    misses = jnp.where(stalled, state.misses + 1, jnp.where(drafting & (accepted_B > 0), 0, state.misses))
    draft_len, wait = _count_down(state.replace(draft_len=draft_len), valid_B & ~stalled)
    wait = jnp.where(stalled, PROBE_AFTER << jnp.minimum(misses - 1, MAX_DOUBLINGS), wait)
    state = state.replace(
        memory=out.memory.replace(step=step_B + n_B),
        tokens=jnp.where(n_B > 0, last_B, state.tokens),
        keys=jnp.where(valid_B[:, None], keys, state.keys),
        remaining=state.remaining - n_B,
        active=state.active & ~ended_B,
        unstoppable=state.unstoppable - n_B,
        counts=state.counts.at[rows_BT, emitted_BT].add(1, mode="drop"),
        history=state.history.at[rows_BT, step_B[:, None] + 1 + j].set(emitted_BT, mode="drop"),
        draft_len=draft_len, wait=wait, misses=misses)
    return state, DecodeOutput(sample, kept_BT.T, (kept_BT & ends_BT).T, count_B, jnp.minimum(accepted_B, n_B),
                               _ready(state))


def _count_down(state: DecodeState, stepped_B):
    """(draft_len, wait) after a step: a speculating row that waits (draft length 0) and stepped
    is a step closer to trying a draft of one token again."""
    waiting = stepped_B & (state.draft_len == 0) & (state.speculative > 0)
    wait = jnp.where(waiting, state.wait - 1, state.wait)
    return jnp.where(waiting & (wait <= 0), 1, state.draft_len), wait


def _ready(state: DecodeState):
    """The rows whose next step may draft: the host makes the next call speculative only if one may."""
    return state.active & (state.speculative > 0) & (state.draft_len > 0)


class _PerStatic:
    """Calls ``make(**statics)(*args)``, making each jitted variant once."""

    def __init__(self, make):
        self.make = make
        self.variants = {}

    def variant(self, **statics):
        """The jitted function for these static settings (``.lower(...)`` etc. work on it)."""
        key = tuple(sorted(statics.items()))
        if key not in self.variants:
            self.variants[key] = self.make(**statics)
        return self.variants[key]

    def __call__(self, *args, **statics):
        return self.variant(**statics)(*args)
