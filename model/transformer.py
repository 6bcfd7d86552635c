"""The whole network: embedding, decoder layers, final norm, tied unembedding (docs/grok1.md §3).

``forward(params, tokens, config, memory=..., lengths=...)`` is the pure function everything else
calls; ``LanguageModel`` is the Flax module behind it. The parameter pytree mirrors Grok-1's Haiku
tree: ``{"language_model": {"in_out_embed": {"embeddings"}, "rms_norm": {"scale"}},
"transformer": {"layers": {...}}}``, where every leaf under ``layers`` is its
``decoder_layer_<i>`` stacked over the layers on a new leading axis (``Transformer`` scans them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.layers import RESIDUAL, DecoderLayer, RMSNorm, declare, held_in_layout
from model.memory import KVMemory
from model.partitioning import constrain


@flax.struct.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, T, V] float32, or [B, 1, V] with last_only
    memory: KVMemory | None


class InOutEmbed(nn.Module):
    """Tied input/output embedding ``embeddings [V, D]`` (Grok-1 stores it in float32)."""

    vocab_size: int
    emb_size: int

    def setup(self):
        held = held_in_layout(self, "embeddings", (self.vocab_size, self.emb_size))
        if held is not None:
            self.embeddings = held
        else:
            self.embeddings = declare(self, "embeddings", nn.initializers.normal(1.0),
                                      (self.vocab_size, self.emb_size), ("vocab", "embed_table"))


class LanguageModelHead(nn.Module):
    """Grok-1's ``language_model`` scope: the embedding table and the final norm; with untied
    embeddings (Grok-2) also the output table ``lm_head/embeddings [V, D]``."""

    config: ModelConfig
    backend: object

    def setup(self):
        self.in_out_embed = InOutEmbed(self.config.vocab_size, self.config.emb_size)
        self.rms_norm = RMSNorm(self.config.rms_norm_eps)
        if not self.config.tie_embeddings:
            self.lm_head = InOutEmbed(self.config.vocab_size, self.config.emb_size)

    def embed(self, tokens_BT):
        c = self.config
        # Grok-1 (model.py, LanguageModel.__call__): the rows cast to the activation dtype, then
        # scaled by sqrt(D) in it: ``in_out_embed(tokens).astype(fprop_dtype) * multiplier``.
        x_BTD = self.backend.embed(self.in_out_embed.embeddings, tokens_BT, c.dtype)
        return constrain(x_BTD * jnp.asarray(c.embedding_multiplier_scale, c.dtype), RESIDUAL)

    def unembed(self, h_BTD):
        c = self.config
        h_BTD = self.rms_norm(h_BTD)
        table = self.in_out_embed if c.tie_embeddings else self.lm_head
        logits_BTV = self.backend.unembed(h_BTD, table.embeddings, c.dtype)
        logits_BTV = constrain(logits_BTV, ("batch", "seq", "act_vocab"))
        logits_BTV = (logits_BTV * c.output_multiplier_scale).astype(jnp.float32)
        if c.final_logit_cap:  # Grok-2 (docs/grok2.md §5), in float32
            logits_BTV = c.final_logit_cap * jnp.tanh(logits_BTV / c.final_logit_cap)
        return logits_BTV


LAYERS = ("scan", "unrolled", "indexed")  # how the decoder stack runs (a backend's ``layers``)


class Transformer(nn.Module):
    """The decoder stack. ``"scan"`` (the default): one ``DecoderLayer`` scanned over the
    parameters of every layer stacked on a leading axis (``transformer/layers/...``, logical
    axis "layers"), so a compiled step holds one layer whatever the depth, and the KV memory is
    carried through the loop and written in place. ``"unrolled"`` (a backend's choice, made in its
    ``prepare``, which holds each layer's parameters apart as ``transformer/decoder_layer_<i>``):
    a Python loop of ``num_layers`` blocks, for a backend whose kernels read a slice of a stacked
    weight only through a copy. ``"indexed"`` (``backends.cpu`` where its kernels hold the big
    weights): one layer compiled and looped over the layer index (``jax.lax.scan``), each
    parameter of the stack taken by the backend's ``take_layer``, which hands a kernel's weight
    over whole with the index (read in place) where ``nn.scan`` would slice it (a copy)."""

    config: ModelConfig
    backend: object

    @nn.compact
    def __call__(self, h_BTD, *, positions_BT, mask_BTS, memory: KVMemory | None, valid_BT=None, rows_BT=None):
        c = self.config
        carry = (h_BTD, None if memory is None else (memory.k, memory.v))
        how = getattr(self.backend, "layers", "scan")
        if how == "indexed" and not self.is_initializing():
            return self._indexed(carry, positions_BT, mask_BTS, valid_BT, rows_BT)
        if how == "unrolled":
            for i in range(c.num_layers):
                with jax.named_scope(f"decoder_layer_{i}"):
                    carry, _ = DecoderLayer(c, self.backend, name=f"decoder_layer_{i}")(
                        carry, i, positions_BT, mask_BTS, valid_BT, rows_BT)
            return carry
        stack = nn.scan(DecoderLayer, variable_axes={"params": 0, "intermediates": 0},
                        split_rngs={"params": True}, in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                        length=c.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        carry, _ = stack(c, self.backend, name="layers")(
            carry, jnp.arange(c.num_layers, dtype=jnp.int32), positions_BT, mask_BTS, valid_BT, rows_BT)
        return carry

    def _indexed(self, carry, positions_BT, mask_BTS, valid_BT, rows_BT):
        """The ``"indexed"`` stack: a loop over the layer index whose body applies one
        ``DecoderLayer`` to the stack's parameters taken at that index (``backend.take_layer``);
        the intermediates, when collected, come out stacked as ``nn.scan`` sows them."""
        stack = self.variables["params"]["layers"]
        block = DecoderLayer(self.config, self.backend, parent=None)
        collect = self.is_mutable_collection("intermediates")

        def body(carry, layer):
            params = jax.tree_util.tree_map(lambda w: self.backend.take_layer(w, layer), stack,
                                            is_leaf=lambda x: not isinstance(x, Mapping))
            args = (carry, layer, positions_BT, mask_BTS, valid_BT, rows_BT)
            if not collect:
                return block.apply({"params": params}, *args)[0], None
            (carry, _), state = block.apply({"params": params}, *args, mutable=["intermediates"])
            return carry, state["intermediates"]

        carry, sown = jax.lax.scan(body, carry, jnp.arange(self.config.num_layers, dtype=jnp.int32))
        if collect and sown:
            self.put_variable("intermediates", "layers", sown)
        return carry


def sown(intermediates, name: str) -> jax.Array:
    """Every layer's intermediate ``name`` (``DecoderLayer`` sows ``attn_out``, ``router_probs``,
    ``mlp_out``, ``moe_out``, ``h_out``) from ``apply(..., mutable=["intermediates"])``, stacked:
    ``[L, ...]``, whichever way the stack ran."""
    tree = intermediates["transformer"]
    if "layers" in tree:
        return tree["layers"][name][0]
    names = sorted((k for k in tree if k.startswith("decoder_layer_")), key=lambda k: int(k[14:]))
    return jnp.stack([tree[k][name][0] for k in names])


def has_stacked_layers(params) -> bool:
    """Whether ``params`` is a whole model's tree with its layers stacked (``transformer/layers``)."""
    return isinstance(params, dict) and isinstance(params.get("transformer"), dict) and "layers" in params["transformer"]


