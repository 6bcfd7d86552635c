"""``KVMemory``: the key/value cache of every layer, a pytree updated in place through donated buffers.

Invariants:
- ``k`` and ``v`` are ``[L, B, K, S, H]`` (layers, batch rows, KV heads, ``sequence_len``
  positions, key_size), one array each for the whole stack: the decoder is a scan over layers
  (``model.transformer``) and layer ``l`` reads and writes ``k[l]`` inside the loop, in place.
  ``[B, K, S, H]`` is the layout attention reads without a transpose (the reference's is
  ``[B, S, K, H]``, a tuple of layers).
  ``step[b]`` is the number of valid positions of row ``b``: positions ``[0, step[b])`` hold the
  keys/values of that row's tokens, everything at or after ``step[b]`` is garbage and is
  never attended to.
- A forward pass with memory writes its chunk at positions ``[step, step + T)`` of each row,
  attends only to ``[0, step + length)`` (causally), and advances ``step`` by the chunk's real
  length. Positions written by padding lie at or beyond the new step, so they stay invalid and are
  overwritten later; positions ``>= sequence_len`` are dropped, never clamped onto valid data.
- Rows are independent: writing row i never reads or changes row j. A free slot is simply a row
  whose ``step`` is reset to 0 before its next prompt; old contents need no zeroing.
- In an int8 cache (``new_memory(..., dtype="int8")``) each of ``k``, ``v`` is a
  ``QuantizedKV``: int8 values ``[L, B, K, S, H]`` and one float32 scale a layer, row, KV head and
  position ``[L, B, K, S, 1]`` (the same leading axes, so every positional operation on the cache is a
  ``tree_map`` over either kind). A position's K (or V) of one head is written once, quantised
  with its own scale, and attention reads only dequantised values: everything a query attends
  to, its own chunk included, went through the same rounding, whichever way the prompt was cut.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


KV_DTYPES = ("float32", "bfloat16", "int8")  # what a cache may hold (None: the activations' dtype)


@flax.struct.dataclass
class QuantizedKV:
    """Int8 keys (or values): ``values [..., S, H]`` int8 and ``scales [..., S, 1]`` float32 (the
    whole stack ``[L, B, K, S, H]``, or one layer's ``[B, K, S, H]``), ``x = values * scales`` (per token and KV head: a token's K of one head is quantised
    when it is written and never again). Like ``QuantizedWeight8bit`` it gives its value in a
    dtype by ``astype``; positional operations are ``jax.tree_util.tree_map`` over both leaves."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def astype(self, dtype) -> jax.Array:
        return self.values.astype(dtype) * self.scales.astype(dtype)


def quantize_kv(x) -> QuantizedKV:
    """``x [..., H]`` as int8 with one scale per vector of H (its largest magnitude over 127,
    rounded to nearest): the error of an entry is at most half its vector's scale. An all-zero
    vector gets scale 0 and values 0."""
    x32 = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    values = jnp.round(x32 / jnp.where(scales > 0, scales, 1.0))
    return QuantizedKV(values=jnp.clip(values, -127, 127).astype(jnp.int8), scales=scales)


def set_at(full, index, new):
    """``full.at[index].set(new, mode="drop")``, ``new`` cast to ``full``'s dtype. A bf16 array is
    written as its bits (uint16): XLA:CPU widens a bf16 scatter to float32 (a conversion of the
    whole array there and back, fused into the write); as bits the write is a plain integer one
    (16 bf16 cache writes of the bench config's shape: 0.32 ms against 0.56 on an AMD EPYC). The
    bits written are the same either way."""
    new = new.astype(full.dtype)
    if full.dtype != jnp.bfloat16:
        return full.at[index].set(new, mode="drop")
    bits = jax.lax.bitcast_convert_type
    return bits(bits(full, jnp.uint16).at[index].set(bits(new, jnp.uint16), mode="drop"), jnp.bfloat16)


def write_kv(cache, layer, rows_BT, positions_BT, new_BTKH, put=None):
    """``cache`` (``[L, B, K, S, H]`` float, or a ``QuantizedKV``) with ``new_BTKH [B, T, K, H]``
    written into layer ``layer`` (an int, or a traced scalar inside the scan) at ``(rows_BT,
    positions_BT)``; a position past ``S`` is dropped, never clamped onto valid entries (XLA's
    ``dynamic_update_slice`` would clamp). The rest of the stack is untouched: in a loop over
    layers the write is in place. ``put(full, new)`` writes one array of the cache (an int8
    record's values, then its scales), ``new`` in its dtype: a scatter by default, a backend's
    own in-place write otherwise (``Backend.write_kv``)."""
    new = quantize_kv(new_BTKH) if isinstance(cache, QuantizedKV) else new_BTKH
    if put is None:
        return jax.tree_util.tree_map(
            lambda full, x: set_at(full, (layer, rows_BT, slice(None), positions_BT), x), cache, new)
    return jax.tree_util.tree_map(lambda full, x: put(full, x.astype(full.dtype)), cache, new)


def layer_of(cache, layer):
    """Layer ``layer`` of a stacked cache ``[L, B, K, S, H]`` (float or ``QuantizedKV``): ``[B, K, S, H]``."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), cache)


@flax.struct.dataclass
class KVMemory:
    k: jax.Array | QuantizedKV  # [L, B, K, S, H]
    v: jax.Array | QuantizedKV  # [L, B, K, S, H]
    step: jax.Array  # [B] int32: valid positions per row

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.step.shape[0]

    @property
    def sequence_len(self) -> int:
        return self.k.shape[3]

    def check_fits(self, lengths) -> None:
        """Raise ``ValueError`` if writing ``lengths`` more tokens would pass ``sequence_len``.

        Only possible when ``step`` is concrete (outside ``jit``); a jitted caller checks at its own
        boundary (the runner tracks every slot's step on the host).
        """
        if isinstance(self.step, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
            return
        end = np.asarray(self.step) + np.asarray(lengths)
        if np.any(end > self.sequence_len):
            row = int(np.argmax(end))
            raise ValueError(
                f"KV memory overflow: row {row} would hold {int(end[row])} positions, "
                f"but sequence_len is {self.sequence_len}")


def new_memory(config: ModelConfig, batch_size: int, sequence_len: int | None = None,
               dtype=None) -> KVMemory:
    """A zeroed ``KVMemory`` for ``batch_size`` rows (``sequence_len`` defaults to the config's)
    holding ``dtype`` (one of ``KV_DTYPES``; default: the activations' dtype; "int8": a
    ``QuantizedKV``)."""
    sequence_len = config.sequence_len if sequence_len is None else sequence_len
    if batch_size <= 0 or sequence_len <= 0:
        raise ValueError(f"new_memory needs positive batch_size and sequence_len, got "
                         f"{batch_size} and {sequence_len}")
    shape = (config.num_layers, batch_size, config.num_kv_heads, sequence_len, config.key_size)
    dtype = config.dtype if dtype is None else dtype
    return KVMemory(k=kv_zeros(shape, dtype), v=kv_zeros(shape, dtype), step=jnp.zeros((batch_size,), jnp.int32))


def kv_zeros(shape, dtype):
    """Zeroed K (or V) of ``shape [..., H]`` in ``dtype`` (one of ``KV_DTYPES``)."""
    name = jnp.dtype(dtype).name
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {dtype!r}")
    if name == "int8":
        return QuantizedKV(values=jnp.zeros(shape, jnp.int8), scales=jnp.zeros((*shape[:-1], 1), jnp.float32))
    return jnp.zeros(shape, dtype)
