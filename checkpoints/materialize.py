"""Materialise checked tensor sources as parameters on a mesh: the step every checkpoint format
shares, after ``checkpoints.native`` or ``checkpoints.grok1_layout`` has opened its files.

``check_sources`` compares every tensor with the parameters the config declares (names, shapes,
dtypes) before any data is read; ``materialize`` builds each parameter with
``jax.make_array_from_callback`` on its target sharding from the rules in ``model/sharding.py``,
so each device reads only its own slice. Host memory stays near one device slice at a time
(plus, on CPU, the devices' own copies, which live in host memory).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh

from checkpoints.lazy import LazyQuantized, LazyTensor, dequantized_slice, stacked
from checkpoints.native import load_config, regular_file
from checkpoints.safe_pickle import CheckpointError
from model.config import PRESETS, ModelConfig
from model.host import adoptable, host_copy
from model.quant import QuantizedWeight8bit
from model.sharding import param_shardings, path_str
from model.tree import STACKED, layer_name, split_layer_name


def resolve_config(config) -> ModelConfig:
    """A ``ModelConfig`` from itself, a preset name or a JSON file."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str) and config in PRESETS:
        return PRESETS[config]
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        return load_config(os.fspath(config))
    raise CheckpointError(f"config {str(config)[:200]!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
                          "a JSON file nor a ModelConfig")


def config_differences(a: ModelConfig, b: ModelConfig) -> str:
    """Each field where two configs differ, with both values: ``name a != b``."""
    return ", ".join(f"{f.name} {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
                     for f in dataclasses.fields(ModelConfig) if getattr(a, f.name) != getattr(b, f.name))


