"""``Executor``: parameters on a mesh, the decode state, and the compiled steps that change it.

It knows arrays, not requests or text: the engine (``runner/engine.py``) hands it host batches
(``runner.state.PrefillBatch``, a ``TokenMask``) and static shapes, and it dispatches one jitted
call per operation, each named once, as the reference runner names them where it has a name:

- ``forward(params, tokens, lengths)`` -> logits of whole sequences (scoring, tests, parity);
- ``new_memory()`` -> a zeroed ``KVMemory`` with its sharding (batch over ``data``, KV heads over
  ``model``);
- ``prefill_memory(batch, score)``: the prompt chunks of several requests into their slots,
  each last chunk's first token sampled (``runner.steps.prefill``); a variant per (rows, bucket,
  score), the chunks packed into one row of the bucket's tokens;
- ``sample_step(kv_len, steps, mask, speculative)``: ``steps`` decode steps of every slot
  (``runner.steps.decode``); a variant per KV length (the count of steps a dynamic argument up to
  the most compiled), and per (KV length, steps) of a speculative call;
- ``fork(logits, row, source, batch)``: a slot's cache copied to a request with the same prompt;
- ``release(slot)``: a slot stops at once (its request was cancelled or failed).

The decode state (``runner/state.py``) is one pytree donated to every call, so XLA updates it in
place; those calls and ``reset`` are the only ways it changes. ``compile`` builds every variant
the scheduler can ask for before serving, so serving never compiles. All shardings derive from the
rules in ``model/sharding.py``; sampled outputs are replicated so every host can read them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.memory import KV_DTYPES, KVMemory, kv_zeros, new_memory
from model.quant import QUANTIZE, quantize_params
from model.sharding import (DEFAULT_RULES, KV_MEMORY_AXES, activation_sharding, make_mesh, memory_specs,
                            param_shardings, spec_for)
from model.transformer import LanguageModel
from runner.batches import empty_batch
from runner.compile_count import step_compiled
from runner.model_runner import ModelRunner
from runner.sampling import SampleOutput, SampleSettings
from runner.executables import open_store, stable_repr, tree_signature
from runner.selection import BACKENDS, Selection, choose, one_cpu_device, start
from runner.startup import Startup
from runner.state import MAX_STOP_IDS, DecodeOutput, DecodeState, PrefillBatch, PrefixPool, TokenMask
from runner.steps import decode, fork, prefill


log = logging.getLogger("grok_runner")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What ``Executor.create`` restored or was given: the config (with the activations' dtype),
    the canonical parameters, the mesh, and the tokenizer the checkpoint holds (None: none)."""

    config: ModelConfig
    params: dict
    mesh: Mesh
    tokenizer_path: str | None


