"""The CPU kernels as JAX operations (XLA FFI calls), and the column-panel layout they read.

A weight ``w [K, N]`` is held as ``[ceil(N / 32), K, 32]``: panel p is columns ``32p .. 32p+31``
(zero past N), one contiguous run. Stacked experts ``[E, K, N]`` are ``[E, ceil(N / 32), K, 32]``.
- ``panel_matmul`` multiplies by one weight (``panel_matmul.cc``): it streams each panel front to
  back on XLA's CPU thread pool. Per BENCHMARKS.md it reads weights 1.5-2x faster than XLA:CPU's
  own dot for 2 to 32 rows on an AVX-512 Zen 4, at least as fast for one row.
- ``grouped_matmul`` multiplies rows grouped by expert, each group by its own expert, in one call
  (the MoE): an expert no row chose is never read, and one with many rows is read once.
- ``bf16_panel_matmul`` and ``grouped_bf16_matmul`` are the same products by bf16 weights held
  in panels of row pairs ``[..., P, ceil(K / 2), 32, 2]`` (``pack_pairs``): on AVX512-BF16's
  pairwise dot where the CPU has it, widened to float32 in registers where not.
- ``w8a8_panel_matmul`` and ``grouped_w8a8_matmul`` multiply by int8 weights held in panels of
  row quads ``[..., P, ceil(K / 32) * 8, 32, 4]`` (``pack_quads``) with each row of x rounded to
  int8 per block of 32 (llama.cpp's q8_0 dot, on AVX512-VNNI or AVX-VNNI's ``vpdpbusd`` where the
  CPU has one): the ``--quantize w8a8`` mode, not Grok-1's exact product (``w8a8_reference``).
- Each of these also takes ``layer``: the weight is then every layer's, stacked on a leading axis
  (``[L, ...]``), and layer ``layer`` (a traced int32 scalar) is read in place (``in_layer``),
  which lets the layers run as one compiled loop (``model.transformer``'s ``"indexed"`` stack):
  XLA:CPU would copy a slice of the stack out before the call.
- ``decode_attention`` is a decode step's attention read in place from the KV cache (float32 or
  bf16; ``attention.cc``): XLA:CPU copies the attended positions out of the cache first;
  ``decode_attention_int8`` reads an int8 cache and its scales the same way.
- ``filter_threshold`` is the cut of top-k and top-p sampling found without sorting the
  vocabulary, and ``logits_summary`` a row's top tokens and log-normaliser in one pass
  (``sampling.cc``): XLA:CPU's sort made a top-p batch-32 step about 5x slower, and its top-8
  took 1.6 ms of a greedy one.

Each call checks that the kernels are built (``backends.cpu.build``) and raises ``RuntimeError``
saying why not otherwise.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import build
from model.host import host_empty

PANEL = 32


def pack(w, dtype=np.float32) -> np.ndarray:
    """``w [..., K, N]`` as panels ``[..., ceil(N / 32), K, 32]`` of ``dtype`` (a new host array,
    in huge pages where available; zero past N)."""
    w = np.asarray(w)
    if w.dtype != dtype:
        w = w.astype(dtype)
    *lead, k, n = w.shape
    panels = -(-n // PANEL)
    out = host_empty((*lead, panels, k, PANEL), dtype, huge=True)
    full = n // PANEL  # the whole panels, then the last one padded with zeros
    out[..., :full, :, :] = np.moveaxis(w[..., : full * PANEL].reshape(*lead, k, full, PANEL), -2, -3)
    if full < panels:
        out[..., full, :, :] = 0
        out[..., full, :, : n - full * PANEL] = w[..., full * PANEL:]
    return out


def pack_pairs(w) -> np.ndarray:
    """``w [..., K, N]`` as bf16 panels of row pairs ``[..., ceil(N / 32), ceil(K / 2), 32, 2]``
    (rounded to bf16; zero past N and past an odd K): rows 2j and 2j + 1 of a panel interleaved
    column by column, the operand layout of AVX512-BF16's pairwise dot (``panel_matmul.cc``).
    Held as the bf16 values' bits (uint16): XLA:CPU widens a gather from a bf16 array (the
    embedding's lookup) to float32 over the whole array first, and converts a bitcast of one as a
    copy; the kernels read the bits as bf16."""
    w = np.asarray(w)
    k = w.shape[-2]
    if k % 2:
        w = np.concatenate([w, np.zeros((*w.shape[:-2], 1, w.shape[-1]), w.dtype)], axis=-2)
    panels = pack(w, jnp.bfloat16)  # [..., P, K, 32]
    *lead, p, k_even, _ = panels.shape
    pairs = host_empty((*lead, p, k_even // 2, PANEL, 2), np.uint16, huge=True)
    pairs[...] = panels.reshape(*lead, p, k_even // 2, 2, PANEL).swapaxes(-1, -2).view(np.uint16)
    return pairs


def unpack(panels, n: int):
    """The ``[K, N]`` weight that ``panels`` holds (for tests and XLA fallbacks)."""
    p, k, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n]


def _check_call(name: str, x, panels, n: int) -> None:
    """What every product by panels ``[..., P, K, 32]`` needs: float32, ``n`` the width of the P
    panels, and the kernels built."""
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise ValueError(f"{name} is float32 only, got x {x.dtype} and panels {panels.dtype}")
    p = panels.shape[-3]
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"n={n} is not the width of {p} panels of {PANEL}")
    build.require()


def in_layer(panels, sizes_E, layer, *extra):
    """Layer ``layer`` of stacked expert panels ``[L, E, ...]``, as the grouped kernels read it in
    place: the stack seen as ``L * E`` experts (a reshape, no copy) and the group sizes spread
    over them, ``sizes_E`` at layer ``layer``'s experts and 0 elsewhere (an expert with no rows is
    never read). ``extra`` (the int8 scales ``[L, E, ...]``) are seen alike. Returns the flattened
    panels, the ``[L * E]`` sizes and the flattened extras."""
    layers, experts = panels.shape[:2]
    sizes = jnp.zeros((layers, experts), jnp.int32).at[layer].set(sizes_E.astype(jnp.int32)).reshape(-1)
    flat = lambda a: a.reshape(layers * experts, *a.shape[2:])
    return flat(panels), sizes, *(flat(a) for a in extra)


def _rows_in_layer(x, panels, layer, *extra):
    """A plain product's operands as a grouped one's in layer ``layer`` of panels ``[L, ...]``
    (each layer one expert): ``x [..., K]`` as rows ``[R, K]``, all of them in that layer's group."""
    rows = x.reshape(-1, x.shape[-1])
    return (rows, *in_layer(panels[:, None], jnp.full((1,), rows.shape[0], jnp.int32), layer,
                            *(a[:, None] for a in extra)))


