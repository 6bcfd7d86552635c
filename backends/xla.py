"""The pure-JAX backend: XLA's own operations, on any device and any mesh (the main path).

A weight is a float array or an int8 record (``model.quant.QuantizedWeight8bit``); both give their
value in a dtype by ``w.astype(dtype)``, so this module needs no model type.

Shape suffixes as in ``model/``: B batch, T tokens, S key positions, N query heads, K KV heads
(``k_BKSH``) or a contracting width (``x_RK``), H head size, R rows, E experts, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from backends.base import Backend
from model.memory import layer_of
from model.transformer import LAYERS, has_stacked_layers, layers_apart

_MASKED = -1e30  # Grok-1: masked attention logits are set to -1e30


@dataclasses.dataclass(frozen=True)
class XLA(Backend):
    """XLA's operations. ``grouped``: how the MoE's grouped matmul runs.

    - ``"ragged"``: ``jax.lax.ragged_dot``, one call over every expert's rows, the needed FLOPs
      only where the compiler has a grouped kernel (GPU and TPU).
    - ``"loop"``: per expert, its rows taken a few at a time into plain dots, in a loop on device
      whose trip count is the group's size, so an expert no row chose is never read. For XLA:CPU,
      which lowers ``ragged_dot`` densely: every row times every expert, after a transposed copy
      of the whole stack, on each call (the HLO of ``ragged_dot`` on CPU; BENCHMARKS.md has the
      measured cost).

    ``"auto"`` (``for_platform``) is ``loop`` on CPU and ``ragged`` elsewhere.
    """

    grouped: str = "ragged"
    # How the decoder stack runs (``model.transformer.Transformer``): "scan", one layer compiled
    # and looped over the stacked parameters (the canonical tree); "unrolled", each layer its own
    # code over its own parameters, which ``prepare`` holds apart; "indexed", one layer compiled
    # and looped over the layer index, each stacked parameter taken by ``take_layer``.
    layers: str = "scan"
    name = "xla"

    def __post_init__(self):
        if self.grouped not in ("ragged", "loop"):
            raise ValueError(f"XLA(grouped=...) must be 'ragged' or 'loop', got {self.grouped!r}")
        if self.layers not in LAYERS:
            raise ValueError(f"{type(self).__name__}(layers=...) must be one of {LAYERS}, got {self.layers!r}")

    def prepare(self, params):
        if self.layers == "unrolled" and has_stacked_layers(params):
            return layers_apart(params)
        return params

    @classmethod
    def for_platform(cls, platform: str) -> "XLA":
        return cls(grouped="loop" if platform == "cpu" else "ragged")

    def describe(self) -> str:
        how = "jax.lax.ragged_dot" if self.grouped == "ragged" else "a loop of dots per expert"
        return f"xla (the MoE's grouped matmul: {how}; layers {self.layers})"

    def matmul(self, x, w, dtype):
        return jnp.einsum("...M,MN->...N", x.astype(dtype), w.astype(dtype))

    def embed(self, table, tokens, dtype):
        return jnp.take(table, tokens, axis=0).astype(dtype)

    def unembed(self, h, table, dtype):
        return jnp.einsum("...D,VD->...V", h.astype(dtype), table.astype(dtype))

    def grouped_matmul(self, x_RK, w, sizes_E, dtype):
        if self.grouped == "ragged":
            return jax.lax.ragged_dot(x_RK.astype(dtype), w.astype(dtype), sizes_E.astype(jnp.int32))
        return loop_grouped_matmul(x_RK.astype(dtype), lambda x, e: x @ expert(w, e).astype(dtype),
                                   sizes_E, w.shape[-1], dtype)

    def attention(self, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT=None, layer=None, rows_BT=None):
        if rows_BT is not None:  # reads the layer's keys block by block from the stack
            return attend_rows(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT, rows_BT, layer,
                               read=self.kv_block)
        if layer is not None:  # the layer's slice of the stack (fused into its reads on GPU and TPU)
            k_BKSH, v_BKSH = layer_of(k_BKSH, layer), layer_of(v_BKSH, layer)
        return attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT)

    def kv_block(self, cache, layer, rows_G, start, size: int, dtype):
        """Positions ``[start, start + size)`` of cache rows ``rows_G`` (in range), of layer
        ``layer`` of a stack ``[L, B, K, S, H]`` (or of a cache ``[B, K, S, H]`` with ``layer``
        None; float, or an int8 record), in ``dtype``: ``[G, K, size, H]``."""
        return kv_block(cache, layer, rows_G, start, size, dtype)

    def copy_blocks(self, dst, src, valid_PJ, dst_row_PJ, dst_pos_PJ, src_row_PJ, src_pos_PJ, size: int):
        """``dst`` (caches ``[L, R, K, S, H]``: a pytree, float or int8 records) with each block
        (p, j) where ``valid_PJ`` copied from ``src`` (alike, other rows and positions): positions
        ``[dst_pos, + size)`` of row ``dst_row`` take ``[src_pos, + size)`` of row ``src_row``, in
        every layer (the prefix pool read into slots, or slots saved into it)."""
        return copy_blocks(dst, src, valid_PJ, dst_row_PJ, dst_pos_PJ, src_row_PJ, src_pos_PJ, size)

    def sampling_cut(self, scaled_BV, top_k_B, nucleus_p_B):
        return sorted_threshold(scaled_BV, top_k_B, nucleus_p_B)

    def logits_summary(self, logits_BV, top):
        values, ids = jax.lax.top_k(logits_BV, top)
        return values, ids, jax.nn.logsumexp(logits_BV, axis=-1), argmax(logits_BV)


def expert(w, e: int):
    """Expert ``e`` of a stacked weight ``[E, K, N]`` (float or int8)."""
    return jax.tree_util.tree_map(lambda a: a[e], w)


def group_rows(rows: int, experts: int) -> int:
    """Rows per dot in ``loop_grouped_matmul``: an expert's expected share of the rows, rounded up
    to a multiple of 4 (at least 4, at most all rows). A fuller expert loops, reading its weights
    again; padding rows cost compute. Measured at decode on the benchmark config, one share beat
    two (batch 32: 63-66 ms against 72-80 ms a step with the panel kernel; batch 8 within noise)."""
    return max(1, min(rows, max(4, -(-rows // (4 * experts)) * 4)))


def loop_grouped_matmul(x_RK, matmul, sizes_E, n: int, dtype):
    """Rows grouped by expert (``sizes_E[e]`` rows for expert e, in order), each group times its
    expert: ``matmul(x_rows, e)``. Per expert (a static loop) its rows go ``group_rows`` at a time
    into one dot each, in a ``fori_loop`` with the group's trip count (a ``cond`` where one dot
    takes every row), so an expert with no rows is skipped and its weights never read. Rows past
    the groups are zero. ``[R, n]`` in ``dtype``."""
    r = x_RK.shape[0]
    experts = sizes_E.shape[0]
    rows = group_rows(r, experts)
    sizes_E = sizes_E.astype(jnp.int32)
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    x_RK = jnp.pad(x_RK, ((0, rows), (0, 0)))  # every dot's slice stays in bounds
    out_RN = jnp.zeros((r + rows, n), dtype)
    for e in range(experts):
        def group(g, out_RN, e=e):
            start = starts_E[e] + g * rows
            y = matmul(jax.lax.dynamic_slice_in_dim(x_RK, start, rows), e)  # the expert's slice is taken here:
            real = g * rows + jnp.arange(rows) < sizes_E[e]                 # made only if this runs
            y = jnp.where(real[:, None], y, 0).astype(dtype)
            return jax.lax.dynamic_update_slice_in_dim(
                out_RN, jax.lax.dynamic_slice_in_dim(out_RN, start, rows) + y, start, 0)

        if r <= rows:  # a cond, not a loop: XLA hoisted a one-dot loop's body and ran every expert
            out_RN = jax.lax.cond(sizes_E[e] > 0, lambda out, group=group: group(0, out), lambda out: out, out_RN)
        else:  # one body for all dots keeps the compile time of a layer down
            out_RN = jax.lax.fori_loop(0, -(-sizes_E[e] // rows), group, out_RN)
    return out_RN[:r]


ATTENTION_BLOCK = 256  # query and key positions per block of a long chunk's attention


def attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, cap: float, temperature_BT=None):
    """Grouped-query attention of queries ``q [B, T, N, H]`` (rotated) over the first S positions
    of keys and values ``[B, K, S_max, H]`` (float, or int8 records: ``positions``) where
    ``mask [B, T, S]`` allows: ``[B, T, N, H]`` in q's dtype. Grok-1: logits times ``scale``,
    soft-capped at ``cap * tanh(x / cap)``, masked to -1e30, softmax in float32; Grok-2 then
    multiplies each query's capped logits by its ``temperature_BT`` (float32; None: 1). A prompt
    chunk over at least two blocks of keys is attended block by block (``attend_blocked``),
    skipping the key blocks no query of a block may see."""
    t, s = q_BTNH.shape[1], mask_BTS.shape[-1]
    queries = min(t, ATTENTION_BLOCK)
    if t >= 16 and t % queries == 0 and s >= 2 * ATTENTION_BLOCK and s % ATTENTION_BLOCK == 0:
        return attend_blocked(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, queries, temperature_BT=temperature_BT)
    return attend_dense(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT)


ROW_BLOCK = 16  # queries a block of a packed prefill's attention (the runner aligns each chunk to it)


def copy_blocks(dst, src, valid_PJ, dst_row_PJ, dst_pos_PJ, src_row_PJ, src_pos_PJ, size: int):
    """``XLA.copy_blocks``: a loop on the device over each p's blocks from its first valid one to
    its last (a call touches only the blocks it copies)."""
    nb = valid_PJ.shape[1]
    some_P = jnp.any(valid_PJ, axis=1)
    first_P = jnp.where(some_P, jnp.argmax(valid_PJ, axis=1), 0)
    count_P = jnp.where(some_P, nb - jnp.argmax(valid_PJ[:, ::-1], axis=1) - first_P, 0)

    def block(p, j, out):
        def put(d, s):
            got = jax.lax.dynamic_slice(s, (0, src_row_PJ[p, j], 0, src_pos_PJ[p, j], 0),
                                        (s.shape[0], 1, s.shape[2], size, s.shape[4]))
            return jax.lax.dynamic_update_slice(d, got.astype(d.dtype), (0, dst_row_PJ[p, j], 0, dst_pos_PJ[p, j], 0))

        return jax.lax.cond(valid_PJ[p, j], lambda: jax.tree_util.tree_map(put, out, src), lambda: out)

    def row(p, out):
        return jax.lax.fori_loop(first_P[p], first_P[p] + count_P[p], lambda j, o: block(p, j, o), out)

    return jax.lax.fori_loop(0, valid_PJ.shape[0], row, dst)


def kv_block(cache, layer, rows_G, start, size: int, dtype):
    """``XLA.kv_block``: sliced and gathered by XLA (a bf16 cache as its bits, ``positions``)."""
    def read(a):
        if layer is None:
            return jnp.take(jax.lax.dynamic_slice_in_dim(a, start, size, axis=2), rows_G, axis=0)
        got = jax.lax.dynamic_slice(a, (layer, 0, 0, start, 0), (1, *a.shape[1:3], size, a.shape[4]))
        return jnp.take(got[0], rows_G, axis=0)

    return positions(cache, read, dtype)


def attend_rows(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, cap: float, temperature_BT, rows_BT, layer=None,
                block: int = ROW_BLOCK, read=kv_block):
    """``attend`` of queries that each read a cache row of their own, query (b, t) row
    ``rows_BT[b, t]`` (a packed prefill: several requests' chunks in one row of tokens). The
    queries are taken ``block`` at a time, every block against the cache row of one of its rows in
    the same pass (its keys gathered block of keys by block of keys, FlashAttention's running
    softmax over them): one pass where each chunk starts at a multiple of ``block``, as the runner
    packs them, one more for each further row a block holds. Up to ``ATTENTION_BLOCK`` queries go
    together, each group stopping after the last key any of its queries may see (a chunk's causal
    half is not computed); a group whose queries all read one row (a long chunk) is attended as
    one block against that row's keys, in the larger matmuls of ``attend_blocked``. A call's attention then costs about what its rows' own attention does,
    whichever rows share it. A query of no row (a cache row past the last: padding) gets zeros.
    With ``layer`` the caches are every layer's ``[L, B, K, S, H]``, of which each block of keys is
    read from that layer (never a copy of the layer's whole cache), by ``read`` (``kv_block``'s
    arguments: a backend's ``kv_block``)."""
    b, t, n, h = q_BTNH.shape
    s, q = mask_BTS.shape[-1], b * t
    block = block if q % block == 0 else q
    group = ATTENTION_BLOCK // block if ATTENTION_BLOCK % block == 0 and q % ATTENTION_BLOCK == 0 else q // block
    shape = jax.tree_util.tree_leaves(k_BKSH)[0].shape[-4:]  # [B, K, S_max, H] of a layer
    nb, slots, k, g = q // block, shape[0], shape[1], n // shape[1]
    keys = min(s, ATTENTION_BLOCK) if s % min(s, ATTENTION_BLOCK) == 0 else s
    positions_S = jnp.arange(s)
    q_bCKGH = q_BTNH.reshape(nb, block, k, g, h)
    rows_bC, mask_bCS = rows_BT.reshape(nb, block), mask_BTS.reshape(nb, block, s)
    temp_bC = None if temperature_BT is None else temperature_BT.reshape(nb, block)

    def attend_to(q_gCKGH, allowed_gCS, r_g, temp_gC):
        """Each block g of queries over the keys of cache row ``r_g[g]`` it is ``allowed``, key
        block by key block up to the last any of them may see: ``[g, C, K, G, H]``."""
        blocks, size = q_gCKGH.shape[:2]
        temp = None if temp_gC is None else temp_gC[:, None, None, :, None]
        last = jnp.max(jnp.where(allowed_gCS, positions_S, -1))

        def key_block(j, carry):  # block j of keys of the rows r_g: [g, K, keys, H] (of the layer's)
            k_gKcH, v_gKcH = (read(x, layer, r_g, j * keys, keys, q_BTNH.dtype) for x in (k_BKSH, v_BKSH))
            allowed = jax.lax.dynamic_slice_in_dim(allowed_gCS, j * keys, keys, axis=2)
            return online_softmax_step(carry, q_gCKGH, k_gKcH, v_gKcH, allowed, scale, cap, temp)

        init = (jnp.full((blocks, k, g, size), -jnp.inf, jnp.float32),
                jnp.zeros((blocks, k, g, size), jnp.float32), jnp.zeros((blocks, k, g, size, h), jnp.float32))
        _, l_gKGC, acc_gKGCH = jax.lax.fori_loop(0, jnp.maximum(last // keys + 1, 1), key_block, init)
        return (acc_gKGCH / l_gKGC[..., None]).astype(q_BTNH.dtype).transpose(0, 3, 1, 2, 4)

    def groups(i, out_bCKGH):  # blocks [i * group, (i + 1) * group)
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, i * group, group, axis=0)  # noqa: E731
        q_gCKGH, rows_gC, mask_gCS = take(q_bCKGH), take(rows_bC), take(mask_bCS)
        temp_gC = None if temp_bC is None else take(temp_bC)
        valid_gC = (rows_gC >= 0) & (rows_gC < slots)

        def one_row():  # every query of the group reads one row: its blocks together, as one
            r = jnp.minimum(jnp.min(jnp.where(valid_gC, rows_gC, slots)), slots - 1)
            flat = lambda a: a.reshape(1, group * block, *a.shape[2:])  # noqa: E731
            got = attend_to(flat(q_gCKGH), flat(mask_gCS & valid_gC[:, :, None]), r[None],
                            None if temp_gC is None else flat(temp_gC)).reshape(q_gCKGH.shape)
            return jnp.where(valid_gC[:, :, None, None, None], got, 0).astype(q_gCKGH.dtype)

        def one_pass(carry):  # every block's lowest row not yet attended
            out_gCKGH, todo_gC = carry
            r_g = jnp.min(jnp.where(todo_gC, rows_gC, slots), axis=1)
            mine_gC = todo_gC & (rows_gC == r_g[:, None])
            got = attend_to(q_gCKGH, mask_gCS & mine_gC[:, :, None], jnp.minimum(r_g, slots - 1), temp_gC)
            return jnp.where(mine_gC[:, :, None, None, None], got, out_gCKGH), todo_gC & ~mine_gC

        def by_blocks():
            return jax.lax.while_loop(lambda carry: jnp.any(carry[1]), one_pass,
                                      (jnp.zeros_like(q_gCKGH), valid_gC))[0]

        first = jnp.min(jnp.where(valid_gC, rows_gC, slots))
        out_gCKGH = jax.lax.cond(jnp.all(~valid_gC | (rows_gC == first)), one_row, by_blocks)
        return jax.lax.dynamic_update_slice_in_dim(out_bCKGH, out_gCKGH, i * group, axis=0)

    out = jax.lax.fori_loop(0, nb // group, groups, jnp.zeros_like(q_bCKGH))
    return out.reshape(b, t, n, h)


def online_softmax_step(carry, q_BQKGH, k_BKCH, v_BKCH, allowed_BQC, scale: float, cap: float, temperature=None):
    """One block of keys of FlashAttention's recurrence: ``carry = (max, sum, acc)`` of the
    queries ``[B, K, G, Q]`` (acc ``[B, K, G, Q, H]``, float32) updated with keys and values
    ``[B, K, C, H]`` where ``allowed [B, Q, C]``; the products in the queries' dtype."""
    m_BKGQ, l_BKGQ, acc_BKGQH = carry
    logits = capped_logits(jnp.einsum("BQKGH,BKCH->BKGQC", q_BQKGH, k_BKCH).astype(jnp.float32), scale, cap,
                           temperature)
    logits = jnp.where(allowed_BQC[:, None, None], logits, _MASKED)
    m_new = jnp.maximum(m_BKGQ, jnp.max(logits, axis=-1))
    p = jnp.exp(logits - m_new[..., None])
    correction = jnp.exp(m_BKGQ - m_new)
    pv = jnp.einsum("BKGQC,BKCH->BKGQH", p.astype(q_BQKGH.dtype), v_BKCH).astype(jnp.float32)
    return m_new, l_BKGQ * correction + jnp.sum(p, axis=-1), acc_BKGQH * correction[..., None] + pv


def capped_logits(logits, scale: float, cap: float, temperature=None):
    """Grok's attention logits from the raw dot products (float32): ``cap * tanh(x * scale / cap)``,
    times a per-query temperature broadcast against them where one is given."""
    logits = cap * jnp.tanh(logits * scale / cap)
    return logits if temperature is None else logits * temperature


def attend_blocked(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, cap: float, queries: int = ATTENTION_BLOCK,
                   block: int = ATTENTION_BLOCK, temperature_BT=None):
    """``attend_dense``, ``queries`` queries at a time over key blocks with a running softmax
    (FlashAttention's recurrence), each query block stopping after the last key block any of its
    queries may see: a prompt chunk's causal half, and the KV bucket past the rows' positions,
    are never computed. Equal to ``attend_dense`` up to float rounding (the softmax's sums run in
    another order); a query that sees no key gets the mean of the values it computed over, as
    the dense softmax of all-masked logits gives."""
    b, t, n, h = q_BTNH.shape
    s, dtype = mask_BTS.shape[-1], q_BTNH.dtype
    k, g = k_BKSH.shape[1], n // k_BKSH.shape[1]
    q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
    positions_S = jnp.arange(s)

    def query_block(i, out_BTKGH):
        q_BQKGH = jax.lax.dynamic_slice_in_dim(q_BTKGH, i * queries, queries, axis=1)
        mask_BQS = jax.lax.dynamic_slice_in_dim(mask_BTS, i * queries, queries, axis=1)
        temp = None if temperature_BT is None else \
            jax.lax.dynamic_slice_in_dim(temperature_BT, i * queries, queries, axis=1)[:, None, None, :, None]
        last = jnp.max(jnp.where(mask_BQS, positions_S, -1))  # the last key any query here sees
        blocks = jnp.maximum(last // block + 1, 1)

        def key_block(j, carry):
            k_BKCH, v_BKCH = (positions(x, lambda a: jax.lax.dynamic_slice_in_dim(a, j * block, block, axis=2), dtype)
                              for x in (k_BKSH, v_BKSH))
            mask_BQC = jax.lax.dynamic_slice_in_dim(mask_BQS, j * block, block, axis=2)
            return online_softmax_step(carry, q_BQKGH, k_BKCH, v_BKCH, mask_BQC, scale, cap, temp)

        init = (jnp.full((b, k, g, queries), -jnp.inf, jnp.float32), jnp.zeros((b, k, g, queries), jnp.float32),
                jnp.zeros((b, k, g, queries, h), jnp.float32))
        _, l_BKGQ, acc_BKGQH = jax.lax.fori_loop(0, blocks, key_block, init)
        out_BQKGH = (acc_BKGQH / l_BKGQ[..., None]).astype(dtype).transpose(0, 3, 1, 2, 4)
        return jax.lax.dynamic_update_slice_in_dim(out_BTKGH, out_BQKGH, i * queries, axis=1)

    out = jax.lax.fori_loop(0, t // queries, query_block, jnp.zeros((b, t, k, g, h), dtype))
    return out.reshape(b, t, n, h)


def positions(cache, take, dtype):
    """``take`` (some positions: an operation on axis 2) of a cache ``[B, K, S, H]``, a float
    array or an int8 record whose leaves share those axes (``model.memory.QuantizedKV``), in
    ``dtype``. A bf16 cache is taken as its 16-bit patterns (``moved_as_bits``)."""
    return jax.tree_util.tree_map(moved_as_bits(take), cache).astype(dtype)


def moved_as_bits(take):
    """``take`` (slices and gathers: data moved, not computed) applied to a bf16 array as its
    16-bit patterns. XLA:CPU has no bf16 slice or gather: it widens the operand to float32
    first, and where the operand is a loop's invariant (the KV stack, in a prefill's loops over
    layers and key blocks) it widened the whole stack, every call: bench config, bf16, 8 slots, a
    512-token prefill 610 ms of which 133 widened the two stacks (AMD EPYC, 2 cores,
    ``python -m bench.profile``). As bits nothing is widened but the block read."""
    def moved(a):
        if a.dtype != jnp.bfloat16:
            return take(a)
        return jax.lax.bitcast_convert_type(take(jax.lax.bitcast_convert_type(a, jnp.uint16)), jnp.bfloat16)
    return moved


def attend_dense(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale: float, cap: float, temperature_BT=None):
    """``attend`` in one piece: every query against every key of the first S positions."""
    b, t, n, h = q_BTNH.shape
    s, dtype = mask_BTS.shape[-1], q_BTNH.dtype
    k, g = k_BKSH.shape[1], n // k_BKSH.shape[1]
    # read only the S positions the mask covers (a bucket of the cache), in q's dtype
    k_BKSH, v_BKSH = (positions(x, lambda a: a[:, :, :s], dtype) for x in (k_BKSH, v_BKSH))
    # GQA: query head j uses KV head j // g (contiguous groups of g query heads).
    q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
    logits_BKGTS = jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH).astype(jnp.float32)
    logits_BKGTS = capped_logits(logits_BKGTS, scale, cap,
                                 None if temperature_BT is None else temperature_BT[:, None, None, :, None])
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _MASKED)
    weights_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(dtype)  # softmax in float32
    # per (row, KV head) a plain [G*T, S] @ [S, H] matmul; the small result is transposed after
    out_BTKGH = jnp.einsum("BKGTS,BKSH->BKGTH", weights_BKGTS, v_BKSH).transpose(0, 3, 1, 2, 4)
    return out_BTKGH.reshape(b, t, n, h)


def sorted_threshold(scaled_BV, top_k_B, nucleus_p_B):
    """The smallest tempered logit that top-k (``top_k``, 0 = off) then top-p (``nucleus_p``,
    >= 1 = off) keep, by sorting each row: the reference rule. Top-p keeps a token while the mass
    of the tokens before it, in the softmax of the top-k survivors, is below p; the most likely
    token always survives (p -> 0 is argmax)."""
    v = scaled_BV.shape[-1]
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)  # descending
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    kth_B = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)[:, 0]
    # nucleus over the top-k survivors: keep a token while the mass before it is below p
    in_top_k_BV = jnp.arange(v)[None, :] < k_B[:, None]
    shifted_BV = jnp.where(in_top_k_BV, sorted_BV - sorted_BV[:, :1], -jnp.inf)  # max-subtracted
    probs_BV = jax.nn.softmax(shifted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # p >= 1 is off: float32's cumulative sum reaches 1 before the tail does and would cut it
    keep_BV = ((mass_before_BV < nucleus_p_B[:, None]) | (nucleus_p_B[:, None] >= 1)) & in_top_k_BV
    keep_BV = keep_BV.at[:, 0].set(True)  # the most likely token always survives (p -> 0 is argmax)
    last_kept_B = jnp.sum(keep_BV, axis=-1) - 1
    threshold_B = jnp.take_along_axis(sorted_BV, last_kept_B[:, None], axis=-1)[:, 0]
    return jnp.maximum(threshold_B, kth_B)


def argmax(x_BV):
    """``jnp.argmax`` over the last axis (first index among ties), as two plain reductions:
    XLA:CPU runs the single (value, index) reduction of ``jnp.argmax`` 3-4x slower."""
    v = x_BV.shape[-1]
    first_B = jnp.min(jnp.where(x_BV == jnp.max(x_BV, axis=-1, keepdims=True), jnp.arange(v), v), axis=-1)
    return jnp.minimum(first_B, v - 1)  # a row of NaNs has no maximum: its last index, never out of range