def _is_float(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def declared_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Declared shape of every parameter path of ``config`` (the layers' stacked: ``[L, ...]``
    under ``transformer/layers``)."""
    from model.plan import abstract_params as shapes_of

    flat = jax.tree_util.tree_flatten_with_path(shapes_of(config))[0]
    return {path_str(path): tuple(leaf.shape) for path, leaf in flat}


def disk_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a checkpoint of ``config`` holds, by its on-disk name: each layer's
    apart (``transformer/decoder_layer_<i>/...``), as Grok-1's tree names them."""
    shapes = {}
    for name, shape in declared_shapes(config).items():
        if name.startswith(STACKED):
            shapes.update({layer_name(name, i): shape[1:] for i in range(shape[0])})
        else:
            shapes[name] = shape
    return shapes


def stack_layers(sources: dict) -> dict:
    """Checked on-disk sources (``check_sources``) with each layer's tensors joined into the
    model's stacked parameter (``[L, ...]``, read slice by slice like any source: a device's
    slice of every layer is read straight into one buffer, never a second copy of a layer)."""
    out, layers = {}, collections.defaultdict(dict)
    for name, source in sources.items():
        split = split_layer_name(name)
        if split is None:
            out[name] = source
        else:
            layers[split[0]][split[1]] = source
    for name, by_layer in layers.items():
        parts = [by_layer[i] for i in range(len(by_layer))]
        kinds = {isinstance(p, LazyQuantized) for p in parts}
        try:
            if kinds == {True}:
                out[name] = LazyQuantized(stacked([p.weight for p in parts], f"{parts[0].weight.source} ... (every layer)"),
                                          stacked([p.scales for p in parts], f"{parts[0].scales.source} ... (every layer)"))
            elif kinds == {False}:
                out[name] = stacked(parts, f"{parts[0].source} ... (every layer)")
            else:
                int8 = next(i for i, p in enumerate(parts) if isinstance(p, LazyQuantized) != isinstance(parts[0], LazyQuantized))
                raise ValueError(f"{layer_name(name, int8)} is {'int8' if isinstance(parts[int8], LazyQuantized) else 'float'}"
                                 f" and {layer_name(name, 0)} is not: the layers of one parameter are one stack")
        except ValueError as e:  # the layers' tensors differ in shape or dtype (each was checked alone)
            raise CheckpointError(f"{e} (every layer's {name[len(STACKED):]} must share its shape and dtype)") from None
    return out


def check_sources(sources: dict, config: ModelConfig) -> None:
    """Every parameter of ``config`` present under its on-disk name (``disk_shapes``) with its
    shape and a sensible dtype; nothing extra."""
    expected = disk_shapes(config)
    missing = sorted(set(expected) - set(sources))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s) {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    unexpected = sorted(set(sources) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint has unexpected tensor(s) {unexpected[:5]} "
                              f"{'...' if len(unexpected) > 5 else ''}(not parameters of this config)")
    for name, source in sources.items():
        shape = expected[name]
        if isinstance(source, LazyQuantized):
            w, s = source.weight, source.scales
            if w.shape != shape:
                raise CheckpointError(f"tensor {name} ({w.source}): shape mismatch, expected {shape}, "
                                      f"found {w.shape}")
            if np.dtype(w.dtype) != np.int8:
                raise CheckpointError(f"tensor {name} ({w.source}): dtype mismatch, expected int8 "
                                      f"weight, found {w.dtype}")
            groups = s.shape[-2] if len(s.shape) == len(shape) else 0
            if (len(s.shape) != len(shape) or s.shape[:-2] != shape[:-2] or s.shape[-1] != shape[-1]
                    or groups == 0 or shape[-2] % groups):
                raise CheckpointError(f"tensor {name} ({s.source}): scales shape {s.shape} does not fit "
                                      f"weight {shape} (expected [..., G, {shape[-1]}] with G dividing "
                                      f"{shape[-2]})")
            if not _is_float(s.dtype):
                raise CheckpointError(f"tensor {name} ({s.source}): dtype mismatch, expected float "
                                      f"scales, found {s.dtype}")
        else:
            if source.shape != shape:
                raise CheckpointError(f"tensor {name} ({source.source}): shape mismatch, expected "
                                      f"{shape}, found {source.shape}")
            if not _is_float(source.dtype):
                raise CheckpointError(f"tensor {name} ({source.source}): dtype mismatch, expected a "
                                      f"float dtype, found {source.dtype}")


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def _placeholder(source):
    """A ShapeDtypeStruct tree for a source, to derive its sharding."""
    if isinstance(source, LazyQuantized):
        return QuantizedWeight8bit(weight=jax.ShapeDtypeStruct(source.weight.shape, source.weight.dtype),
                                   scales=jax.ShapeDtypeStruct(source.scales.shape, source.scales.dtype))
    return jax.ShapeDtypeStruct(source.shape, source.dtype)


def materialize(sources: dict, config: ModelConfig, *, mesh: Mesh | None, dtype=None,
                dequantize: bool = False, rules: dict | None = None, to_host: bool = False,
                progress: bool | None = None, abstract: bool = False) -> dict:
    """Build the parameter tree from lazy sources (by their on-disk names), each device reading
    only its own slice; the layers' are stacked (``stack_layers``).

    ``dtype`` casts float parameters (and int8 scales); ``dequantize`` turns int8 weights into
    ``dtype`` (default float32) arrays at load. ``to_host`` returns numpy arrays instead;
    ``abstract`` the tree's ``jax.ShapeDtypeStruct``s, in the dtypes a restore gives, with nothing
    read (what a server's steps are compiled for ahead of its weights: ``runner.compiled``).
    """
    check_sources(sources, config)
    sources = stack_layers(sources)
    total = sum(s.nbytes for s in sources.values())
    bar = None
    if not abstract and (progress or (progress is None and total > (1 << 30))):
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="restore")
    float_dtype = None if dtype is None else np.dtype(dtype)
    deq_dtype = float_dtype or np.dtype(np.float32)

    placeholders = {}
    for name, source in sources.items():
        if dequantize and isinstance(source, LazyQuantized):
            placeholders[name] = jax.ShapeDtypeStruct(source.shape, deq_dtype)
        else:
            placeholders[name] = _placeholder(source)
    if mesh is not None:
        # flat names: "<path>" for arrays, "<path>/weight" and "<path>/scales" for int8 weights
        shardings = param_shardings(_nest(placeholders), mesh, rules)
        flat_shardings = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    else:
        single = None if to_host else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        flat_shardings = collections.defaultdict(lambda: single)

    def build(lazy: LazyTensor, sharding, out_dtype, reader=None):
        if abstract:
            return jax.ShapeDtypeStruct(lazy.shape, out_dtype or lazy.dtype)
        reader = reader or (lambda index: lazy.read(index))
        if sharding is None:
            whole = reader(tuple(slice(None) for _ in lazy.shape))
            return whole if out_dtype is None else whole.astype(out_dtype, copy=False)
        on_cpu = all(d.platform == "cpu" for d in sharding.device_set)

        def placed(a):  # what a device is given: on a CPU one, memory it takes over without a copy
            want = a.dtype if out_dtype is None else np.dtype(out_dtype)
            if a.dtype == want and (not on_cpu or adoptable(a)):
                return a
            return host_copy(a, want) if on_cpu else a.astype(want)

        return jax.make_array_from_callback(lazy.shape, sharding, lambda index: placed(reader(index)))

    def one(name, source):
        if isinstance(source, LazyQuantized) and dequantize:
            built = build(source.weight, flat_shardings[name], deq_dtype if abstract else None,
                          reader=lambda index, s=source: dequantized_slice(s, index, deq_dtype))
        elif isinstance(source, LazyQuantized):
            built = QuantizedWeight8bit(
                weight=build(source.weight, flat_shardings[name + "/weight"], None),
                scales=build(source.scales, flat_shardings[name + "/scales"], float_dtype))
        else:
            built = build(source, flat_shardings[name], float_dtype)
        if bar is not None:
            bar.update(source.nbytes)
        return built

    # Tensors are read side by side on the host's cores: most of a read is the OS handing over
    # fresh pages, which threads take in parallel (the reads release the GIL).
    workers = 1 if abstract else min(os.cpu_count() or 1, 8)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        out = dict(zip(sources, pool.map(one, sources.keys(), sources.values())))
    if bar is not None:
        bar.close()
    return _nest(out)


def check_tokenizer(tokenizer_path: str | None, config: ModelConfig) -> None:
    """A tokenizer whose vocabulary differs from the model's is an error (a classic bug)."""
    if tokenizer_path is None:
        return
    from tokenization import load_tokenizer

    regular_file(tokenizer_path, "tokenizer")
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{tokenizer_path}: not a tokenizer this runner reads ({e})") from None
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{tokenizer_path}: tokenizer vocabulary has {tokenizer.vocab_size} pieces but "
                              f"the config's vocab_size is {config.vocab_size}")