def panel_matmul(x, panels, n: int, layer=None):
    """``x [..., K] @ w [K, n]`` in float32, ``w`` given as its panels ``[P, K, 32]`` (with
    ``layer``: every layer's, ``[L, P, K, 32]``, of which that one is read)."""
    if layer is not None:
        rows, flat, sizes = _rows_in_layer(x, panels, layer)
        return grouped_matmul(rows, flat, sizes, n).reshape(*x.shape[:-1], n)
    if panels.ndim != 3 or panels.shape[2] != PANEL or x.shape[-1] != panels.shape[1]:
        raise ValueError(f"x {x.shape} does not match panels {panels.shape} ([P, K, {PANEL}])")
    _check_call("panel_matmul", x, panels, n)
    return jax.ffi.ffi_call(build.MATMUL, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32))(x, panels)


def grouped_matmul(x, panels, sizes, n: int, layer=None):
    """Rows grouped by expert, each group times its own expert's weight: ``x [R, K]`` holds
    ``sizes[0]`` rows for expert 0, then ``sizes[1]`` rows for expert 1, ...; the result
    ``[R, n]`` has ``x[rows of e] @ w_e`` there and zeros in the rows past the last group.
    ``panels [E, P, K, 32]`` are every expert's panels. ``sizes`` (int32 ``[E]``) may be traced;
    they must be non-negative and sum to at most R (the kernel fails otherwise). An expert with
    no rows is never read; one with many reads its weight once for all of them. With ``layer``,
    ``panels [L, E, P, K, 32]`` are every layer's experts, of which that layer's are read."""
    if layer is not None:
        panels, sizes = in_layer(panels, sizes, layer)
    if x.ndim != 2 or panels.ndim != 4 or panels.shape[3] != PANEL or x.shape[1] != panels.shape[2]:
        raise ValueError(f"x {x.shape} does not match expert panels {panels.shape} ([R, K] and [E, P, K, {PANEL}])")
    if sizes.shape != (panels.shape[0],):
        raise ValueError(f"sizes {sizes.shape} must have one entry per expert ({panels.shape[0]})")
    _check_call("grouped_matmul", x, panels, n)
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(build.GROUPED, out)(x, panels, sizes.astype(jnp.int32))


def _check_pairs(name: str, x, panels, n: int) -> None:
    if x.dtype != jnp.float32 or panels.dtype != jnp.uint16:
        raise ValueError(f"{name} takes float32 x and bf16 panels (their bits, uint16), got {x.dtype} and "
                         f"{panels.dtype}")
    if panels.shape[-2:] != (PANEL, 2) or panels.shape[-3] != -(-x.shape[-1] // 2):
        raise ValueError(f"x {x.shape} does not match bf16 panels {panels.shape} ([..., P, ceil(K / 2), {PANEL}, 2])")
    p = panels.shape[-4]
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"n={n} is not the width of {p} panels of {PANEL}")
    build.require()


def bf16_panel_matmul(x, panels, n: int, layer=None):
    """``x [..., K] @ w [K, n]`` with ``w`` bf16 in panels of row pairs ``[P, ceil(K / 2), 32, 2]``
    (``pack_pairs``): x rounded to bf16, the products summed in float32 (AVX512-BF16's dot where
    the CPU has it, else widened to float32 in registers). ``[..., n]`` float32. ``layer`` as in
    ``panel_matmul``."""
    if layer is not None:
        rows, flat, sizes = _rows_in_layer(x, panels, layer)
        return grouped_bf16_matmul(rows, flat, sizes, n).reshape(*x.shape[:-1], n)
    if panels.ndim != 4:
        raise ValueError(f"bf16 panels must be [P, ceil(K / 2), {PANEL}, 2], got {panels.shape}")
    _check_pairs("bf16_panel_matmul", x, panels, n)
    return jax.ffi.ffi_call(build.BF16_MATMUL, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32))(x, panels)