def layers_apart(params, take=lambda a, i: a[i]) -> dict:
    """``params`` with the stacked layers (``transformer/layers``, every leaf ``[L, ...]``) held
    apart, one subtree a layer (``transformer/decoder_layer_<i>``): the tree of the ``"unrolled"``
    stack. ``take(leaf, i)`` takes layer i of a leaf (a view, for a host array)."""
    stack = params["transformer"]["layers"]
    layers = jax.tree_util.tree_leaves(stack)[0].shape[0]
    apart = {f"decoder_layer_{i}": jax.tree_util.tree_map(lambda a, i=i: take(a, i), stack) for i in range(layers)}
    return {**params, "transformer": {**{k: v for k, v in params["transformer"].items() if k != "layers"}, **apart}}


def layers_together(params, stack=lambda parts: jnp.stack(parts)) -> dict:
    """The inverse of ``layers_apart``: each layer's leaves (arrays, or any pytree of them alike
    in every layer) stacked by ``stack`` into ``transformer/layers``."""
    names = sorted((k for k in params["transformer"] if k.startswith("decoder_layer_")), key=lambda k: int(k[14:]))
    together = jax.tree_util.tree_map(lambda *parts: stack(parts), *(params["transformer"][k] for k in names))
    rest = {k: v for k, v in params["transformer"].items() if not k.startswith("decoder_layer_")}
    return {**params, "transformer": {**rest, "layers": together}}


