"""The interface every backend implements (see ``backends/__init__.py``)."""

from __future__ import annotations

import jax

from model.memory import write_kv


class Backend:
    """What the model needs from the machine. Subclasses are frozen dataclasses: a backend is a
    static argument of the model (hashable, compared by value), never a pytree."""

    name = "abstract"

    def prepare(self, params):
        """The backend's own layout of the canonical ``params`` (the same pytree by default)."""
        return params

    def describe(self) -> str:
        """One line: which backend and what it runs on its own kernels."""
        return self.name

    def take_layer(self, w, layer):
        """Layer ``layer`` (a traced index) of a stacked parameter ``w`` (``[L, ...]``, or a pytree
        of such): what the ``"indexed"`` stack (``model.transformer.Transformer``) hands a layer.
        A slice here; a backend whose kernels read a stacked weight in place hands those over
        whole, with the index."""
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), w)

    def matmul(self, x, w, dtype):
        raise NotImplementedError

    def embed(self, table, tokens, dtype):
        raise NotImplementedError

    def unembed(self, h, table, dtype):
        raise NotImplementedError

    def grouped_matmul(self, x_RK, w, sizes_E, dtype):
        raise NotImplementedError

    def attention(self, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, cap: float, temperature_BT=None, layer=None, rows_BT=None):
        """Grok's capped attention over keys and values ``[B, K, S, H]``, or with ``layer`` (an
        int, or the scan's traced index) over layer ``layer`` of every layer's ``[L, B, K, S, H]``
        (``model.memory.KVMemory``: a backend may read it in place); ``temperature_BT`` (float32,
        or None) multiplies each query's capped logits (Grok-2's attention temperature)."""
        raise NotImplementedError

    def decode_reads_live_keys(self, config) -> bool:
        """Whether a decode step's attention reads only the positions its mask allows, so that
        attending over the whole cache costs what attending over a bucket of it does: the runner
        then compiles its decode steps for one KV length (``runner.runner``), not one a bucket."""
        return False

    def write_kv(self, cache, layer, rows_BT, positions_BT, new_BTKH):
        """``model.memory.write_kv``: the chunk's keys (or values) written into layer ``layer`` of
        the stack, a position past the cache dropped. A backend may write in place its own way."""
        return write_kv(cache, layer, rows_BT, positions_BT, new_BTKH)

    def sampling_cut(self, scaled_BV, top_k_B, nucleus_p_B):
        """Per row, the smallest tempered logit that top-k then top-p keep ``[B]``."""
        raise NotImplementedError

    def logits_summary(self, logits_BV, top: int):
        """(top values ``[B, top]``, their ids ``[B, top]`` int32, log-sum-exp ``[B]``, argmax ``[B]``)."""
        raise NotImplementedError
