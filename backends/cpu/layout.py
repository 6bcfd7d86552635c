"""The CPU backend's own layouts of the canonical parameters (``prepare``).

- **Experts split**: a stacked MoE weight ``[E, K, N]`` becomes an ``ExpertWeights`` of E separate
  buffers, so that the MoE reads one expert in place. XLA:CPU materialises a slice ``w[e]`` of a
  stacked weight as a copy before the dot (a read and a write of the whole expert on every step,
  measured: BENCHMARKS.md). Float down projections are held transposed (``[D, F]``, contracted on
  both minor dimensions): XLA:CPU's matrix-vector product reads that layout about 1.7x faster.
- **Panels**: where the calibration took a kernel, its float32 weights are packed in column
  panels (``ops.PanelWeight``; the tied embedding as ``ops.PanelTable``): the experts for the
  grouped panel kernel, the attention projections and the embedding for the panel matmul. With
  bf16 activations they are held in bf16 panels of row pairs (``ops.Bf16PanelWeight``). Int8
  weights (``QuantizedWeight8bit``) are packed as int8 panels with float32 scales
  (``ops.Int8PanelWeight``), which the int8 kernels read as they are: no float copy is made; in
  the w8a8 mode, as panels of row quads (``ops.W8A8PanelWeight``) for the int8 x int8 kernels.
- **Dequantised**: an int8 weight no kernel takes is converted to the activations' dtype here, once (XLA:CPU
  multiplies by an int8 weight 20-40x slower than by a float one: BENCHMARKS.md, "Low precision on CPU").

Only the backend reads these types; checkpoints, the sharding rules and the model's tests see the
canonical pytree.
"""

from __future__ import annotations

import concurrent.futures
import os
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu.ops import Bf16PanelWeight, Int8PanelWeight, PanelTable, PanelWeight, W8A8PanelWeight, w8a8_fits
from model.quant import QuantizedWeight8bit, dequantize, is_quantized
from model.sharding import path_str
from model.transformer import has_stacked_layers, layers_apart, layers_together

MOE_WEIGHT = re.compile(r"(.*/)?moe/(linear|linear_v|linear_1)/w")
EMBEDDING = "language_model/in_out_embed/embeddings"
PROJECTION = re.compile(r"(.*/)?multi_head_attention/(query|key|value|linear)/w")
DENSE = re.compile(r"(.*/)?mlp/(linear|linear_v|linear_1)/w")  # Grok-2's shared MLP
STACK = "transformer/layers/"  # where the stacked layers' parameters are
TRANSPOSED = ("linear_1",)  # down projections, [F, D] per expert, held as [D, F]


@flax.struct.dataclass
class ExpertWeights:
    """One MoE weight ``[E, K, N]`` as E separate arrays: ``[K, N]`` each, or ``[N, K]`` each when
    ``transposed`` (float weights only; a ``QuantizedWeight8bit`` expert keeps its layout)."""

    experts: tuple
    transposed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        one = tuple(self.experts[0].shape)
        return (len(self.experts), *(one[::-1] if self.transposed else one))

    def matmul(self, x, e: int, dtype):
        """``x [..., K] @ W_e [K, N]`` in ``dtype``."""
        w = self.experts[e]
        if self.transposed:
            return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())))
        return x.astype(dtype) @ dequantize(w, dtype)


PANELS = (PanelWeight, Bf16PanelWeight, Int8PanelWeight, W8A8PanelWeight)  # the weight kernels' layouts


@flax.struct.dataclass
class InLayer:
    """Layer ``layer`` (a traced index) of a weight held in panels for every layer (``PANELS``,
    stacked ``[L, ...]``): what the ``"indexed"`` stack hands a layer in place of a slice, so that
    the kernel reads that layer of the stack in place (``ops.in_layer``)."""

    stack: object
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype


@flax.struct.dataclass
class Widened:
    """A bf16 weight that XLA's dot multiplies by, held widened to float32 (its bf16 values
    exactly): XLA:CPU computes a bf16 dot as a float32 one on widened operands, and inside the
    ``"indexed"`` loop it widens the whole stack of a layer weight on every call and then copies
    the layer's slice out (a bf16 decode step of the bench config 30% slower than unrolled; held
    widened, the slice is all it copies). ``CPU.matmul`` multiplies as XLA would: x rounded to
    bf16, a float32 dot, the result rounded to bf16."""

    w: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)


HELD = (ExpertWeights, *PANELS, PanelTable, InLayer, Widened)  # already in a CPU layout
LAYOUTS = (*HELD, QuantizedWeight8bit)


def split(w, transpose: bool) -> ExpertWeights:
    """A stacked ``[E, K, N]`` weight (float or int8) as an ``ExpertWeights`` (new buffers)."""
    transpose = transpose and not is_quantized(w)
    experts = tuple(jax.tree_util.tree_map(lambda a, e=e: a[e].T if transpose else a[e], w)
                    for e in range(w.shape[0]))
    return ExpertWeights(experts, transposed=transpose)


