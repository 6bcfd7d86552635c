"""Which CPU kernels a runner takes: each timed against the XLA operation it replaces, on this CPU.

The C++ kernels of ``backends/cpu/ops.py`` were tuned on one CPU (a Zen 4 with AVX-512). On another
(other vector registers, caches or bandwidth) XLA's own operation can be the faster one: the
issue that brought this module measured the kernels 2-4x slower than XLA on an AVX2-only EPYC.
So on one CPU device the runner takes a kernel only where it is measured faster here: each
operation is timed both ways, at the shapes the runner calls it with, and the kernel is taken
only if it wins at every one of them (a decode-time win does not buy a prefill-time loss).

Operations (the XLA op each replaces in brackets), and the shapes timed:
- ``moe``: the experts as one grouped panel matmul per weight (XLA's dots on the split experts,
  ``backends.xla.loop_grouped_matmul``), at decode (``batch`` tokens) and prefill (``prefill_tokens``);
- ``projections``: the attention's query/key/value/output projections (``einsum``), same shapes;
- ``unembed``: the tied unembedding of every slot's last hidden state (``einsum``), at decode;
- ``attention``: a decode step's attention read from the cache (``backends.xla.attend``), over a
  cache of ``kv_len`` positions;
- ``sampling_cut``: the top-k/top-p cut by radix select (a sort, ``backends.xla.sorted_threshold``);
- ``logits_summary``: the top 8, normaliser and argmax in one pass (``top_k``, ``logsumexp``, argmax).

Each way is the ``CPU`` backend itself, with the operation's kernel taken and without, so what is
timed is what the model runs.

Weights are synthetic, of the model's shapes, one set per layer up to ``MAX_BYTES`` per operation
and layout, so a timed call streams from memory as the model's own step does. Both ways are
compiled side by side, then timed taking turns call by call (the host's bandwidth moves), and the
medians compared. A full calibration takes a few seconds; its result is cached beside the kernel
library (``build.library_path()``, keyed as the library is: sources, compiler, jax, CPU) under a
key naming the operation and its shapes, so a later start on this machine only reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import build, layout
from backends.cpu.backend import CPU, OPERATIONS
from model.config import ModelConfig
from model.layers import moe
from model.memory import quantize_kv
from model.quant import dequantize, quantize

log = logging.getLogger("grok_runner")

WEIGHT_OPERATIONS = OPERATIONS[:4]  # those that take the activations' dtype (float32 or bf16)
XLA_WAY = CPU()
BY_LAYOUT = CPU(on=frozenset({"projections", "unembed"}))  # the panel kernel on panels, XLA's dot on arrays
MAX_BYTES = 256 << 20  # synthetic weights per operation and layout: beyond the caches, within memory
TIME_BUDGET = 0.05  # seconds of timed calls per shape and way, beyond the minimum repeats
MIN_REPEATS, MAX_REPEATS = 5, 25
MIN_CALL = 0.002  # seconds: a timed call of a small operation runs it this long, on device


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One shape of one operation: median seconds a call on the kernel and on XLA's op."""

    phase: str  # "decode" or "prefill"
    rows: int  # tokens in the call
    kernel_s: float
    xla_s: float

    @property
    def speedup(self) -> float:
        """XLA's time over the kernel's: above 1 the kernel is faster."""
        return self.xla_s / self.kernel_s