def attention_mask(tokens_BT, lengths_B, pad_token: int | None, step_B=None, sequence_len=None):
    """Which keys each query may see, ``[B, T, S]`` bool.

    Without memory (``step_B is None``; S = T): causal, and keys that are padding are masked: a
    key is padding if it lies at or beyond the row's length or, as in Grok-1's reference, its
    token is ``pad_token`` (None: by position only, as Grok-2). With memory (S = sequence_len):
    key s is visible to query t iff ``s <= step + t`` and ``s < step + length`` (positions, not
    token ids: the cache keeps no ids; docs/grok1.md §13 compares the two).
    A query at or beyond its row's length (padding, a free slot's decode row) sees no key: its
    output is never read, so attention skips it (the CPU kernel reads no cache for it).
    """
    b, t = tokens_BT.shape
    q_pos_BT = jnp.arange(t)[None, :]
    query_ok_BT = q_pos_BT < lengths_B[:, None]
    if step_B is None:
        k_pos_S = jnp.arange(t)
        key_ok_BS = k_pos_S[None, :] < lengths_B[:, None]
        if pad_token is not None:
            key_ok_BS &= tokens_BT != pad_token
        causal_TS = k_pos_S[None, :] <= jnp.arange(t)[:, None]
        return key_ok_BS[:, None, :] & causal_TS[None] & query_ok_BT[:, :, None]
    k_pos_S = jnp.arange(sequence_len)
    abs_q_BT = step_B[:, None] + q_pos_BT
    causal_BTS = k_pos_S[None, None, :] <= abs_q_BT[:, :, None]
    valid_BS = k_pos_S[None, :] < (step_B + lengths_B)[:, None]
    return causal_BTS & valid_BS[:, None, :] & query_ok_BT[:, :, None]


class LanguageModel(nn.Module):
    """Grok-1: scaled embedding -> decoder layers -> final norm -> tied unembedding x 0.577 (Grok-2:
    its own output table, x 0.5, soft-capped at 50).
    ``backend`` (a ``backends.Backend``) runs the matmuls, the MoE's grouped matmuls and the
    attention; its parameters are the canonical ones or those of its ``prepare``."""

    config: ModelConfig
    backend: object

    @nn.compact
    def __call__(self, tokens_BT, memory: KVMemory | None = None, lengths_B=None,
                 last_only: bool = False, kv_len: int | None = None, rows_BT=None, positions_BT=None, pick=None):
        """``kv_len`` (static, with memory): attend to cache positions ``[0, kv_len)`` only; every
        row's ``step + length`` must fit in it (the runner picks it from a few buckets).

        A packed prefill gives ``rows_BT`` and ``positions_BT`` (with memory): token (b, t) is
        written to and attends in cache row ``rows_BT[b, t]`` at position ``positions_BT[b, t]``,
        seeing that row's positions up to its own; a row past the memory's is padding. Several
        requests' chunks then share one row of tokens, and the memory's ``step`` is left to the
        caller. ``pick`` (indices into the flattened tokens) unembeds those tokens only:
        ``[1, len(pick), V]``; without it every token is unembedded."""
        c = self.config
        b, t = tokens_BT.shape
        if rows_BT is not None:
            s = kv_len or memory.sequence_len
            valid_BT = rows_BT < memory.batch_size
            mask_BTS = (jnp.arange(s)[None, None, :] <= positions_BT[:, :, None]) & valid_BT[:, :, None]
            lengths_B = jnp.zeros((b,), jnp.int32)  # the caller sets each slot's step
        else:
            if lengths_B is None:
                lengths_B = jnp.full((b,), t, jnp.int32)
            lengths_B = lengths_B.astype(jnp.int32)
            step_B = None if memory is None else memory.step
            positions_BT = jnp.arange(t, dtype=jnp.int32)[None, :]
            if step_B is not None:
                positions_BT = step_B[:, None] + positions_BT
            else:
                positions_BT = jnp.broadcast_to(positions_BT, (b, t))
            mask_BTS = attention_mask(tokens_BT, lengths_B, c.pad_token, step_B,
                                      None if memory is None else kv_len or memory.sequence_len)
            # Positions past a row's length (a bucket's padding, a free slot's decode row) are never
            # read by a valid position, so the MoE skips them: a step costs what its real tokens cost.
            valid_BT = jnp.arange(t)[None, :] < lengths_B[:, None]

        head = LanguageModelHead(c, self.backend, name="language_model")
        h_BTD = head.embed(tokens_BT)
        h_BTD, cache = Transformer(c, self.backend, name="transformer")(
            h_BTD, positions_BT=positions_BT, mask_BTS=mask_BTS, memory=memory, valid_BT=valid_BT, rows_BT=rows_BT)
        if pick is not None:
            h_BTD = h_BTD.reshape(b * t, -1)[pick][None]
        elif last_only:
            # Only the last real token's hidden state is unembedded (prefill): [B, 1, D].
            last_B = jnp.maximum(lengths_B - 1, 0)
            h_BTD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)
        logits = head.unembed(h_BTD)
        new_memory = None if memory is None else KVMemory(k=cache[0], v=cache[1], step=memory.step + lengths_B)
        return ForwardOutput(logits=logits, memory=new_memory)


