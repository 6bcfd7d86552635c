"""``KVMemory``: the per-layer key/value cache, a pytree updated in place through donated buffers.

Invariants:
- ``k[l]`` and ``v[l]`` are ``[B, K, S, H]`` (batch rows, KV heads, ``sequence_len`` positions,
  key_size: the layout attention reads without a transpose; the reference's is ``[B, S, K, H]``).
  ``step[b]`` is the number of valid positions of row ``b``: positions ``[0, step[b])`` hold the
  keys/values of that row's tokens, everything at or after ``step[b]`` is garbage and is
  never attended to.
- A forward pass with memory writes its chunk at positions ``[step, step + T)`` of each row,
  attends only to ``[0, step + length)`` (causally), and advances ``step`` by the chunk's real
  length. Positions written by padding lie at or beyond the new step, so they stay invalid and are
  overwritten later; positions ``>= sequence_len`` are dropped, never clamped onto valid data.
- Rows are independent: writing row i never reads or changes row j. A free slot is simply a row
  whose ``step`` is reset to 0 before its next prompt; old contents need no zeroing.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


@flax.struct.dataclass
class KVMemory:
    k: tuple[jax.Array, ...]  # num_layers x [B, K, S, H]
    v: tuple[jax.Array, ...]  # num_layers x [B, K, S, H]
    step: jax.Array  # [B] int32: valid positions per row

    @property
    def batch_size(self) -> int:
        return self.step.shape[0]

    @property
    def sequence_len(self) -> int:
        return self.k[0].shape[2]

    def row(self, slot) -> "KVMemory":
        """Row ``slot`` (traced or concrete) as a one-row memory: ``[1, K, S, H]`` leaves."""
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)  # noqa: E731
        return KVMemory(k=tuple(map(take, self.k)), v=tuple(map(take, self.v)), step=take(self.step))

    def with_row(self, slot, row: "KVMemory") -> "KVMemory":
        """This memory with row ``slot`` replaced by the one-row memory ``row``; other rows are
        untouched (rows are independent), and with a donated buffer XLA writes in place."""
        put = lambda full, r: jax.lax.dynamic_update_slice_in_dim(full, r.astype(full.dtype), slot, axis=0)  # noqa: E731
        return KVMemory(k=tuple(map(put, self.k, row.k)), v=tuple(map(put, self.v, row.v)),
                        step=put(self.step, row.step))

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
    """A zeroed ``KVMemory`` for ``batch_size`` rows (``sequence_len`` defaults to the config's)."""
    sequence_len = config.sequence_len if sequence_len is None else sequence_len
    if batch_size <= 0 or sequence_len <= 0:
        raise ValueError(f"new_memory needs positive batch_size and sequence_len, got "
                         f"{batch_size} and {sequence_len}")
    dtype = config.dtype if dtype is None else dtype
    shape = (batch_size, config.num_kv_heads, sequence_len, config.key_size)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731 - one fresh buffer per leaf
    return KVMemory(
        k=tuple(zeros() for _ in range(config.num_layers)),
        v=tuple(zeros() for _ in range(config.num_layers)),
        step=jnp.zeros((batch_size,), jnp.int32),
    )