@dataclasses.dataclass(frozen=True)
class Choice:
    """Whether ``operation`` runs on its kernel, and why: measured, forced, or not possible. For
    an operation whose weights are int8, ``int8`` says whether the kernel reads them as int8
    (``int8_measurements``: the int8 kernel against the float kernel on the dequantised copy); where it does
    not, they are dequantised at load and ``kernel`` is the float32 kernel's choice."""

    operation: str
    kernel: bool
    measurements: tuple[Measurement, ...] = ()
    reason: str = ""  # without measurements: why it was forced or declined
    int8: bool = False
    int8_measurements: tuple[Measurement, ...] = ()
    # In the w8a8 mode: whether the int8 weights take the int8 x int8 kernel (``w8a8_measurements``:
    # it against the float kernel on the dequantised copy, as ``int8_measurements``)
    w8a8: bool = False
    w8a8_measurements: tuple[Measurement, ...] = ()

    def describe(self) -> str:
        way = ("int8 x int8 kernel" if self.w8a8 else "int8 kernel" if self.int8 else "kernel" if self.kernel
               else "XLA")
        if self.int8_measurements and not self.int8:
            way += " on the dequantised copy" if self.kernel else "'s dot on the dequantised copy"
        if not self.measurements and not self.int8_measurements:
            return f"{self.operation}: {way} ({self.reason})"
        parts = []
        for name, ms in (("int8 x int8 kernel speed / float kernel's", self.w8a8_measurements),
                         ("int8 kernel speed / float kernel's", self.int8_measurements),
                         ("kernel speed / XLA's", self.measurements)):
            if ms:
                parts.append(f"{name}: " + ", ".join(f"{m.phase} {m.rows} rows {m.speedup:.2f}x" for m in ms))
        return f"{self.operation}: {way} ({'; '.join(parts)})"


def decide(operation: str, measurements) -> Choice:
    """The kernel only if it is faster at every shape measured."""
    measurements = tuple(measurements)
    return Choice(operation, all(m.kernel_s < m.xla_s for m in measurements), measurements)


# The int8 kernel's speed over the float32 kernel's that still takes it: where both are bound by
# the multiplications (a prefill's rows) they run the same float32 loop and tie within the noise,
# measured from 0.91x to 0.99x between starts on one machine (2-core AMD EPYC, 2026-12-07); at 0.95
# the int8 MoE kernel, 1.65x faster at decode, was declined on a 0.95x prefill tie one start and
# taken the next, and batch-1 int8 decode ran at 89 tokens/s or 196.
INT8_TOLERANCE = 0.90


def decide_int8(operation: str, int8_measurements, float_measurements) -> Choice:
    """For int8 weights: ``int8_measurements`` time the int8 kernel against the float32 kernel on
    the dequantised copy (its ``xla_s``), ``float_measurements`` the float32 kernel against XLA's
    op. The int8 kernel is taken if, at every shape, it is faster than XLA's op (the product of
    the two speeds) and at least ``INT8_TOLERANCE`` of the float32 kernel's speed: where both are
    bound by the multiplications (prefill's hundreds of rows) they run the same float32 loop and
    tie within the noise, and the int8 weights take a quarter of the memory. Elsewhere (a small
    model whose float weights stay in cache) the float32 choice runs, on the weights dequantised
    at load."""
    int8_measurements, chosen = tuple(int8_measurements), decide(operation, float_measurements)
    int8 = _int8_pays(int8_measurements, chosen.measurements)
    return dataclasses.replace(chosen, kernel=int8 or chosen.kernel, int8=int8, int8_measurements=int8_measurements)


def _int8_pays(int8_measurements, float_measurements) -> bool:
    """``decide_int8``'s test of an int8 kernel: at every shape faster than XLA's op and at least
    ``INT8_TOLERANCE`` of the float32 kernel's speed."""
    return all(m.speedup >= INT8_TOLERANCE and m.speedup * f.speedup > 1.0
               for m, f in zip(int8_measurements, float_measurements))


def decide_w8a8(operation: str, w8a8_measurements, int8_measurements, float_measurements) -> Choice:
    """For int8 weights in the w8a8 mode: ``decide_int8`` for the exact int8 kernel, and the int8 x
    int8 kernel (``w8a8_measurements``, timed as ``int8_measurements``) instead where it passes the
    same test and is at least as fast as the exact one at every shape (or the exact one fails)."""
    chosen = decide_int8(operation, int8_measurements, float_measurements)
    w8a8_measurements = tuple(w8a8_measurements)
    passes = _int8_pays(w8a8_measurements, chosen.measurements)
    faster = not chosen.int8 or all(w.speedup >= i.speedup
                                    for w, i in zip(w8a8_measurements, chosen.int8_measurements))
    w8a8 = passes and faster
    return dataclasses.replace(chosen, kernel=w8a8 or chosen.kernel, int8=w8a8 or chosen.int8, w8a8=w8a8,
                               w8a8_measurements=w8a8_measurements)