class Executor:
    """The parameters (in the backend's layout, placed), the decode state and the jitted steps of
    one model served in ``batch_size`` slots. Made ready by ``create``."""

    def __init__(self, spec: ModelRunner, loaded: Loaded, batch_size: int, selection: Selection,
                 prefix_blocks: int, prefix_block_size: int, *, abstract: bool = False):
        self.shapes_only = abstract  # ``Executor.abstract``: parameters and state are shapes
        self.spec, self.config, self.mesh = spec, loaded.config, loaded.mesh
        self.rules = DEFAULT_RULES if spec.rules is None else spec.rules
        self.tokenizer_path, self.batch_size, self.selection = loaded.tokenizer_path, batch_size, selection
        self.kv_dtype = spec.kv_dtype
        self.prefix_blocks, self.prefix_block_size = prefix_blocks, prefix_block_size
        # shardings of the canonical parameters; the backend's layout is derived from them in place
        self.param_shardings = param_shardings(loaded.params, self.mesh, self.rules)
        if abstract:  # shapes placed by their shardings, nothing allocated (``Executor.abstract``)
            self.params = _placed_shapes(loaded.params, self.param_shardings)
        else:
            self.params = selection.backend.prepare(jax.device_put(loaded.params, self.param_shardings))
        self._build()
        self._executables: dict[tuple, object] = {}  # each variant compiled at start (``compile``) or on demand
        self._plain_steps: dict[int, int] = {}  # KV length -> the most steps of its plain decode variant
        self._store = None  # where a variant first called while serving is looked up and kept (``on_demand``)
        self._loading: dict[tuple, concurrent.futures.Future] = {}  # variants loading ahead (``on_demand``)
        self.state = self.new_state()

    @classmethod
    def abstract(cls, config: ModelConfig, params, mesh: Mesh, batch_size: int, *, kv_dtype: str | None = None,
                 rules: dict | None = None, prefix_blocks: int = 0, prefix_block_size: int = 16) -> "Executor":
        """An executor of shapes alone, on the XLA backend: ``params`` (``jax.ShapeDtypeStruct``
        leaves, as ``model.plan.abstract_params`` gives them) and the decode state are abstract,
        placed by the rules, so every step ``variants`` names lowers and compiles as a server's
        would, with nothing allocated: Grok-1's steps compile on a laptop (``grok-runner plan``)."""
        spec = ModelRunner(model=config, params=params, backend="xla", kv_dtype=kv_dtype, rules=rules)
        selection = choose("xla", mesh, config, params, batch_size)
        return cls(spec, Loaded(config, params, mesh, None), batch_size, selection, prefix_blocks,
                   prefix_block_size, abstract=True)

    @classmethod
    def create(cls, spec: ModelRunner, mesh: Mesh | None = None, batch_size: int | None = None,
               prefix_blocks: int | str = 0, prefix_block_size: int = 16, prefix_bytes: int = 0,
               startup: Startup | None = None, abstract: bool = False) -> "Executor":
        """Restore (or place) ``spec``'s parameters, choose the backend and build the compiled
        steps and the decode state, with a prefix pool (``runner.prefix_cache``) of
        ``prefix_blocks`` blocks of ``prefix_block_size`` positions ("auto": as many as the slots
        hold positions), or of as many as ``prefix_bytes`` hold (0: none). Each phase is marked
        on ``startup``. With ``abstract`` nothing is read or allocated: the parameters and the
        state are the shapes, dtypes and placements the same call would give (the checkpoint's
        headers alone), so its steps compile ahead of the weights into the store a server of
        the same settings loads (``InferenceRunner.compile_ahead``); the XLA backend only (the
        CPU backend's layout is made from the weights)."""
        startup = startup or Startup.quiet()
        if spec.backend not in BACKENDS:
            raise ValueError(f"ModelRunner.backend must be one of {BACKENDS}, got {spec.backend!r}")
        if spec.kv_dtype is not None and spec.kv_dtype not in KV_DTYPES:
            raise ValueError(f"ModelRunner.kv_dtype must be None or one of {KV_DTYPES}, got {spec.kv_dtype!r}")
        if spec.quantize not in QUANTIZE:
            raise ValueError(f"ModelRunner.quantize must be one of {QUANTIZE}, got {spec.quantize!r}")
        mesh = mesh or spec.mesh or make_mesh((1, 1), jax.devices()[:1])
        if abstract and spec.backend != "xla" and one_cpu_device(mesh):
            raise ValueError(f"compiling ahead of the weights takes the XLA backend (backend='xla'), got "
                             f"backend={spec.backend!r} on one CPU device: the CPU backend lays out the weights")
        if not abstract:
            start(spec.backend, mesh)  # the kernels' compiler runs while the checkpoint is restored
        with startup.phase("restore"):
            loaded = _load(spec, mesh, abstract)
        batch_size = batch_size or max(1, int(spec.bs_per_device * mesh.size))
        data = mesh.shape["data"]
        if batch_size % data:
            raise ValueError(f"batch_size {batch_size} is not divisible by the mesh's data axis ({data})")
        config = loaded.config
        if prefix_blocks == "auto":  # once the checkpoint's sequence_len is known
            prefix_blocks = -(-batch_size * config.sequence_len // prefix_block_size)
        elif prefix_bytes and not prefix_blocks:
            prefix_blocks = prefix_bytes // (config.kv_bytes_per_token(_cache_dtype(config, spec.kv_dtype))
                                             * prefix_block_size)
        with startup.phase("backend"):  # the kernels built (or loaded) and calibrated (or read)
            selection = choose(spec.backend, mesh, config, loaded.params, batch_size, spec.calibration_tokens,
                               spec.kv_dtype, w8a8=spec.quantize == "w8a8")
        for line in selection.report().splitlines():
            log.info("%s", line)
        log.info("%s", kv_report(config, spec.kv_dtype))
        with startup.phase("layout"):  # the parameters in the backend's layout, placed; the state
            return cls(spec, loaded, batch_size, selection, prefix_blocks, prefix_block_size, abstract=abstract)

    # ---- what it runs and holds ----------------------------------------------------------------
    def backend_report(self) -> str:
        """The backend and why; for the CPU backend one line per kernel: taken or XLA's op, and the
        measured ratio or the reason."""
        return self.selection.report()

    def cache_dtype(self) -> str:
        """What the KV cache and the prefix pool hold: ``kv_dtype``, by default the activations'."""
        return _cache_dtype(self.config, self.kv_dtype)

    def kv_report(self) -> str:
        """One line: what the KV cache (and the prefix pool) holds, and its bytes a token."""
        return kv_report(self.config, self.kv_dtype)

    def store(self, directory: str | None):
        """The store of this executor's compiled steps under ``directory`` (None: none): keyed
        by the code, the platform, the model and its placement (``runner.executables``)."""
        if directory is None:
            return None
        return open_store(directory, repr(self.config), tree_signature(self.params), tree_signature(self.state),
                          stable_repr(self.selection.backend), stable_repr(self.selection.choices),
                          stable_repr(self.rules), repr((self.batch_size, self.kv_dtype, self.prefix_blocks,
                                                  self.prefix_block_size)),
                          devices=list(self.mesh.devices.flat))

    def prefix_block_bytes(self) -> int:
        """Bytes of one prefix pool block: K and V of every layer over ``prefix_block_size`` positions."""
        return self.config.kv_bytes_per_token(self.cache_dtype()) * self.prefix_block_size

    # ---- shardings ---------------------------------------------------------------------------
    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def state_shardings(self, memory: KVMemory) -> DecodeState:
        batch = spec_for(("batch",), self.rules)
        row, table = self._named(batch), self._named(P(*batch, None))
        named = lambda tree: jax.tree_util.tree_map(self._named, tree, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
        return DecodeState(
            memory=named(memory_specs(memory, self.rules, self.mesh)), tokens=row,
            settings=SampleSettings(*(row for _ in dataclasses.fields(SampleSettings))),
            keys=table, active=row, remaining=row, stop_ids=table, unstoppable=row, counts=table, seen=table,
            history=table, speculative=row, draft_len=row, wait=row, misses=row, pool=self._pool_shardings())

    def _pool_shardings(self) -> PrefixPool | None:
        """The prefix pool's: its blocks replicated over ``data`` (any slot may read any block),
        its KV heads split like the cache's."""
        if not self.prefix_blocks:
            return None
        block = self._named(P(None, None, *spec_for(KV_MEMORY_AXES[2:], self.rules)))
        return jax.tree_util.tree_map(lambda _: block, jax.eval_shape(self._new_pool))

    def _new_pool(self) -> PrefixPool:
        c = self.config
        shape = (c.num_layers, self.prefix_blocks, c.num_kv_heads, self.prefix_block_size, c.key_size)
        return PrefixPool(k=kv_zeros(shape, self.cache_dtype()), v=kv_zeros(shape, self.cache_dtype()))

    # ---- the jitted steps ----------------------------------------------------------------------
    def _build(self) -> None:
        config, b, backend = self.config, self.batch_size, self.selection.backend
        module = LanguageModel(config, backend)

        def apply(*args):
            with activation_sharding(self.mesh, self.rules):  # active while tracing only
                return module.apply(*args)

        params_sh = jax.tree_util.tree_map(lambda a: a.sharding, self.params)  # the backend's layout, placed
        state_sh = self.state_shardings(jax.eval_shape(lambda: new_memory(config, b, dtype=self.kv_dtype)))
        replicated = self._named(P())
        out_sh = SampleOutput(*(replicated for _ in range(4)))
        rows = jax.tree_util.tree_map(lambda _: replicated, jax.eval_shape(lambda: self.empty_batch(1, 1)))
        mask_sh = TokenMask(words=state_sh.counts, on=state_sh.active, hold=state_sh.active)
        step_out_sh = DecodeOutput(out_sh, replicated, replicated)
        self.forward = jax.jit(lambda params, tokens, lengths: apply({"params": params}, tokens, None, lengths).logits,
                               in_shardings=(params_sh, None, None))
        self.new_memory = jax.jit(lambda: new_memory(config, b, dtype=self.kv_dtype), out_shardings=state_sh.memory)
        # One jitted function per static setting, each with explicit shardings (a prefill's is also
        # compiled per shape of its batch); ``compile`` builds every variant before serving.
        self._prefill = _PerStatic(lambda score=False: jax.jit(
            functools.partial(prefill, apply, backend, score=score),
            in_shardings=(params_sh, state_sh, rows),
            out_shardings=(state_sh, step_out_sh, replicated, replicated), donate_argnums=1))
        spec_out_sh = DecodeOutput(out_sh, replicated, replicated, replicated, replicated, replicated)
        decode_out_sh = DecodeOutput(out_sh, replicated, replicated, ready=replicated)
        self._decode = _PerStatic(lambda kv_len, steps, speculative=0: jax.jit(
            functools.partial(decode, apply, backend, kv_len=kv_len, steps=steps, speculative=speculative),
            in_shardings=(params_sh, state_sh, mask_sh, replicated),
            out_shardings=(state_sh, spec_out_sh if speculative else decode_out_sh), donate_argnums=1))
        self._mask_shardings = mask_sh
        self.no_mask = jax.device_put(self.host_mask(), mask_sh)  # a decode call's mask when no row has one
        self._fork = jax.jit(functools.partial(fork, backend),
                             in_shardings=(state_sh, replicated, replicated, replicated, rows),
                             out_shardings=(state_sh, step_out_sh), donate_argnums=0)
        self._release = jax.jit(DecodeState.release, in_shardings=(state_sh, replicated),
                                out_shardings=state_sh, donate_argnums=0)
        self._state_shardings = state_sh

    # ---- the calls that change the state (dispatched, never waited for) -------------------------
    def prefill_memory(self, batch: PrefillBatch, score: bool = False):
        """One prefill call (``runner.steps.prefill``): the sampled tokens, each row's last logits
        (left on the device for ``fork``) and, with ``score``, its positions' ``PromptScores``."""
        step = self._ready(("prefill", batch.slots.shape[0], batch.tokens.shape[0], score), self._prefill_variant)
        self.state, out, logits, scores = step(self.params, self.state, batch)
        return out, logits, scores

    def fork(self, logits, row: int, source: int, batch: PrefillBatch) -> DecodeOutput:
        """Slot ``source`` copied into the one-row ``batch``'s slot, its first token sampled from row
        ``row`` of ``logits`` (``runner.steps.fork``)."""
        step = self._executables.get(("fork",), self._fork)
        self.state, out = step(self.state, logits, np.int32(row), np.int32(source), batch)
        return out

    def sample_step(self, kv_len: int, steps: int, mask: TokenMask | None = None, speculative: int = 0) -> DecodeOutput:
        """``steps`` decode steps of every slot (``runner.steps.decode``), the rows of ``mask`` that
        are on (host arrays, ``host_mask``) one step under it, or with ``speculative`` (no mask)
        steps that verify up to that many draft tokens a slot."""
        mask = self.no_mask if mask is None else jax.device_put(mask, self._mask_shardings)
        # a plain call runs in the variant of the most steps compiled, its count a dynamic argument
        most = steps if speculative else max(steps, self._plain_steps.get(kv_len, 0))
        step = self._ready(("decode", kv_len, most, speculative), self._decode_variant)
        self.state, out = step(self.params, self.state, mask, np.int32(steps))
        return out

    def release(self, slot: int) -> None:
        """Stop ``slot`` generating at once (its request was cancelled or failed)."""
        self.state = self._executables.get(("release",), self._release)(self.state, np.int32(slot))

    def reset(self) -> None:
        """A fresh state, every slot free (after a device call failed and took the state with it)."""
        self.state = self.new_state()

    # ---- host arrays of a call's inputs ----------------------------------------------------------
    def host_mask(self, rows: int | None = None) -> TokenMask:
        """A ``TokenMask`` of ``rows`` rows (default: the batch) with every row off, as host arrays."""
        rows = self.batch_size if rows is None else rows
        return TokenMask(words=np.zeros((rows, -(-self.config.vocab_size // 32)), np.uint32),
                         on=np.zeros((rows,), bool), hold=np.zeros((rows,), bool))

    def empty_batch(self, rows: int, bucket: int) -> PrefillBatch:
        """A prefill batch of ``rows`` padding rows of ``bucket`` tokens, with the pool's block tables."""
        blocks = self.config.sequence_len // self.prefix_block_size if self.prefix_blocks else 0
        return empty_batch(rows, bucket, self.batch_size, blocks, self.prefix_blocks,
                           vocab_size=self.config.vocab_size)

    def new_state(self) -> DecodeState:
        """A fresh decode state: zeroed memory, every slot free (placed, nothing compiled); an
        abstract executor's, its shapes placed by their shardings (nothing allocated)."""
        b, c, sh = self.batch_size, self.config, self._state_shardings
        if self.shapes_only:
            put = placed_zeros = _placed_shapes
        else:
            put, placed_zeros = jax.device_put, _zeros
        zeros = lambda shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        memory = jax.eval_shape(lambda: new_memory(c, b, dtype=self.kv_dtype))
        return DecodeState(
            memory=placed_zeros(memory, sh.memory), tokens=put(zeros((b,)), sh.tokens),
            settings=put(SampleSettings.host(b), sh.settings), keys=put(zeros((b, 2), np.uint32), sh.keys),
            active=put(zeros((b,), bool), sh.active), remaining=put(zeros((b,)), sh.remaining),
            stop_ids=put(np.full((b, MAX_STOP_IDS), -1, np.int32), sh.stop_ids),
            unstoppable=put(zeros((b,)), sh.unstoppable), counts=put(zeros((b, c.vocab_size)), sh.counts),
            seen=put(zeros((b, c.vocab_size), bool), sh.seen),
            history=put(np.full((b, c.sequence_len), -1, np.int32), sh.history),
            speculative=put(zeros((b,)), sh.speculative), draft_len=put(zeros((b,)), sh.draft_len),
            wait=put(zeros((b,)), sh.wait), misses=put(zeros((b,)), sh.misses),
            pool=placed_zeros(jax.eval_shape(self._new_pool), sh.pool) if self.prefix_blocks else None)

    # ---- warm-up -------------------------------------------------------------------------------
    def variants(self, prefills: list[tuple[int, int, bool]], decodes: list[tuple[int, int, int]]):
        """``(key, name, lower)`` of each variant: a prefill per (rows, bucket, score) of
        ``prefills``, a decode per (KV length, steps, speculative) of ``decodes``, a fork and a
        release; ``lower()`` traces and lowers it (``jax.stages.Lowered``)."""
        out = [self._prefill_variant(*prefill) for prefill in prefills]
        out += [self._decode_variant(*decode) for decode in decodes]

        def lower_fork():  # slot 0 onto itself; its logits placed like a prefill's output
            logits = jax.ShapeDtypeStruct((self.batch_size, self.config.vocab_size), np.float32,
                                          sharding=self._named(P()))
            return self._fork.lower(self.state, logits, np.int32(0), np.int32(0), self.empty_batch(1, 1))

        out.append((("fork",), "fork", lower_fork))
        out.append((("release",), "release", lambda: self._release.lower(self.state, np.int32(0))))
        return out

    def _prefill_variant(self, rows: int, bucket: int, score: bool):
        def lower():
            return self._prefill.variant(score=score).lower(self.params, self.state, self.empty_batch(rows, bucket))
        return ("prefill", rows, bucket, score), f"prefill rows={rows} bucket={bucket} score={score}", lower

    def _decode_variant(self, kv: int, steps: int, speculative: int):
        def lower():
            return self._decode.variant(**_decode_statics(kv, steps, speculative)).lower(
                self.params, self.state, self.no_mask, np.int32(steps))
        return ("decode", kv, steps, speculative), f"decode kv={kv} steps={steps} speculative={speculative}", lower

    def on_demand(self, store, decodes: list[tuple[int, int, int]]) -> None:
        """Serving without the warm-up (``compile``): each variant is made ready the first time a
        round calls it, loaded from ``store`` (``runner.executables``; None: none) where it holds
        it, else compiled and stored; so a caller that uses a few shapes compiles those alone. A
        plain decode call runs in its KV length's variant of the most steps of ``decodes``, as
        after the warm-up (one variant a KV length)."""
        self._store = store
        for kv, n, k in decodes:
            if not k:
                self._plain_steps[kv] = max(n, self._plain_steps.get(kv, 0))
        if store is not None:
            # Every request decodes after its prefill: the plain decode steps are loaded from the
            # store on another core meanwhile (the shipped model's, 0.3 s beside its prefill's
            # 0.6 s, run.py's first token after both), so the first request waits for one load.
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-ahead")
            for kv, n in self._plain_steps.items():
                key, name, _ = self._decode_variant(kv, n, 0)
                self._loading[key] = pool.submit(store.load, name)
            pool.shutdown(wait=False)

    def _ready(self, key: tuple, variant):
        """The executable of ``key``: compiled at start, or made ready now (``on_demand``) from
        ``variant(*key[1:])``'s ``(key, name, lower)``, built only then (a call's only host work
        here is the lookup)."""
        step = self._executables.get(key)
        if step is None:
            _, name, lower = variant(*key[1:])
            loading = self._loading.pop(key, None)
            if loading is not None:
                step = loading.result()  # None: not in the store after all
            elif self._store is not None:
                step = self._store.load(name)
            if step is None:
                step = _compiled(self._store, name, lower())
            self._executables[key] = step
        return step

    def compile(self, prefills: list[tuple[int, int, bool]], decodes: list[tuple[int, int, int]],
                store=None, startup=None) -> dict:
        """At start: make every variant a serving engine can call ready (``variants``), so serving
        never compiles or traces: each is loaded from ``store`` (``runner.executables``) where
        it holds it, else traced, lowered and compiled (side by side on the host's cores: XLA
        compiles without the GIL) and stored. Progress goes to ``startup``
        (``runner.startup.Startup``). Returns how many were loaded and compiled."""
        for kv, n, k in decodes:
            if not k:
                self._plain_steps[kv] = max(n, self._plain_steps.get(kv, 0))
        variants = self.variants(prefills, decodes)
        # The prefills that score prompts serve one kind of request (echo with logprobs): where
        # the store holds them they load on a thread of their own once the start is over (a
        # request that comes first waits for its load; nothing compiles), and a start loads the
        # steps every request calls alone (bench config: 9 of 12, 1.1 s of its 2.4 s of loading).
        later = [] if store is None or self.shapes_only else [
            v for v in variants if v[0][0] == "prefill" and v[0][3] and store.holds(v[1])]
        variants = [v for v in variants if v not in later]
        if startup is not None:
            startup.count(len(variants), "compiled steps")
        step = startup.step if startup is not None else (lambda n=1: None)
        loaded, missing = 0, []
        workers = max(1, os.cpu_count() or 1)

        def load(item):
            executable = store.load(item[1]) if store is not None else None
            if executable is not None:
                step()
            return executable

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:  # XLA loads without the GIL
            for (key, name, lower), executable in zip(variants, pool.map(load, variants)):
                if executable is None:
                    missing.append((key, name, lower))
                else:
                    self._executables[key] = executable
                    loaded += 1
        # Traced in turn (tracing holds the GIL), compiled side by side. With JAX's persistent
        # cache on, XLA:CPU crashed serialising one executable while compiling another (jaxlib
        # 0.10.2: SIGABRT and SIGSEGV in put_executable_and_time), so then in turn.
        workers = 1 if jax.config.jax_compilation_cache_dir else max(1, min(len(missing), os.cpu_count() or 1))

        def build(item):
            key, name, lowered = item
            compiled = _compiled(store, name, lowered)
            step()
            return key, name, compiled

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(build, (key, name, lower())) for key, name, lower in missing]
            for future in futures:
                key, name, compiled = future.result()
                self._executables[key] = compiled
        if later:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-later")
            for key, name, _ in later:
                self._loading[key] = pool.submit(store.load, name)
            pool.shutdown(wait=False)
        return {"loaded": loaded, "compiled": len(missing), "later": len(later)}


def _compiled(store, name: str, lowered):
    """``lowered`` compiled, and kept in ``store`` (``ExecutableStore.compile``) if there is one."""
    step_compiled()
    return lowered.compile() if store is None else store.compile(name, lowered)


def _placed_shapes(tree, shardings):
    """``jax.ShapeDtypeStruct``s of ``tree``'s leaves, each placed by its sharding in ``shardings``."""
    return jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), tree, shardings)


def _zeros(abstract, shardings):
    """Zeroed arrays of ``abstract``'s shapes and dtypes, placed by ``shardings`` (a tree of the
    same structure), on any mesh of any hosts and without compiling anything."""
    def one(leaf, sharding):
        zero = np.zeros((), leaf.dtype)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: np.broadcast_to(zero, leaf.shape)[index])
    return jax.tree_util.tree_map(one, abstract, shardings)


