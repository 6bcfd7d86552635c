"""``ModelRunner``: parameters on a mesh and the four jit-compiled functions that serve them.

- ``forward(params, tokens, lengths)`` -> logits for whole sequences (scoring, tests, parity).
- ``new_memory()`` -> a zeroed ``KVMemory`` with its sharding (batch over ``data``, KV heads over
  ``model``).
- ``prefill_memory(params, state, args, kv_len)`` -> writes one request's prompt chunk
  (``state.PrefillArgs``: slot, padded tokens, sampling settings, ...) into its slot of the decode
  state and samples its first token; compiled once per pad bucket.
- ``sample_step(params, state, kv_len, steps)`` -> ``steps`` decode steps of every slot in one
  call (a scan on device, each slot stopping at its EOS, stop tokens or budget), attending to
  the first ``kv_len`` cache positions only; compiled once per KV-length bucket.

The step functions themselves, ``prefill`` and ``decode``, are pure and at module level; this
class places the parameters, chooses the backend (``runner.selection``) and jits them. The decode state
(``runner/state.py``) is one pytree donated to every call, so XLA updates it in place. All shardings are derived from
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
from model.memory import KVMemory, new_memory
from model.sharding import (DEFAULT_RULES, activation_sharding, make_mesh, memory_specs, param_shardings,
                            spec_for)
from model.transformer import LanguageModel
from runner.sampling import SampleOutput, SampleSettings, sample_token
from runner.selection import BACKENDS, Selection, choose, start
from runner.state import MAX_STOP_IDS, DecodeOutput, DecodeState, PrefillArgs

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
    # Activation dtype override. From a checkpoint on CPU the default is float32 with int8 weights
    # dequantised once at load: XLA:CPU runs bf16/int8 matmuls 20-40x slower than fp32 (DESIGN.md).
    dtype: str | None = None
    dequantize: bool | None = None  # int8 -> float at load; default: on CPU only
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

    def initialize(self, mesh: Mesh | None = None, batch_size: int | None = None) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"ModelRunner.backend must be one of {BACKENDS}, got {self.backend!r}")
        self.mesh = mesh or self.mesh or make_mesh((1, 1), jax.devices()[:1])
        self.rules = DEFAULT_RULES if self.rules is None else self.rules
        start(self.backend, self.mesh)  # the kernels' compiler runs while the checkpoint is restored
        if self.params is None:
            self._restore()
        elif self.model is None:
            raise ValueError("ModelRunner.model (a ModelConfig) is required with params")
        if self.dtype is not None:
            self.model = dataclasses.replace(self.model, fprop_dtype=self.dtype)
        self.batch_size = batch_size or max(1, int(self.bs_per_device * self.mesh.size))
        data = self.mesh.shape["data"]
        if self.batch_size % data:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by the mesh's data axis ({data})")
        self.selection = choose(self.backend, self.mesh, self.model, self.params, self.batch_size,
                                        self.calibration_tokens)
        for line in self.selection.report().splitlines():
            log.info("%s", line)
        # shardings of the canonical parameters; the backend's layout is derived from them in place
        self.param_shardings = param_shardings(self.params, self.mesh, self.rules)
        self.params = self.selection.backend.prepare(jax.device_put(self.params, self.param_shardings))
        self._build()

    def backend_report(self) -> str:
        """The backend and why; for the CPU backend one line per kernel: taken or XLA's op, and the
        measured ratio or the reason."""
        return self.selection.report()

    def _restore(self) -> None:
        from checkpoints import restore

        if self.checkpoint_path is None:
            raise ValueError("ModelRunner needs checkpoint_path or params")
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        dequantize = on_cpu if self.dequantize is None else self.dequantize
        restored = restore(self.checkpoint_path, mesh=self.mesh, config=self.model, rules=self.rules,
                           dequantize=dequantize, dtype=np.float32 if dequantize else None)
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
            settings=SampleSettings(*(self._named(batch) for _ in range(3))),
            keys=self._named(P(*batch, None)),
            active=self._named(batch),
            remaining=self._named(batch),
            stop_ids=self._named(P(*batch, None)),
        )

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
        abstract_memory = jax.eval_shape(lambda: new_memory(config, b))
        state_sh = self.state_shardings(abstract_memory)
        replicated = self._named(P())
        out_sh = SampleOutput(*(replicated for _ in range(4)))

        def forward(params, tokens, lengths):
            return apply({"params": params}, tokens, None, lengths).logits

        def _new_memory():
            return new_memory(config, b)

        scalars = jax.tree_util.tree_map(lambda _: replicated, PrefillArgs(*range(10)))
        decode_sh = DecodeOutput(out_sh, replicated)
        self.forward = jax.jit(forward, in_shardings=(params_sh, None, None))
        self.new_memory = jax.jit(_new_memory, out_shardings=state_sh.memory)
        # One jitted function per static setting (KV length, or KV length x steps), each with
        # explicit shardings; made on first use, which warm-up does for every bucket.
        self.prefill_memory = _PerStatic(lambda kv_len: jax.jit(
            functools.partial(prefill, apply, sampler, kv_len=kv_len),
            in_shardings=(params_sh, state_sh, scalars),
            out_shardings=(state_sh, out_sh), donate_argnums=1))
        self.sample_step = _PerStatic(lambda kv_len, steps: jax.jit(
            functools.partial(decode, apply, sampler, kv_len=kv_len, steps=steps),
            in_shardings=(params_sh, state_sh), out_shardings=(state_sh, decode_sh), donate_argnums=1))
        self.release_slot = jax.jit(DecodeState.release, in_shardings=(state_sh, replicated),
                                    out_shardings=state_sh, donate_argnums=0)
        self._state_shardings = state_sh

    def new_state(self) -> DecodeState:
        """A fresh decode state: zeroed memory, every slot free."""
        b = self.batch_size
        sh = self._state_shardings
        return DecodeState(
            memory=self.new_memory(),
            tokens=jax.device_put(np.zeros((b,), np.int32), sh.tokens),
            settings=jax.device_put(SampleSettings(
                temperature=np.zeros((b,), np.float32), nucleus_p=np.ones((b,), np.float32),
                top_k=np.zeros((b,), np.int32)), sh.settings),
            keys=jax.device_put(np.zeros((b, 2), np.uint32), sh.keys),
            active=jax.device_put(np.zeros((b,), bool), sh.active),
            remaining=jax.device_put(np.zeros((b,), np.int32), sh.remaining),
            stop_ids=jax.device_put(np.full((b, MAX_STOP_IDS), -1, np.int32), sh.stop_ids),
        )


def prefill(apply, sampler, params, state: DecodeState, args: PrefillArgs, kv_len: int):
    """One prompt chunk of one request into its slot of ``state``, and its first token sampled.
    ``apply(variables, tokens, memory, lengths, last_only, kv_len)`` is the model; ``sampler`` the
    backend that ``sample_token`` cuts and summarises on. Pure: jitted with ``state`` donated."""
    row = state.memory.row(args.slot)
    row = row.replace(step=jnp.where(args.reset, 0, row.step))
    out = apply({"params": params}, args.tokens, row, args.length[None], True, kv_len)
    # The key is derived from the seed alone, so chunking never changes a request's samples.
    key, sample_key = jax.random.split(jax.random.PRNGKey(args.seed))
    settings = SampleSettings(temperature=args.temperature[None], nucleus_p=args.nucleus_p[None],
                              top_k=args.top_k[None])
    first = sample_token(out.logits[:, -1], settings, sample_key[None], sampler)
    return state.insert(args, state.memory.with_row(args.slot, out.memory), first, key), first


def decode(apply, sampler, params, state: DecodeState, kv_len: int, steps: int):
    """``steps`` decode steps of every slot (a scan on device), attending to the first ``kv_len``
    cache positions; each slot stops at its EOS, stop tokens or budget. Pure, like ``prefill``."""
    def one(state, _):
        split = jax.vmap(jax.random.split)(state.keys)  # [B, 2, 2]
        keys, sample_keys = split[:, 0], split[:, 1]
        valid = state.active
        lengths = valid.astype(jnp.int32)  # free and finished slots do not advance
        out = apply({"params": params}, state.tokens[:, None], state.memory, lengths, False, kv_len)
        sample = sample_token(out.logits[:, 0], state.settings, sample_keys, sampler)
        tokens = jnp.where(valid, sample.token_id, state.tokens)
        remaining = state.remaining - lengths
        stopped = jnp.any(tokens[:, None] == state.stop_ids, axis=1)
        state = state.replace(memory=out.memory, tokens=tokens, keys=keys, remaining=remaining,
                              active=valid & ~stopped & (remaining > 0))
        return state, (sample, valid)

    state, (samples, valid) = jax.lax.scan(one, state, None, length=steps)
    return state, DecodeOutput(samples, valid)


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