# ---- the operations, both ways ---------------------------------------------------------------
def _layers(config: ModelConfig, bytes_per_layer: int) -> int:
    """Layers of synthetic weights: the model's, up to MAX_BYTES (at least one)."""
    return max(1, min(config.num_layers, MAX_BYTES // max(1, bytes_per_layer)))


def _chain(one):
    """A call that runs ``one(x, weights)`` for every layer's weights, ``passes`` times over (a
    loop on device: a small operation is timed over many runs, not against the cost of a
    dispatch, since in the model it runs inside one compiled step). Each input depends on the
    last output, as a step's layers do, so no run can be overlapped with another or skipped."""
    def run(x, layers, passes):
        def chain(_, x):
            for weights in layers:
                x = x + (1e-6 * one(x, weights)).astype(x.dtype)
            return x
        return jax.lax.fori_loop(0, passes, chain, x)
    return run


def _normal(rng, shape, scale=0.02):
    """Uniform values of about ``scale``: a kernel's speed does not depend on them, and a normal
    draw of the synthetic weights took a quarter of a calibration."""
    x = rng.random(shape, np.float32)
    x -= 0.5
    x *= 2 * scale
    return x


def _held(w, int8, dtype=jnp.float32):
    """A synthetic float32 weight as the model holds it: in ``dtype``, or int8 per output channel
    (``int8`` True or "w8a8")."""
    return quantize(w, scale_dtype=jnp.bfloat16) if int8 else jnp.asarray(w, dtype)


# With int8 weights (``int8`` True, or "w8a8" for the int8 x int8 kernel), the operation is
# timed on the int8 kernel against the float kernel on their dequantised copy, taking turns: the
# two kernels compared directly, at the same moment of the host's bandwidth (``decide_int8`` also has the float kernel against XLA's op).
# ``dtype`` is the activations' (float32 or bfloat16), and the float weights' on both ways.
def _moe(config: ModelConfig, tokens: int, rng, int8=False, dtype=jnp.float32):
    c = config
    d, f, e, top = c.emb_size, c.ffn_size, c.num_experts, c.num_selected_experts
    layers = _layers(c, 3 * e * d * f * 4)
    xla_layers, kernel_layers = [], []
    other = frozenset({"moe"}) if int8 else frozenset()  # the float32 kernel, or XLA's op
    for i in range(layers):
        stacked = {"moe": {"linear": {"w": _held(_normal(rng, (e, d, f)), int8, dtype)},
                           "linear_v": {"w": _held(_normal(rng, (e, d, f)), int8, dtype)},
                           "linear_1": {"w": _held(_normal(rng, (e, f, d)), int8, dtype)}}}
        w8a8 = frozenset({"moe"}) if int8 == "w8a8" else frozenset()
        for out, panels, kept, q in ((xla_layers, other, frozenset(), frozenset()),
                                     (kernel_layers, frozenset({"moe"}), other, w8a8)):
            held = layout.prepare(stacked, panels, kept, dtype, w8a8=q)["moe"]
            out.append(tuple(held[name]["w"] for name in ("linear", "linear_v", "linear_1")))
    # uniform routing, as an untrained router spreads tokens
    idx_Mk = jnp.asarray(np.stack([rng.permutation(e)[:top] for _ in range(tokens)]), jnp.int32)
    gates_Mk = jnp.full((tokens, top), 1.0 / top, jnp.float32)
    kernel = CPU(on=frozenset({"moe"}))

    def way(backend):
        return lambda x, w: moe(x, gates_Mk.astype(dtype), idx_Mk, w, backend, dtype)

    x = jnp.asarray(_normal(rng, (tokens, d), 1.0), dtype)
    return x, (way(kernel), kernel_layers), (way(kernel if int8 else XLA_WAY), xla_layers)


def _projections(config: ModelConfig, tokens: int, rng, int8=False, dtype=jnp.float32):
    c = config
    d, nh, kh = c.emb_size, c.num_q_heads * c.key_size, c.num_kv_heads * c.key_size
    shapes = ((d, nh), (d, kh), (d, kh), (nh, d))
    layers = _layers(c, sum(a * b for a, b in shapes) * 4)
    held = [tuple(_held(jnp.asarray(_normal(rng, s)), int8, dtype) for s in shapes) for _ in range(layers)]
    panels = layout.PanelWeight if dtype == jnp.float32 else layout.Bf16PanelWeight
    if int8:  # against the float kernel on the dequantised copy
        kind = layout.W8A8PanelWeight if int8 == "w8a8" else layout.Int8PanelWeight
        kernel_layers = [tuple(kind.of(w) for w in ws) for ws in held]
        xla_layers = [tuple(panels.of(np.asarray(dequantize(w, dtype))) for w in ws) for ws in held]
    else:
        xla_layers = held
        kernel_layers = [tuple(panels.of(np.asarray(w)) for w in ws) for ws in xla_layers]

    def one(x_BTD, ws):
        wq, wk, wv, wo = ws
        q = BY_LAYOUT.matmul(x_BTD, wq, dtype)
        kv = BY_LAYOUT.matmul(x_BTD, wk, dtype) + BY_LAYOUT.matmul(x_BTD, wv, dtype)
        return BY_LAYOUT.matmul(q, wo, dtype) + jnp.sum(kv, axis=-1, keepdims=True)

    return jnp.asarray(_normal(rng, (1, tokens, d), 1.0), dtype), (one, kernel_layers), (one, xla_layers)


def _unembed(config: ModelConfig, rows: int, rng, dtype=jnp.float32):
    table = jnp.asarray(_normal(rng, (config.vocab_size, config.emb_size)), dtype)
    x = jnp.asarray(_normal(rng, (1, rows, config.emb_size), 1.0), dtype)

    def one(h, t):
        return jnp.sum(BY_LAYOUT.unembed(h, t, dtype), axis=-1, keepdims=True)

    return x, (one, [layout.PanelTable.of(table)]), (one, [table])


def _attention(config: ModelConfig, batch: int, kv_len: int, rng, kv_dtype: str = "float32", dtype=jnp.float32):
    c = config
    n, k, h = c.num_q_heads, c.num_kv_heads, c.key_size
    # Caches of the model's full length, attended over their first kv_len positions, as a decode
    # step does: XLA copies those positions out of each cache first (and dequantises an int8
    # one), the kernel reads them in place.
    length = c.sequence_len
    layers = _layers(c, 2 * batch * k * length * h * jnp.dtype(kv_dtype).itemsize)
    cache = (lambda x: quantize_kv(jnp.asarray(x))) if kv_dtype == "int8" else lambda x: jnp.asarray(x, kv_dtype)  # noqa: E731
    # each a stack of one layer [1, B, K, S, H], read at layer 0, as the model hands a step the
    # whole stacked KV memory (a lone layer would be copied into a stack for the kernel first)
    caches = [tuple(jax.tree_util.tree_map(lambda a: a[None], cache(_normal(rng, (batch, k, length, h), 1.0)))
                    for _ in range(2)) for _ in range(layers)]
    mask_BTS = (jnp.arange(kv_len)[None, :] < jnp.full((batch, 1), kv_len - kv_len // 4))[:, None]  # never full

    def way(backend):
        return lambda q_BNH, kv: backend.attention(q_BNH[:, None], kv[0], kv[1], mask_BTS, c.attn_output_multiplier,
                                                   c.attn_logit_cap, layer=0)[:, 0]

    q = jnp.asarray(_normal(rng, (batch, n, h), 1.0), dtype)
    return q, (way(CPU(on=frozenset({"attention"}))), caches), (way(XLA_WAY), caches)


def _sampling(config: ModelConfig, batch: int, rng, cut: bool):
    logits = jnp.asarray(_normal(rng, (batch, config.vocab_size), 3.0))
    top_k, nucleus_p = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), 0.95)
    if cut:
        def way(backend):
            return lambda x, _: backend.sampling_cut(x, top_k, nucleus_p)[:, None]
        kernel = CPU(on=frozenset({"sampling_cut"}))
    else:
        def way(backend):
            def summary(x, _):
                values, ids, lse, first = backend.logits_summary(x, 8)
                return values[:, :1] + ids[:, :1] + lse[:, None] + first[:, None]
            return summary
        kernel = CPU(on=frozenset({"logits_summary"}))
    return logits, (way(kernel), [None]), (way(XLA_WAY), [None])


def _shapes(operation: str, config: ModelConfig, batch: int, prefill_tokens: int, kv_len: int, kv_dtype: str,
            int8=False, dtype: str = "float32"):
    """(phase, rows, builder) for each shape ``operation`` is called with."""
    dtype = jnp.dtype(dtype)
    if operation in ("moe", "projections"):
        build = _moe if operation == "moe" else _projections
        return [("decode", batch, lambda rng: build(config, batch, rng, int8, dtype)),
                ("prefill", prefill_tokens, lambda rng: build(config, prefill_tokens, rng, int8, dtype))]
    if operation == "unembed":
        return [("decode", batch, lambda rng: _unembed(config, batch, rng, dtype))]
    if operation == "attention":
        return [("decode", batch, lambda rng: _attention(config, batch, kv_len, rng, kv_dtype, dtype))]
    cut = operation == "sampling_cut"
    return [("decode", batch, lambda rng: _sampling(config, batch, rng, cut))]


def _key(operation: str, phase: str, rows: int, config: ModelConfig, kv_len: int, kv_dtype: str,
         int8=False, dtype: str = "float32") -> str:
    c = config
    dims = (f"D{c.emb_size} F{c.ffn_size} E{c.num_experts}k{c.num_selected_experts} N{c.num_q_heads} "
            f"K{c.num_kv_heads} H{c.key_size} V{c.vocab_size} L{c.num_layers}")
    # attention: measured on a stacked cache read at a layer (a lone layer, measured before,
    # was copied into a stack for the kernel inside the timing)
    extra = f" S{kv_len}/{c.sequence_len} stacked" if operation == "attention" else ""
    if operation == "attention" and kv_dtype != "float32":  # float32: the keys as before
        extra += " int8" if kv_dtype == "int8" else f" {kv_dtype} cache"
    kind = "w8a8" if int8 == "w8a8" else "int8"
    if int8:
        extra += f" {kind} weights against {'float32' if dtype == 'float32' else 'bf16'}"
    extra += " bf16 activations" if dtype == "bfloat16" and operation in WEIGHT_OPERATIONS else ""
    return f"{operation} {phase} rows{rows}{extra} {dims}"


# ---- timing ----------------------------------------------------------------------------------
def _time_both(kernel_call, xla_call) -> tuple[float, float]:
    """Median seconds of one pass of each call (``call(passes)``), timed taking turns, in about
    TIME_BUDGET each: as many passes a call as make it last MIN_CALL seconds."""
    def seconds(call, passes):
        start = time.perf_counter()
        jax.block_until_ready(call(np.int32(passes)))
        return time.perf_counter() - start

    calls = (kernel_call, xla_call)
    first = [seconds(call, 1) for call in calls]  # also warms up: kept out of the medians
    passes = max(1, min(1000, int(MIN_CALL / max(1e-6, min(first)))))
    times = ([], [])
    deadline = time.perf_counter() + 2 * TIME_BUDGET
    while len(times[0]) < MIN_REPEATS or (len(times[0]) < MAX_REPEATS and time.perf_counter() < deadline):
        for call, out in zip(calls, times):
            out.append(seconds(call, passes) / passes)
    return statistics.median(times[0]), statistics.median(times[1])


def _measure(shapes) -> list[Measurement]:
    """Build, compile (side by side) and time every (operation, phase, rows, builder) both ways."""
    rng = np.random.default_rng(0)
    built = [(phase, rows, builder(rng)) for _, phase, rows, builder in shapes]
    calls = []
    for _, _, (x, (kernel_one, kernel_w), (xla_one, xla_w)) in built:
        for one, weights in ((kernel_one, kernel_w), (xla_one, xla_w)):
            calls.append((jax.jit(_chain(one)), x, weights))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(calls), os.cpu_count() or 1)) as pool:
        compiled = list(pool.map(lambda c: c[0].lower(c[1], c[2], np.int32(1)).compile(), calls))
    out = []
    for i, (phase, rows, _) in enumerate(built):
        (k_fn, x_fn), ((_, k_x, k_w), (_, x_x, x_w)) = compiled[2 * i: 2 * i + 2], calls[2 * i: 2 * i + 2]
        kernel_s, xla_s = _time_both(lambda n: k_fn(k_x, k_w, n), lambda n: x_fn(x_x, x_w, n))
        out.append(Measurement(phase, rows, kernel_s, xla_s))
    return out