def _decode_statics(kv_len: int, steps: int, speculative: int = 0) -> dict:
    """The static arguments of a decode variant (a plain call names no ``speculative``)."""
    return dict(kv_len=kv_len, steps=steps, **({"speculative": speculative} if speculative else {}))


def _cache_dtype(config: ModelConfig, kv_dtype: str | None) -> str:
    return jnp.dtype(config.dtype if kv_dtype is None else kv_dtype).name


def kv_report(config: ModelConfig, kv_dtype: str | None) -> str:
    """One line: what the KV cache (and the prefix pool) holds, and its bytes a token."""
    kv = _cache_dtype(config, kv_dtype)
    scales = " (int8 values and a float32 scale a token and KV head)" if kv == "int8" else ""
    return f"KV cache: {kv}, {config.kv_bytes_per_token(kv):,} bytes a token{scales}"


def _load(spec: ModelRunner, mesh: Mesh, abstract: bool = False) -> Loaded:
    """``spec``'s config and canonical parameters on ``mesh``: restored from its checkpoint, or
    its own; int8-quantised if it asks; its config in the activations' dtype. With ``abstract``
    the parameters' ``jax.ShapeDtypeStruct``s, nothing read."""
    if spec.params is None:
        loaded = _restore(spec, mesh, abstract)
    elif spec.model is None:
        raise ValueError("ModelRunner.model (a ModelConfig) is required with params")
    else:
        params = jax.eval_shape(lambda: spec.params) if abstract else spec.params
        loaded = Loaded(spec.model, params, mesh, None)
    if spec.quantize in ("int8", "w8a8"):  # int8 weights stay as they are
        params = jax.eval_shape(quantize_params, loaded.params) if abstract else quantize_params(loaded.params)
    else:
        params = loaded.params
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    # From a checkpoint on CPU the activations are float32 unless bf16 was asked for.
    dtype = spec.dtype or ("float32" if spec.params is None and on_cpu else None)
    config = dataclasses.replace(loaded.config, fprop_dtype=dtype) if dtype is not None else loaded.config
    return dataclasses.replace(loaded, config=config, params=params)


def _restore(spec: ModelRunner, mesh: Mesh, abstract: bool = False) -> Loaded:
    from checkpoints import restore

    if spec.checkpoint_path is None:
        raise ValueError("ModelRunner needs checkpoint_path or params")
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    kernels_may_read_int8 = spec.backend != "xla" and one_cpu_device(mesh)
    dequantize = on_cpu and not kernels_may_read_int8 if spec.dequantize is None else spec.dequantize
    # On CPU the float weights are held in the activations' dtype: float32 unless bf16 was asked for.
    held = (jnp.bfloat16 if spec.dtype == "bfloat16" else np.float32) if on_cpu else None
    restored = restore(spec.checkpoint_path, mesh=mesh, config=spec.model,
                       rules=DEFAULT_RULES if spec.rules is None else spec.rules, dequantize=dequantize, dtype=held,
                       abstract=abstract)
    return Loaded(restored.config, restored.params, mesh, restored.tokenizer_path)


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