def grouped_bf16_matmul(x, panels, sizes, n: int, layer=None):
    """``grouped_matmul`` with bf16 experts in panels of row pairs ``[E, P, ceil(K / 2), 32, 2]``,
    multiplied as in ``bf16_panel_matmul`` (``layer`` as in ``grouped_matmul``)."""
    if layer is not None:
        panels, sizes = in_layer(panels, sizes, layer)
    if x.ndim != 2 or panels.ndim != 5:
        raise ValueError(f"x {x.shape} and bf16 expert panels {panels.shape} must be [R, K] and "
                         f"[E, P, ceil(K / 2), {PANEL}, 2]")
    if sizes.shape != (panels.shape[0],):
        raise ValueError(f"sizes {sizes.shape} must have one entry per expert ({panels.shape[0]})")
    _check_pairs("grouped_bf16_matmul", x, panels, n)
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(build.BF16_GROUPED, out)(x, panels, sizes.astype(jnp.int32))


def _check_int8(name: str, x, panels, scales, n: int) -> None:
    if x.dtype != jnp.float32 or panels.dtype != jnp.int8 or scales.dtype != jnp.float32:
        raise ValueError(f"{name} takes float32 x, int8 panels and float32 scales, got {x.dtype}, {panels.dtype} and "
                         f"{scales.dtype}")
    if scales.shape[:-2] != panels.shape[:-2] or scales.shape[-1] != PANEL or panels.shape[-2] % scales.shape[-2]:
        raise ValueError(f"scales {scales.shape} do not match int8 panels {panels.shape} ([..., P, G, {PANEL}], "
                         "G dividing K)")
    p = panels.shape[-3]
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"n={n} is not the width of {p} panels of {PANEL}")
    build.require()


def int8_panel_matmul(x, panels, scales, n: int, bf16: bool = False, layer=None):
    """``x [..., K] @ w [K, n]`` in float32 with ``w`` int8: its panels ``[P, K, 32]`` and float32
    scales ``[P, G, 32]`` (rows g K/G .. (g + 1) K/G of a panel times scales[p, g]), widened in
    registers (``panel_matmul.cc``): the product by the dequantised weight up to float32 rounding.
    With ``bf16`` (bf16 activations) on a CPU with AVX512-BF16, x is rounded to bf16 and each
    panel dequantised to bf16 in cache (Grok-1's own rounding of the weight) and multiplied on the
    bf16 dot; elsewhere ``bf16`` changes nothing. ``layer`` as in ``panel_matmul`` (the scales
    stacked alike)."""
    if layer is not None:
        rows, flat, sizes, flat_scales = _rows_in_layer(x, panels, layer, scales)
        return grouped_int8_matmul(rows, flat, flat_scales, sizes, n, bf16).reshape(*x.shape[:-1], n)
    if panels.ndim != 3 or panels.shape[2] != PANEL or x.shape[-1] != panels.shape[1] or scales.ndim != 3:
        raise ValueError(f"x {x.shape} does not match int8 panels {panels.shape} ([P, K, {PANEL}])")
    _check_int8("int8_panel_matmul", x, panels, scales, n)
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32)
    return jax.ffi.ffi_call(build.INT8_MATMUL, out)(x, panels, scales, bf16=bool(bf16))


def grouped_int8_matmul(x, panels, scales, sizes, n: int, bf16: bool = False, layer=None):
    """``grouped_matmul`` with int8 experts: ``panels [E, P, K, 32]`` int8 and ``scales
    [E, P, G, 32]`` float32, as in ``int8_panel_matmul`` (``bf16`` too; ``layer`` as in
    ``grouped_matmul``)."""
    if layer is not None:
        panels, sizes, scales = in_layer(panels, sizes, layer, scales)
    if x.ndim != 2 or panels.ndim != 4 or panels.shape[3] != PANEL or x.shape[1] != panels.shape[2]:
        raise ValueError(f"x {x.shape} does not match int8 expert panels {panels.shape} ([R, K] and [E, P, K, {PANEL}])")
    if sizes.shape != (panels.shape[0],):
        raise ValueError(f"sizes {sizes.shape} must have one entry per expert ({panels.shape[0]})")
    _check_int8("grouped_int8_matmul", x, panels, scales, n)
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(build.INT8_GROUPED, out)(x, panels, scales, sizes.astype(jnp.int32), bf16=bool(bf16))


W8A8_BLOCK = 32  # the activations' rounding block along K (q8_0's), and the quad panels' K padding