def prepare(params, panels: frozenset, int8: frozenset = frozenset(), dtype="float32", layers: str = "unrolled",
            w8a8: frozenset = frozenset()):
    """``params`` in the CPU layouts for activations of ``dtype`` (float32 or bfloat16): every MoE
    weight in panels with ``"moe"`` in ``panels``, else split per expert; the attention projections
    in panels with ``"projections"``; the embedding with ``"unembed"``. Float weights of these are
    held in ``dtype`` (float32 panels, or bf16 panels of row pairs), as the model multiplies by
    them. An int8 weight stays int8 (``Int8PanelWeight``) where its operation is in ``int8`` (in
    quad panels for the int8 x int8 kernels, ``W8A8PanelWeight``, where it is in ``w8a8`` too and
    its scale groups fit), and is dequantised to ``dtype`` first everywhere else. Other leaves are unchanged. With
    ``layers="indexed"`` (which ``CPU`` takes only with the MoE kernel, whose panels it reads the
    experts from) the stacked layers are laid out as they are (every layer's panels in one
    array, ``[L, ...]``, which the kernels read a layer of in place); otherwise each layer is laid
    out apart and, with ``"scan"``, stacked again (a leading axis on every leaf, which the scan
    slices), with ``"unrolled"`` held apart (``model.transformer.layers_apart``)."""
    dtype = jnp.dtype(dtype)
    stacked = has_stacked_layers(params)
    apart = stacked and layers != "indexed"
    widen = layers == "indexed" and stacked and dtype == jnp.bfloat16  # bf16 layer weights on XLA's dot: ``Widened``
    if apart:  # on the host: views of the stacked arrays
        params = layers_apart(params, take=lambda a, i: np.asarray(a)[i])

    def one(path, w):
        if isinstance(w, HELD):
            return w
        name = path_str(path)
        op = "moe" if MOE_WEIGHT.fullmatch(name) else "projections" if PROJECTION.fullmatch(name) else None
        if op is None and name != EMBEDDING and not is_quantized(w) and not (widen and DENSE.fullmatch(name)):
            return w
        # On the host (one CPU device: a view, no copy), in numpy: jax's eager operations would
        # compile a program apiece at every start.
        held, w = w, jax.tree_util.tree_map(np.asarray, w)
        if is_quantized(w):
            if op in int8 and op in panels:
                if op in w8a8 and w8a8_fits(w.weight.shape[-2], w.scales.shape[-2]):
                    return W8A8PanelWeight.of(w)
                return Int8PanelWeight.of(w)
            w = dequantize(w, dtype)
        else:
            w = w.astype(dtype, copy=False)  # a view where it is in dtype already
        kind = PanelWeight if dtype == jnp.float32 else Bf16PanelWeight
        if op == "moe":
            if "moe" in panels:
                return kind.of(w)
            return jax.device_put(split(w, name.split("/")[-2] in TRANSPOSED))
        if name == EMBEDDING and "unembed" in panels:
            return PanelTable.of(w)
        if op == "projections" and "projections" in panels and w.ndim == (3 if name.startswith(STACK) else 2):
            return kind.of(w)
        if widen and (op == "projections" or DENSE.fullmatch(name)):
            return Widened(jax.device_put(w.astype(np.float32)))  # w is in bf16 already
        return held if not is_quantized(held) and held.dtype == dtype else jax.device_put(w)

    # The weights are laid out side by side on the host's cores: most of the time is the OS
    # handing over fresh pages, which threads take in parallel (the bench config's 1.1 GB: 5.0 s
    # in turn, 2.5 s on 2 cores of an EPYC; BENCHMARKS.md, "Start-up").
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, LAYOUTS))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        laid_out = list(pool.map(lambda leaf: one(*leaf), leaves))
    params = jax.tree_util.tree_unflatten(treedef, laid_out)
    if layers == "scan" and apart:
        params = layers_together(params, stack=lambda parts: np.stack([np.asarray(p) for p in parts]))
    return jax.tree_util.tree_map(lambda a: jax.device_put(a) if isinstance(a, np.ndarray) else a, params)


def weight_dtypes(params, pattern) -> set[str]:
    """The dtypes the weights of canonical ``params`` whose path matches ``pattern`` are held in
    ("int8" for ``QuantizedWeight8bit``)."""
    found = set()
    jax.tree_util.tree_map_with_path(
        lambda path, w: found.add("int8" if is_quantized(w) else str(w.dtype))
        if pattern.fullmatch(path_str(path)) else None,
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight8bit))
    return found


def moe_weight_dtypes(params) -> set[str]:
    """The dtypes the MoE weights of canonical ``params`` are held in ("int8" for ``QuantizedWeight8bit``)."""
    return weight_dtypes(params, MOE_WEIGHT)