def _cache_path() -> Path | None:
    lib = build.library_path()
    return None if lib is None else lib.with_suffix(".calibration.json")


def _read_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):  # unreadable or torn: calibrate again
        return {}


def _write_cache(path: Path | None, entries: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
    except OSError as e:
        log.warning("kernel calibration not cached at %s: %s", path, e)


def calibrate(operations, config: ModelConfig, batch: int, prefill_tokens: int, kv_len: int,
              cache: bool = True, kv_dtype: str = "float32", int8_weights=frozenset(),
              dtype: str = "float32", counts: dict | None = None, w8a8: bool = False) -> dict[str, Choice]:
    """A ``Choice`` per operation (names from ``OPERATIONS``), each measured at its shapes for
    ``config`` with ``batch`` slots, prefill chunks of ``prefill_tokens`` and decode attention over
    ``kv_len`` cache positions of ``kv_dtype`` ("float32", "bfloat16" or "int8"), with activations
    and float weights of ``dtype`` ("float32" or "bfloat16"); the operations in ``int8_weights``
    ("moe", "projections") have int8 weights: timed also on the int8 kernel against the float
    kernel on their dequantised copy, and decided by ``decide_int8`` (with ``w8a8``, the int8 x
    int8 kernel too, and decided by ``decide_w8a8``). Measured shapes come from (and go to) the cache beside the kernel library unless ``cache`` is False; ``counts``,
    if given, is told how many shapes there were and how many were measured now. The kernels must
    be available."""
    path = _cache_path() if cache else None
    entries = _read_cache(path)
    todo, keyed = [], {}
    for op in operations:
        if op not in OPERATIONS:
            raise ValueError(f"calibrate: unknown operation {op!r}, expected one of {OPERATIONS}")
        for int8 in ((("w8a8",) if w8a8 else ()) + (True, False) if op in int8_weights else (False,)):
            for phase, rows, builder in _shapes(op, config, batch, prefill_tokens, kv_len, kv_dtype, int8, dtype):
                key = _key(op, phase, rows, config, kv_len, kv_dtype, int8, dtype)
                keyed.setdefault((op, int8), []).append(key)
                if not (isinstance(entries.get(key), dict) and {"kernel_s", "xla_s"} <= entries[key].keys()):
                    todo.append((key, op, phase, rows, builder))
    if counts is not None:
        counts.update(shapes=sum(len(keys) for keys in keyed.values()), measured=len(todo))
    if todo:
        start = time.perf_counter()
        for (key, *_), m in zip(todo, _measure([t[1:] for t in todo])):
            entries[key] = {"phase": m.phase, "rows": m.rows, "kernel_s": m.kernel_s, "xla_s": m.xla_s}
        log.info("kernel calibration: %d shapes in %.1f s", len(todo), time.perf_counter() - start)
        if cache:
            _write_cache(path, {**_read_cache(path), **entries})

    def measured(op, int8):
        return [Measurement(entries[k]["phase"], int(entries[k]["rows"]), float(entries[k]["kernel_s"]),
                            float(entries[k]["xla_s"])) for k in keyed[(op, int8)]]

    def decided(op):
        if op not in int8_weights:
            return decide(op, measured(op, False))
        if w8a8:
            return decide_w8a8(op, measured(op, "w8a8"), measured(op, True), measured(op, False))
        return decide_int8(op, measured(op, True), measured(op, False))

    return {op: decided(op) for op in operations}
