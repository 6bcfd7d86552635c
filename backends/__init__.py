"""Backends: the operations the model needs from the machine it runs on, behind one interface.

The model (``model/``) is written once, in terms of a ``Backend``: it calls

- ``matmul(x, w, dtype)``: ``x [..., K] @ w [K, N]`` (the attention projections);
- ``embed(table, tokens, dtype)`` and ``unembed(h, table, dtype)``: the tied embedding;
- ``grouped_matmul(x, w, sizes, dtype)``: rows sorted by expert, each group times its own expert
  of a stacked ``w [E, K, N]`` (the MoE's three matmuls);
- ``attention(q, k, v, mask, scale, cap)``: Grok-1's grouped-query attention over the first S
  positions of the keys and values (a whole sequence, or a decode step over the KV cache);
- ``sampling_cut(scaled, top_k, nucleus_p)`` and ``logits_summary(logits, top)``: the sampler's
  top-k/top-p cut and its top tokens with the log-normaliser.

``prepare(params)`` derives the backend's own layout from the canonical parameters (Grok-1's
names, stacked experts, int8 records: the pytree that checkpoints, sharding rules and tests see);
the model takes either, since each weight is only ever handed back to the backend.

Two backends:
- ``backends.xla.XLA``: pure JAX (``jax.lax.ragged_dot``, einsum attention, sort-based sampling),
  the default everywhere but one CPU device;
- ``backends.cpu.CPU``: one CPU device, with C++ kernels (built on first use, each taken only where
  measured faster than XLA's op on the CPU at hand) and CPU layouts (experts split or in panels).

``runner.selection.choose`` picks one for a runner and says why. The dependency runs one way:
backends import the model's types (``backends.cpu`` its layers' layouts); ``model/`` imports
nothing from here and takes its backend as an argument.
"""

from backends.base import Backend
from backends.xla import XLA

__all__ = ["Backend", "XLA"]