def forward(params, tokens, config: ModelConfig, *, memory: KVMemory | None = None, lengths=None,
            last_only: bool = False, backend, kv_len: int | None = None) -> ForwardOutput:
    """Logits for ``tokens [B, T]``; with ``memory``, also the updated memory.

    ``lengths [B]`` is each row's number of real tokens (right padding beyond it is masked and, with
    memory, does not advance ``step``). ``backend``: a ``backends.Backend`` (``backends.XLA()``: pure JAX), with
    ``params`` canonical or from its ``prepare``. Outside ``jit`` a write past ``sequence_len`` raises
    ``ValueError`` here, before anything runs.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"forward: tokens must be [batch, time], got shape {tokens.shape}")
    if lengths is not None:
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != tokens.shape[:1]:
            raise ValueError(f"forward: lengths must be [{tokens.shape[0]}], got {lengths.shape}")
    if memory is not None:
        if memory.batch_size != tokens.shape[0]:
            raise ValueError(f"forward: memory has {memory.batch_size} rows, tokens {tokens.shape[0]}")
        memory.check_fits(np.full(tokens.shape[:1], tokens.shape[1]) if lengths is None else lengths)
        if kv_len is not None and not 0 < kv_len <= memory.sequence_len:
            raise ValueError(f"forward: kv_len must be in (0, {memory.sequence_len}], got {kv_len}")
    return _apply(params, tokens, memory, lengths, config=config, last_only=last_only,
                  backend=backend, kv_len=kv_len)


@functools.partial(jax.jit, static_argnames=("config", "last_only", "backend", "kv_len"))
def _apply(params, tokens, memory, lengths, *, config, last_only, backend, kv_len):
    # Jitted so that eager callers do not dispatch op by op; inside a caller's jit it simply inlines.
    return LanguageModel(config, backend).apply({"params": params}, tokens, memory, lengths, last_only, kv_len)


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """The backend of ``init``: Flax initialises parameters by running the forward once, whose
    values are thrown away, so its operations need only their outputs' shapes (zeros)."""

    layers: str = "scan"

    def matmul(self, x, w, dtype):
        return jnp.zeros(x.shape[:-1] + w.shape[-1:], dtype)

    def embed(self, table, tokens, dtype):
        return jnp.zeros(tokens.shape + table.shape[-1:], dtype)

    def unembed(self, h, table, dtype):
        return jnp.zeros(h.shape[:-1] + table.shape[:1], dtype)

    def grouped_matmul(self, x_RK, w, sizes_E, dtype):
        return jnp.zeros(x_RK.shape[:-1] + w.shape[-1:], dtype)

    def attention(self, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT=None, layer=None, rows_BT=None):
        return jnp.zeros_like(q_BTNH)


def _init(config: ModelConfig, rng, layers: str = "scan"):
    return LanguageModel(config, _Shapes(layers)).init(rng, jnp.zeros((1, 1), jnp.int32))


def init_params(config: ModelConfig, rng) -> dict:
    """Fresh random parameters (fan-in scaled normals, unit norm scales) in float32. Each layer
    is drawn under its own name (``decoder_layer_<i>``, as Grok-1's tree and the checkpoints name
    it) and the layers are then stacked: a seed gives the same weights however the stack runs."""
    return layers_together(nn.meta.unbox(_init(config, rng, "unrolled")["params"]))


def declared_params(config: ModelConfig, num_layers: int | None = None) -> dict[str, tuple[tuple, tuple]]:
    """``path -> (shape, logical axes)`` of every parameter, as the layers declare them (an
    abstract init: nothing is allocated). ``num_layers`` overrides the config's."""
    if num_layers is not None:
        config = dataclasses.replace(config, num_layers=num_layers)
    boxed = jax.eval_shape(lambda: _init(config, jax.random.PRNGKey(0)))
    leaves = jax.tree_util.tree_flatten_with_path(
        boxed["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    return {"/".join(str(k.key) for k in path): (tuple(box.value.shape), tuple(box.names)) for path, box in leaves}