def pack_quads(weight, scales):
    """An int8 weight ``[..., K, N]`` with scales ``[..., G, N]`` as the w8a8 kernels read it:
    int8 panels of row quads ``[..., P, Kp / 4, 32, 4]`` (Kp: K rounded up to 32, zero rows past
    K; rows 4j .. 4j + 3 of a column side by side, vpdpbusd's operand), the compensation
    ``[..., P, Kp / 32, 32]`` int32 (-128 times each block's column sums: the kernel feeds the
    activations in as q + 128) and float32 scale panels ``[..., P, G, 32]``."""
    weight = np.asarray(weight, np.int8)
    *lead, k, n = weight.shape
    kp = -(-k // W8A8_BLOCK) * W8A8_BLOCK
    if kp != k:
        weight = np.concatenate([weight, np.zeros((*lead, kp - k, n), np.int8)], axis=-2)
    panels = pack(weight, np.int8)  # [..., P, Kp, 32]
    *_, p, _, _ = panels.shape
    quads = host_empty((*lead, p, kp // 4, PANEL, 4), np.int8, huge=True)
    quads[...] = panels.reshape(*lead, p, kp // 4, 4, PANEL).swapaxes(-1, -2)
    comp = (-128 * panels.reshape(*lead, p, kp // W8A8_BLOCK, W8A8_BLOCK, PANEL).astype(np.int32).sum(-2))
    return quads, comp.astype(np.int32), pack(np.asarray(scales, np.float32), np.float32)


def w8a8_fits(k: int, groups: int) -> bool:
    """Whether an int8 weight of depth ``k`` in ``groups`` scale groups takes the w8a8 kernels:
    each group a whole number of the activations' blocks of 32 (one group always does)."""
    return groups == 1 or (k % groups == 0 and (k // groups) % W8A8_BLOCK == 0)


def w8a8_reference(x, weight, scales):
    """What the w8a8 kernels compute, in numpy (float64 sums of exact int32 block sums): each row
    of ``x [..., K]`` rounded to int8 per block of 32 along K (scale = the block's largest
    magnitude / 127 in float32; q = x * (1 / scale) rounded to nearest even), times the int8
    ``weight [K, N]`` with ``scales [G, N]``."""
    x = np.asarray(x, np.float32)
    weight, scales = np.asarray(weight, np.int64), np.asarray(scales, np.float32)
    k, n = weight.shape
    kp = -(-k // W8A8_BLOCK) * W8A8_BLOCK
    rows = np.zeros((*x.shape[:-1], kp), np.float32)
    rows[..., :k] = x
    blocks = rows.reshape(*x.shape[:-1], kp // W8A8_BLOCK, W8A8_BLOCK)
    d = np.max(np.abs(blocks), axis=-1) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[..., None]), -127, 127).astype(np.int64)
    w = np.zeros((kp, n), np.int64)
    w[:k] = weight
    sums = np.einsum("...bi,bin->...bn", q, w.reshape(kp // W8A8_BLOCK, W8A8_BLOCK, n))  # exact int
    if not w8a8_fits(k, scales.shape[0]):
        raise ValueError(f"w8a8_reference: {scales.shape[0]} scale groups do not fit K={k}'s blocks of {W8A8_BLOCK}")
    group = np.repeat(scales, (kp // W8A8_BLOCK) // scales.shape[0], axis=0)  # [blocks, N]: each block's scales
    return np.sum(sums * d[..., None].astype(np.float64) * group.astype(np.float64), axis=-2).astype(np.float32)


def _check_w8a8(name: str, x, panels, comp, scales, n: int) -> None:
    if x.dtype != jnp.float32 or panels.dtype != jnp.int8 or comp.dtype != jnp.int32 or scales.dtype != jnp.float32:
        raise ValueError(f"{name} takes float32 x, int8 quad panels, int32 comp and float32 scales, got {x.dtype}, "
                         f"{panels.dtype}, {comp.dtype} and {scales.dtype}")
    blocks = -(-x.shape[-1] // W8A8_BLOCK)
    if panels.shape[-3:] != (blocks * W8A8_BLOCK // 4, PANEL, 4) or comp.shape[-2:] != (blocks, PANEL):
        raise ValueError(f"x {x.shape} does not match quad panels {panels.shape} and comp {comp.shape} "
                         f"([..., P, {blocks * W8A8_BLOCK // 4}, {PANEL}, 4] and [..., P, {blocks}, {PANEL}])")
    if (scales.shape[:-2] != panels.shape[:-3] or comp.shape[:-2] != panels.shape[:-3] or scales.shape[-1] != PANEL
            or blocks % scales.shape[-2]):
        raise ValueError(f"scales {scales.shape} do not match quad panels {panels.shape} ([..., P, G, {PANEL}], G "
                         f"dividing K's {blocks} blocks of {W8A8_BLOCK})")
    p = panels.shape[-4]
    if not (p - 1) * PANEL < n <= p * PANEL:
        raise ValueError(f"n={n} is not the width of {p} panels of {PANEL}")
    build.require()


def w8a8_panel_matmul(x, panels, comp, scales, n: int, layer=None):
    """``x [..., K] @ w [K, n]`` with ``w`` int8 in quad panels (``pack_quads``: ``panels [P, Kp / 4,
    32, 4]``, ``comp [P, Kp / 32, 32]``, ``scales [P, G, 32]``) and each row of x rounded to int8
    per block of 32 (``w8a8_reference``): ``[..., n]`` float32. ``layer`` as in ``panel_matmul``."""
    rows = x.reshape(-1, x.shape[-1])
    if layer is not None:
        rows, panels, sizes, comp, scales = _rows_in_layer(x, panels, layer, comp, scales)
    else:
        panels, comp, scales = panels[None], comp[None], scales[None]
        sizes = jnp.full((1,), rows.shape[0], jnp.int32)
    return grouped_w8a8_matmul(rows, panels, comp, scales, sizes, n).reshape(*x.shape[:-1], n)


def grouped_w8a8_matmul(x, panels, comp, scales, sizes, n: int, layer=None):
    """``grouped_matmul`` with int8 experts in quad panels (``panels [E, P, Kp / 4, 32, 4]``, ``comp
    [E, P, Kp / 32, 32]``, ``scales [E, P, G, 32]``), multiplied as in ``w8a8_panel_matmul``
    (``layer`` as in ``grouped_matmul``)."""
    if layer is not None:
        panels, sizes, comp, scales = in_layer(panels, sizes, layer, comp, scales)
    if x.ndim != 2 or panels.ndim != 5 or comp.ndim != 4 or scales.ndim != 4:
        raise ValueError(f"x {x.shape}, quad panels {panels.shape}, comp {comp.shape} and scales {scales.shape} "
                         f"must be [R, K], [E, P, Kp / 4, {PANEL}, 4], [E, P, Kp / 32, {PANEL}] and [E, P, G, {PANEL}]")
    if sizes.shape != (panels.shape[0],):
        raise ValueError(f"sizes {sizes.shape} must have one entry per expert ({panels.shape[0]})")
    _check_w8a8("grouped_w8a8_matmul", x, panels, comp, scales, n)
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(build.W8A8_GROUPED, out)(x, panels, comp, scales, sizes.astype(jnp.int32))


MAX_HEAD, MAX_GROUP = 128, 16  # attention.cc's kMaxHeadDim, kMaxHeadsPerKv


def decode_attention_fits(num_q_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Whether ``decode_attention`` takes these heads (its accumulators are of a fixed size)."""
    return head_size <= MAX_HEAD and num_q_heads // num_kv_heads <= MAX_GROUP


def _temperature(temperature_B, b: int):
    """Each row's factor on its capped logits (Grok-2's attention temperature): ``[B]`` float32, 1s by default."""
    if temperature_B is None:
        return jnp.ones((b,), jnp.float32)
    if temperature_B.shape != (b,):
        raise ValueError(f"decode attention: temperature must be [{b}], got {temperature_B.shape}")
    return temperature_B.astype(jnp.float32)


def _stack(cache, layer):
    """A cache as every layer's ``[L, B, K, S_max, H]`` (one layer's ``[B, K, S_max, H]`` as a stack
    of one, ``layer`` None) and the layer to read as an int32 scalar: the kernels read that layer
    in place, where XLA:CPU would copy a slice of the stack out for them first."""
    if layer is None:
        return jax.tree_util.tree_map(lambda a: a[None], cache), jnp.zeros((), jnp.int32)
    return cache, jnp.asarray(layer, jnp.int32)


def _check_heads(n: int, kv_heads: int, h: int) -> None:
    if not decode_attention_fits(n, kv_heads, h):
        raise ValueError(f"decode_attention takes head sizes up to {MAX_HEAD} and at most {MAX_GROUP} query "
                         f"heads a KV head, got H={h}, {n // kv_heads}")


def decode_attention(q_BNH, k, v, mask_BS, scale: float, cap: float, temperature_B=None, layer=None):
    """One decode step of grouped-query attention read in place from float32 or bf16 caches.

    ``q [B, N, H]`` (rotated), caches ``k, v [B, K, S_max, H]``, or with ``layer`` (an int or a
    traced scalar) every layer's ``[L, B, K, S_max, H]`` of which that layer is read, and ``mask
    [B, S]`` (S <= S_max: only the first S positions are read). Query head n uses KV head
    ``n // (N / K)``; logits are ``t * cap * tanh(scale * q.k / cap)`` (``t``: the row's
    ``temperature_B``, default 1), softmaxed over the allowed keys; a row with none allowed gets
    zeros. ``[B, N, H]`` float32. A bf16 cache is widened in registers, exactly.
    (attention.cc: XLA:CPU would copy the S positions out of each cache first.)"""
    b, n, h = q_BNH.shape
    if q_BNH.dtype != jnp.float32 or k.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != k.dtype:
        raise ValueError(f"decode_attention takes float32 queries and float32 or bf16 caches, got q {q_BNH.dtype}, "
                         f"k {k.dtype}, v {v.dtype}")
    k, layer_ = _stack(k, layer)
    v, _ = _stack(v, layer)
    if (k.ndim != 5 or v.shape != k.shape or k.shape[1] != b or k.shape[4] != h or mask_BS.shape[0] != b
            or mask_BS.ndim != 2 or mask_BS.shape[1] > k.shape[3] or n % k.shape[2]):
        raise ValueError(f"decode_attention: q {q_BNH.shape}, k {k.shape}, v {v.shape} and mask {mask_BS.shape} "
                         "do not match ([B, N, H], [L, B, K, S_max, H] with a layer or [B, K, S_max, H], "
                         "[B, S <= S_max])")
    _check_heads(n, k.shape[2], h)
    build.require()
    target = build.ATTENTION if k.dtype == jnp.float32 else build.ATTENTION_BF16
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_BNH.shape, jnp.float32))
    return call(q_BNH, k, v, mask_BS.astype(jnp.bool_), _temperature(temperature_B, b), layer_,
                scale=np.float32(scale), cap=np.float32(cap))


def decode_attention_int8(q_BNH, k, v, mask_BS, scale: float, cap: float, temperature_B=None, layer=None):
    """``decode_attention`` over an int8 cache read in place: ``k`` and ``v`` are int8 records
    (``model.memory.QuantizedKV``: ``values [B, K, S_max, H]`` int8, ``scales [B, K, S_max, 1]``
    float32; or every layer's, ``[L, ...]``, with ``layer``). Each key's scale multiplies its logit
    after the dot, each value's its softmax weight, so the int8 rows are converted in registers
    only: a quarter of float32's bytes read."""
    b, n, h = q_BNH.shape
    if (q_BNH.dtype != jnp.float32 or k.values.dtype != jnp.int8 or v.values.dtype != jnp.int8
            or k.scales.dtype != jnp.float32 or v.scales.dtype != jnp.float32):
        raise ValueError(f"decode_attention_int8 takes float32 queries and int8 values with float32 scales, got q "
                         f"{q_BNH.dtype}, k {k.values.dtype}/{k.scales.dtype}, v {v.values.dtype}/{v.scales.dtype}")
    k, layer_ = _stack(k, layer)
    v, _ = _stack(v, layer)
    shape = k.values.shape
    if (len(shape) != 5 or v.values.shape != shape or shape[1] != b or shape[4] != h or mask_BS.ndim != 2
            or mask_BS.shape[0] != b or mask_BS.shape[1] > shape[3] or n % shape[2]
            or k.scales.shape != (*shape[:4], 1) or v.scales.shape != k.scales.shape):
        raise ValueError(f"decode_attention_int8: q {q_BNH.shape}, k {shape} (scales {k.scales.shape}), v "
                         f"{v.values.shape} (scales {v.scales.shape}) and mask {mask_BS.shape} do not match "
                         "([B, N, H], [L, B, K, S_max, H] with [L, B, K, S_max, 1] and a layer, or the same "
                         "without L, [B, S <= S_max])")
    _check_heads(n, shape[2], h)
    build.require()
    call = jax.ffi.ffi_call(build.ATTENTION_INT8, jax.ShapeDtypeStruct(q_BNH.shape, jnp.float32))
    return call(q_BNH, k.values, k.scales, v.values, v.scales, mask_BS.astype(jnp.bool_),
                _temperature(temperature_B, b), layer_, scale=np.float32(scale), cap=np.float32(cap))


def kv_write(stack, layer, rows_BT, positions_BT, new_BTKH):
    """``stack [L, B, K, S, H]`` (any dtype) with ``new [B', T, K, H]`` (its dtype) written into
    layer ``layer`` (an int or a traced scalar) at ``(rows[b, t], positions[b, t])``; a row or
    position out of range is dropped, as ``model.memory.write_kv`` drops it. The result aliases
    the stack: with the stack donated, XLA writes it in place (attention.cc ``KvWrite``), where
    XLA:CPU's scatter into a bf16 stack copies the whole stack, every layer."""
    b, t = rows_BT.shape
    if (stack.ndim != 5 or new_BTKH.shape != (b, t, stack.shape[2], stack.shape[4]) or positions_BT.shape != (b, t)
            or new_BTKH.dtype != stack.dtype):
        raise ValueError(f"kv_write: stack {stack.shape} {stack.dtype}, update {new_BTKH.shape} {new_BTKH.dtype}, "
                         f"rows {rows_BT.shape} and positions {positions_BT.shape} do not match ([L, B, K, S, H], "
                         "[B', T, K, H] of the stack's dtype, [B', T])")
    build.require()
    call = jax.ffi.ffi_call(build.KV_WRITE, jax.ShapeDtypeStruct(stack.shape, stack.dtype),
                            input_output_aliases={0: 0})
    return call(stack, new_BTKH, rows_BT.astype(jnp.int32), positions_BT.astype(jnp.int32),
                jnp.asarray(layer, jnp.int32))


def kv_read(stack, layer, rows_G, start, size: int):
    """Positions ``[start, start + size)`` of cache rows ``rows_G [G]`` of layer ``layer`` of
    ``stack [L, B, K, S, H]`` (any dtype), read in place (attention.cc ``KvRead``): ``[G, K, size,
    H]``, what ``jnp.take(dynamic_slice(stack[layer], start, size, axis=2), rows, axis=0)`` gives
    for rows in range (indices are clamped as ``dynamic_slice`` clamps them). XLA:CPU slices a
    bf16 stack only through a copy of the whole stack, once a layer of a prefill."""
    if stack.ndim != 5 or rows_G.ndim != 1 or not 1 <= size <= stack.shape[3]:
        raise ValueError(f"kv_read: stack {stack.shape}, rows {rows_G.shape} and size {size} do not match "
                         "([L, B, K, S, H], [G], 1 <= size <= S)")
    build.require()
    out = jax.ShapeDtypeStruct((rows_G.shape[0], stack.shape[2], size, stack.shape[4]), stack.dtype)
    return jax.ffi.ffi_call(build.KV_READ, out)(stack, rows_G.astype(jnp.int32), jnp.asarray(start, jnp.int32),
                                                jnp.asarray(layer, jnp.int32))


def kv_copy_blocks(dst, src, dst_row_M, dst_pos_M, src_row_M, src_pos_M, size: int):
    """``dst [L, R, K, S, H]`` with, for each pair i, positions ``[dst_pos[i], + size)`` of row
    ``dst_row[i]`` replaced by positions ``[src_pos[i], + size)`` of row ``src_row[i]`` of ``src
    [L, R', K, S', H]`` (its dtype), in every layer; a pair out of range (a row -1) is skipped. The
    result aliases ``dst``: donated, it is written in place (attention.cc ``KvCopyBlocks``), where
    XLA:CPU's update of a bf16 pool widens the whole pool, every call."""
    m = dst_row_M.shape
    if (dst.ndim != 5 or src.ndim != 5 or src.dtype != dst.dtype or len(m) != 1 or size < 1
            or (src.shape[0], src.shape[2], src.shape[4]) != (dst.shape[0], dst.shape[2], dst.shape[4])
            or any(a.shape != m for a in (dst_pos_M, src_row_M, src_pos_M))):
        raise ValueError(f"kv_copy_blocks: dst {dst.shape} {dst.dtype}, src {src.shape} {src.dtype}, index vectors "
                         f"{[a.shape for a in (dst_row_M, dst_pos_M, src_row_M, src_pos_M)]} and size {size} do not "
                         "match ([L, R, K, S, H] and [L, R', K, S', H] of one dtype, four [M], size >= 1)")
    build.require()
    call = jax.ffi.ffi_call(build.KV_COPY_BLOCKS, jax.ShapeDtypeStruct(dst.shape, dst.dtype),
                            input_output_aliases={0: 0})
    return call(dst, src, *(a.astype(jnp.int32) for a in (dst_row_M, dst_pos_M, src_row_M, src_pos_M)),
                size=np.int64(size))


def filter_threshold(scaled_BV, top_k_B, nucleus_p_B):
    """Per row of tempered logits ``scaled [B, V]``, the smallest logit that top-k (``top_k [B]``,
    0 = off) then top-p (``nucleus_p [B]``, >= 1 = off) sampling keeps: the rule of
    ``runner.sampling.filter_logits``, which keeps the logits >= it, found by a radix select
    instead of a sort (``sampling.cc``). ``[B]`` float32; -inf where nothing is cut. NaN logits
    are never kept."""
    if scaled_BV.ndim != 2 or top_k_B.shape != scaled_BV.shape[:1] or nucleus_p_B.shape != scaled_BV.shape[:1]:
        raise ValueError(f"filter_threshold: scaled {scaled_BV.shape}, top_k {top_k_B.shape} and nucleus_p "
                         f"{nucleus_p_B.shape} do not match ([B, V], [B], [B])")
    build.require()
    call = jax.ffi.ffi_call(build.FILTER, jax.ShapeDtypeStruct(scaled_BV.shape[:1], jnp.float32))
    return call(scaled_BV.astype(jnp.float32), top_k_B.astype(jnp.int32), nucleus_p_B.astype(jnp.float32))


def logits_summary(logits_BV, top: int):
    """Per row of ``logits [B, V]``: the ``top`` largest (values ``[B, top]`` float32 and ids
    ``[B, top]`` int32, descending, ties by lower id: ``jax.lax.top_k``'s) and the log-sum-exp
    ``[B]`` (``jax.nn.logsumexp``'s), in one pass of ``sampling.cc``. Id 0 of a row is its first
    largest logit, ``jnp.argmax``'s. NaN ranks as -inf; a NaN makes the row's lse NaN."""
    if logits_BV.ndim != 2 or not 1 <= top <= logits_BV.shape[1]:
        raise ValueError(f"logits_summary takes logits [B, V] and 1 <= top <= V, got {logits_BV.shape} and {top}")
    build.require()
    b = logits_BV.shape[0]
    call = jax.ffi.ffi_call(build.SUMMARY, (jax.ShapeDtypeStruct((b, top), jnp.float32),
                                       jax.ShapeDtypeStruct((b, top), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32)))
    return call(logits_BV.astype(jnp.float32))


class _Panels:
    """What a weight held in column panels says of itself: the shape and dtype of the weight."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.panels.shape[:-3], self.panels.shape[-2], self.width)

    @property
    def dtype(self):
        return self.panels.dtype


class _RowGroupPanels:
    """What a weight held in panels of row groups (``[..., P, K / g, 32, g]``: bf16 pairs, int8
    quads) says of its shape, which its panels no longer show: ``depth`` K and ``width`` N."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.panels.shape[:-4], self.depth, self.width)


@flax.struct.dataclass
class PanelWeight(_Panels):
    """A float32 weight ``[..., K, N]`` held as column panels ``[..., ceil(N / 32), K, 32]``: a
    plain weight (``[K, N]``, for ``panel_matmul``) or stacked experts (``[E, K, N]``, for
    ``grouped_matmul``, which reads each expert in place)."""

    panels: jax.Array
    width: int = flax.struct.field(pytree_node=False)

    @classmethod
    def of(cls, w) -> PanelWeight:
        return cls(jax.device_put(pack(w)), width=w.shape[-1])

    def __matmul__(self, x):
        raise TypeError("use panel_matmul(x, w.panels, w.width): x @ PanelWeight is not defined")


@flax.struct.dataclass
class Int8PanelWeight(_Panels):
    """An int8 weight (``model.quant.QuantizedWeight8bit``, ``[..., K, N]`` with scales
    ``[..., G, N]``) held as int8 column panels ``[..., ceil(N / 32), K, 32]`` and float32 scales
    ``[..., ceil(N / 32), G, 32]``: a plain weight for ``int8_panel_matmul``, stacked experts for
    ``grouped_int8_matmul``. No float copy of the weight is ever made."""

    panels: jax.Array
    scales: jax.Array
    width: int = flax.struct.field(pytree_node=False)

    @classmethod
    def of(cls, w) -> "Int8PanelWeight":
        """From a ``QuantizedWeight8bit``."""
        return cls(jax.device_put(pack(w.weight, np.int8)), jax.device_put(pack(w.scales, np.float32)),
                   width=w.weight.shape[-1])

    def __matmul__(self, x):
        raise TypeError("use int8_panel_matmul(x, w.panels, w.scales, w.width): x @ Int8PanelWeight is not defined")


@flax.struct.dataclass
class W8A8PanelWeight(_RowGroupPanels):
    """An int8 weight (``model.quant.QuantizedWeight8bit``) held for the w8a8 kernels
    (``pack_quads``): quad panels, their compensation and scale panels. A plain weight for
    ``w8a8_panel_matmul``, stacked experts for ``grouped_w8a8_matmul``."""

    panels: jax.Array
    comp: jax.Array
    scales: jax.Array
    depth: int = flax.struct.field(pytree_node=False)  # K
    width: int = flax.struct.field(pytree_node=False)  # N

    @property
    def dtype(self):
        return jnp.dtype(jnp.int8)

    @classmethod
    def of(cls, w) -> "W8A8PanelWeight":
        """From a ``QuantizedWeight8bit`` whose groups fit (``w8a8_fits``; ``ValueError`` otherwise)."""
        k, groups = w.weight.shape[-2], w.scales.shape[-2]
        if not w8a8_fits(k, groups):
            raise ValueError(f"W8A8PanelWeight: {groups} scale groups of K={k} are not whole blocks of {W8A8_BLOCK}")
        panels, comp, scales = pack_quads(w.weight, w.scales)
        return cls(jax.device_put(panels), jax.device_put(comp), jax.device_put(scales), depth=w.weight.shape[-2],
                   width=w.weight.shape[-1])

    def __matmul__(self, x):
        raise TypeError("use w8a8_panel_matmul(x, w.panels, w.comp, w.scales, w.width): x @ W8A8PanelWeight is not "
                        "defined")


@flax.struct.dataclass
class Bf16PanelWeight(_RowGroupPanels):
    """A bf16 weight ``[..., K, N]`` held as bf16 panels of row pairs ``[..., ceil(N / 32),
    ceil(K / 2), 32, 2]`` (``pack_pairs``, the bits as uint16): a plain weight for
    ``bf16_panel_matmul``, stacked experts for ``grouped_bf16_matmul``."""

    panels: jax.Array
    depth: int = flax.struct.field(pytree_node=False)  # K
    width: int = flax.struct.field(pytree_node=False)  # N

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)  # held as its bits

    @classmethod
    def of(cls, w) -> "Bf16PanelWeight":
        return cls(jax.device_put(pack_pairs(w)), depth=w.shape[-2], width=w.shape[-1])

    def __matmul__(self, x):
        raise TypeError("use bf16_panel_matmul(x, w.panels, w.width): x @ Bf16PanelWeight is not defined")


@flax.struct.dataclass
class PanelTable:
    """The tied embedding ``[V, D]`` held as the panels of its transpose, ``[ceil(V / 32), D, 32]``:
    the unembedding ``h @ table.T`` runs on the kernel, and a lookup of row v reads
    ``panels[v // 32, :, v % 32]``, so the table is not held twice."""

    panels: jax.Array
    vocab_size: int = flax.struct.field(pytree_node=False)
    emb_size: int = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.vocab_size, self.emb_size)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32 if self.panels.dtype == jnp.float32 else jnp.bfloat16)

    @classmethod
    def of(cls, table) -> PanelTable:
        """From a float32 table (float32 panels) or a bf16 one (bf16 panels of row pairs)."""
        t = np.asarray(table).T
        panels = pack(t) if table.dtype == jnp.float32 else pack_pairs(t)
        return cls(jax.device_put(panels), vocab_size=table.shape[0], emb_size=table.shape[1])

    def lookup(self, tokens):
        """Rows ``tokens`` of the table: ``[..., D]``."""
        if self.panels.ndim == 3:
            return self.panels[tokens // PANEL, :, tokens % PANEL]
        # gathered as bits (uint16): XLA:CPU widens a bf16 gather to float32 over the whole table
        # first (19 ms of a 34 ms bf16 decode call of the bench config here)
        pairs = jax.lax.bitcast_convert_type(self.panels[tokens // PANEL, :, tokens % PANEL, :], jnp.bfloat16)
        return pairs.reshape(*pairs.shape[:-2], -1)[..., : self.emb_size]

    def unembed(self, h):
        """``h [..., D] @ table.T``: ``[..., V]`` in float32."""
        if self.panels.ndim == 3:
            return panel_matmul(h.astype(jnp.float32), self.panels, self.vocab_size)
        return bf16_panel_matmul(h.astype(jnp.float32), self.panels, self.vocab_size)
