"""Hugging Face layouts of the Grok family: a directory with the model's ``config.json`` in Hugging
Face's terms and safetensors files, recognised by that config (docs/checkpoints.md, "Hugging
Face directories").

Three tensor namings are read, each mapped onto the native parameter tree:

- ``sglang``: Grok-2 (``xai-org/grok-2``) and sglang's Grok-1: ``model.layers.N.self_attn.q_proj``,
  ``block_sparse_moe.gate``, ``block_sparse_moe.experts.E.w1|w3|w2`` (gate, up, down),
  ``mlp.gate_proj|up_proj|down_proj`` (Grok-2's shared MLP), ``pre_attn_norm`` .. ``post_moe_norm``,
  ``model.embed_tokens``, ``model.norm``, ``lm_head`` (sglang python/sglang/srt/models/grok.py,
  ``Grok1ForCausalLM.load_weights``; sglang-jax python/sgl_jax/srt/models/grok.py).
- ``hpcai``: ``hpcai-tech/grok-1``: ``model.layers.N.attn.q_proj``, ``moe_block.gate``,
  ``moe_block.experts.E.linear|linear_v|linear_1``, norms' parameter ``scale`` (its
  modeling_grok1.py; vLLM's grok1.py loader of it).
- ``keyfan``: ``keyfan/grok-1-hf``: Grok-1's own names under ``transformer.``:
  ``transformer.decoder_layer.N.multi_head_attention.query``, ``router``, ``moe.E.linear``,
  ``rms_norm`` .. ``rms_norm_3``, ``transformer.in_out_embed`` (its modeling_grok.py, as
  llama.cpp's GrokModel reads it).

Weights are safetensors files or, where a directory has none, PyTorch ``.bin`` state dicts (read
without unpickling: ``checkpoints.torch_zip``). Every matrix is stored PyTorch's way, ``[out, in]``,
and read transposed; experts are stored one
tensor each and read stacked ``[E, in, out]``. Grok-2's experts come split 8 ways for tensor
parallelism, ``pytorch_model-NNNNN-TP-00k.safetensors`` (gate and up along their output rows, down
along its input columns), everything else once in ``...-TP-common.safetensors``: the shards are
joined as they are read. Nothing is read whole: each device later reads its own slice of each
view (``checkpoints.lazy``), so a sharded restore never holds the model in host memory.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re

from checkpoints.lazy import LazyTensor, concatenated, stacked, transposed
from checkpoints.native import _lazy, read_header
from untrusted import HEADERS_BYTES, MAX_DIMENSION, CheckpointError, Spent, shown
from checkpoints.torch_zip import open_torch_zip
from model.config import ModelConfig, ffn_size

ARCHITECTURES = ("Grok1ForCausalLM", "Grok1ModelForCausalLM", "GrokForCausalLM")
MODEL_TYPES = ("grok-1", "grok", "git")  # hpcai-tech's, keyfan's, Grok-2's (sic)

# native leaf of a layer -> (tensor name under the layer, how it is stored)
_LAYER = {
    "sglang": {
        "multi_head_attention/query/w": ("self_attn.q_proj.weight", "linear"),
        "multi_head_attention/key/w": ("self_attn.k_proj.weight", "linear"),
        "multi_head_attention/value/w": ("self_attn.v_proj.weight", "linear"),
        "multi_head_attention/linear/w": ("self_attn.o_proj.weight", "linear"),
        "router/w": ("block_sparse_moe.gate.weight", "linear"),
        "moe/linear/w": ("block_sparse_moe.experts.{e}.w1.weight", "expert"),
        "moe/linear_v/w": ("block_sparse_moe.experts.{e}.w3.weight", "expert"),
        "moe/linear_1/w": ("block_sparse_moe.experts.{e}.w2.weight", "expert"),
        "mlp/linear/w": ("mlp.gate_proj.weight", "linear"),
        "mlp/linear_v/w": ("mlp.up_proj.weight", "linear"),
        "mlp/linear_1/w": ("mlp.down_proj.weight", "linear"),
        "rms_norm/scale": ("pre_attn_norm", "norm"),
        "rms_norm_1/scale": ("post_attn_norm", "norm"),
        "rms_norm_2/scale": ("pre_moe_norm", "norm"),
        "rms_norm_3/scale": ("post_moe_norm", "norm"),
    },
    "hpcai": {
        "multi_head_attention/query/w": ("attn.q_proj.weight", "linear"),
        "multi_head_attention/key/w": ("attn.k_proj.weight", "linear"),
        "multi_head_attention/value/w": ("attn.v_proj.weight", "linear"),
        "multi_head_attention/linear/w": ("attn.o_proj.weight", "linear"),
        "router/w": ("moe_block.gate.weight", "linear"),
        "moe/linear/w": ("moe_block.experts.{e}.linear.weight", "expert"),
        "moe/linear_v/w": ("moe_block.experts.{e}.linear_v.weight", "expert"),
        "moe/linear_1/w": ("moe_block.experts.{e}.linear_1.weight", "expert"),
        "rms_norm/scale": ("pre_attn_norm", "norm"),
        "rms_norm_1/scale": ("post_attn_norm", "norm"),
        "rms_norm_2/scale": ("pre_moe_norm", "norm"),
        "rms_norm_3/scale": ("post_moe_norm", "norm"),
    },
    "keyfan": {
        "multi_head_attention/query/w": ("multi_head_attention.query.weight", "linear"),
        "multi_head_attention/key/w": ("multi_head_attention.key.weight", "linear"),
        "multi_head_attention/value/w": ("multi_head_attention.value.weight", "linear"),
        "multi_head_attention/linear/w": ("multi_head_attention.linear.weight", "linear"),
        "router/w": ("router.weight", "linear"),
        "moe/linear/w": ("moe.{e}.linear.weight", "expert"),
        "moe/linear_v/w": ("moe.{e}.linear_v.weight", "expert"),
        "moe/linear_1/w": ("moe.{e}.linear_1.weight", "expert"),
        "rms_norm/scale": ("rms_norm", "norm"),
        "rms_norm_1/scale": ("rms_norm_1", "norm"),
        "rms_norm_2/scale": ("rms_norm_2", "norm"),
        "rms_norm_3/scale": ("rms_norm_3", "norm"),
    },
}
_LAYER_PREFIX = {"sglang": "model.layers.{i}.", "hpcai": "model.layers.{i}.", "keyfan": "transformer.decoder_layer.{i}."}
_GLOBAL = {
    "sglang": {"language_model/in_out_embed/embeddings": ("model.embed_tokens.weight", "table"),
               "language_model/rms_norm/scale": ("model.norm", "norm"),
               "language_model/lm_head/embeddings": ("lm_head.weight", "table")},
    "keyfan": {"language_model/in_out_embed/embeddings": ("transformer.in_out_embed.weight", "table"),
               "language_model/rms_norm/scale": ("transformer.rms_norm", "norm"),
               "language_model/lm_head/embeddings": ("lm_head.weight", "table")},
}
_GLOBAL["hpcai"] = _GLOBAL["sglang"]
# A tensor split for tensor parallelism joins along this axis of its stored [out, in] layout:
# gate and up by output rows, down by input columns (sglang-jax's grok_concat_axis_map).
_TP_AXIS = {"w1": 0, "w3": 0, "linear": 0, "linear_v": 0, "w2": 1, "linear_1": 1}
_TP_FILE = re.compile(r".*-TP-(\d+|common)\.safetensors$")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer some exports keep: derived, not a weight


def is_hf_config(data) -> bool:
    """A Hugging Face config of a Grok model (not this project's native config.json)."""
    if not isinstance(data, dict) or "format" in data:
        return False
    architectures = data.get("architectures")
    named = isinstance(architectures, list) and any(a in ARCHITECTURES for a in architectures if isinstance(a, str))
    return named or data.get("model_type") in MODEL_TYPES


def _number(data: dict, key: str, source: str, default=None, kind=(int, float)):
    value = data.get(key)
    value = default if value is None else value
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise CheckpointError(f"{source}: {key} must be a {'integer' if kind is int else 'number'}, "
                              f"got {str(value)[:40]!r}")
    return value


def config_from_hf(data: dict, source: str, dtype: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` a Hugging Face Grok config describes. Each key read is the one sglang's
    Grok reads, with its default (docs/checkpoints.md has the table); a feature this runner does
    not implement (sliding windows, rotating half the head, another RoPE type) is an error
    naming the key, never ignored."""
    def integer(key, default=None):
        return _number(data, key, source, default, int)

    def dimension(key, default=None):  # a size: checked before any arithmetic uses it
        value = integer(key, default)
        if not 1 <= value <= MAX_DIMENSION:
            raise CheckpointError(f"{source}: {key} must be an integer from 1 to {MAX_DIMENSION:,}, "
                                  f"got {shown(value, 40)}")
        return value

    def number(key, default=None):
        return float(_number(data, key, source, default))

    for key, off in (("sliding_window_size", (-1, None, 0)), ("global_attn_every_n", (1, None)),
                     ("rope_rotate_half_dims", (False, None)), ("extrapolation_factor", (1, 1.0, None))):
        if data.get(key) not in off:
            raise CheckpointError(f"{source}: {key} {json.dumps(data.get(key))[:40]} is not supported "
                                  f"(this runner implements {off[0]!r})")
    if data.get("attn_logit_softcapping_method", "tanh") != "tanh":
        raise CheckpointError(f"{source}: attn_logit_softcapping_method must be 'tanh'")
    emb, heads = dimension("hidden_size"), dimension("num_attention_heads")
    key_size = dimension("head_dim", emb // heads if emb >= heads else None)
    residual_moe = data.get("residual_moe", False)
    if not isinstance(residual_moe, bool):
        raise CheckpointError(f"{source}: residual_moe must be true or false")
    expert = dimension("moe_intermediate_size" if "moe_intermediate_size" in data else "intermediate_size")
    shared = dimension("intermediate_size") if residual_moe else 0
    # Grok-1's rule (ffn_size) where a widening factor gives the size exactly, a whole one first
    widening = next((float(w) for w in (*range(1, 65), expert * 3 / 2 / emb if emb else 0)
                     if w and ffn_size(emb, w) == expert), None)
    explicit = 0 if widening else expert
    widening = widening or 8.0
    experts = dimension("num_local_experts") if "num_local_experts" in data else dimension("num_experts")
    rope_type = data.get("rope_type", "original")
    if rope_type not in ("original", "yarn", "yarn_log"):
        raise CheckpointError(f"{source}: rope_type {str(rope_type)[:40]!r} is not supported "
                              "(original, yarn or yarn_log)")
    rope = {}
    if rope_type != "original":  # "original": sglang keeps the unscaled frequencies
        rope = dict(rope_scaling=rope_type, rope_scaling_factor=number("scaling_factor"),
                    rope_original_context=dimension("original_max_position_embeddings"),
                    rope_beta_fast=number("beta_fast", 32), rope_beta_slow=number("beta_slow", 1))
    elif "original_max_position_embeddings" in data:  # recorded, as the preset does
        rope = dict(rope_original_context=dimension("original_max_position_embeddings"),
                    rope_scaling_factor=number("scaling_factor", 1.0), rope_beta_fast=number("beta_fast", 32),
                    rope_beta_slow=number("beta_slow", 1))
    torch_dtype = data.get("torch_dtype", data.get("dtype", "bfloat16"))
    tie = data.get("tie_word_embeddings")
    temperature = integer("attn_temperature_len", -1)
    fields = dict(
        variant="grok-2" if residual_moe else "grok-1",
        vocab_size=dimension("vocab_size"), emb_size=emb, key_size=key_size, num_q_heads=heads,
        num_kv_heads=dimension("num_key_value_heads", heads), num_layers=dimension("num_hidden_layers"),
        widening_factor=widening, expert_ffn_size=explicit, shared_ffn_size=shared,
        num_experts=experts, num_selected_experts=dimension("num_experts_per_tok"),
        sequence_len=dimension("max_position_embeddings"),
        embedding_multiplier_scale=number("embedding_multiplier_scale", math.sqrt(emb) if emb else None),
        output_multiplier_scale=number("output_multiplier_scale", 1.0),
        attn_output_multiplier=number("attn_output_multiplier", key_size ** -0.5 if key_size else None),
        attn_logit_cap=number("attn_logit_softcapping", data.get("max_attn_value", 30.0)),
        router_logit_cap=number("router_logit_softcapping", 0.0),
        final_logit_cap=max(number("final_logit_softcapping", 0.0), 0.0),  # sglang: below 0 is off
        attn_temperature_len=max(temperature, 0),
        rope_base=number("rope_theta", 10000.0), rms_norm_eps=number("rms_norm_eps", 1e-5),
        tie_embeddings=bool(tie) if tie is not None else not residual_moe,
        fprop_dtype=dtype or (torch_dtype if torch_dtype in ("float32", "bfloat16") else "bfloat16"),
        **rope,
    )
    # Grok-2's GELU is the exact one sglang's kernels compute; Grok-1's the tanh one of its
    # published code (docs/grok2.md §2). sglang reads no hidden_act for either, nor does this.
    fields["activation"] = "gelu_erf" if residual_moe else "gelu_tanh"
    # Keys are masked by their id only where a Grok-1 config names a pad id (its reference's mask);
    # sglang masks Grok-2's by position alone, whatever its pad_token_id (docs/grok2.md §11).
    fields["pad_token"] = None
    for key, field in (("pad_token_id", "pad_token"), ("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        if field == "pad_token" and residual_moe:
            continue
        value = data.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            fields[field] = _number({key: value}, key, source, kind=int)
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: config does not describe a model this runner can run: {e}") from None


def _file_tensors(path: str, spent: Spent) -> dict[str, LazyTensor]:
    if path.endswith(".bin"):
        return open_torch_zip(path)
    header, data_start = read_header(path, spent)
    return {name: _lazy(path, name, info, data_start) for name, info in header.items() if name != "__metadata__"}


def _tensors(directory: str) -> tuple[dict[str, LazyTensor], dict[str, list[tuple[int, LazyTensor]]]]:
    """Every tensor of the directory's safetensors files (else of its PyTorch ``.bin`` files, read
    without unpickling: ``checkpoints.torch_zip``): ``{name: tensor}`` for the files read whole,
    and ``{name: [(rank, shard)]}`` for tensors split over ``-TP-00k`` files."""
    files = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
    files = files or sorted(glob.glob(os.path.join(glob.escape(directory), "*.bin")))
    if not files:
        raise CheckpointError(f"{directory}: a Hugging Face config.json but no *.safetensors or *.bin weight files")
    whole: dict[str, LazyTensor] = {}
    shards: dict[str, list[tuple[int, LazyTensor]]] = {}
    spent = Spent(HEADERS_BYTES, "HEADERS_BYTES")  # every file's header is kept: their sum is bounded
    for path in files:
        tp = _TP_FILE.fullmatch(os.path.basename(path))
        rank = None if tp is None or tp.group(1) == "common" else int(tp.group(1))
        for name, tensor in _file_tensors(path, spent).items():
            if rank is not None:
                shards.setdefault(name, []).append((rank, tensor))
            elif name in whole:
                raise CheckpointError(f"{path}: tensor {name[:200]!r} is also in {whole[name].source.rsplit(':', 1)[0]}")
            else:
                whole[name] = tensor
    return whole, shards


def _joined(name: str, parts: list[tuple[int, LazyTensor]], directory: str) -> LazyTensor:
    """A tensor split over tensor-parallel files, joined in rank order along its split axis."""
    ranks = sorted(rank for rank, _ in parts)
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"{directory}: tensor {name!r} is split over TP files of ranks {ranks}: "
                              f"expected ranks 0..{len(ranks) - 1}, each once")
    kind = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if kind not in _TP_AXIS:
        raise CheckpointError(f"{directory}: tensor {name!r} is in {len(parts)} TP files, and only the experts' "
                              "matrices are split (everything else belongs in the -TP-common file)")
    ordered = [t for _, t in sorted(parts, key=lambda p: p[0])]
    try:
        return concatenated(ordered, _TP_AXIS[kind], f"{ordered[0].source} (+{len(ordered) - 1} TP shards)")
    except ValueError as e:
        raise CheckpointError(f"{directory}: tensor {name!r}: {e}") from None


def naming(names) -> str:
    """Which naming a checkpoint's tensor names follow."""
    names = set(names)
    if "transformer.in_out_embed.weight" in names:
        return "keyfan"
    if any(".moe_block." in n for n in names):
        return "hpcai"
    return "sglang"


def open_hf(directory: str, config: ModelConfig) -> dict:
    """``{param path: LazyTensor}`` for a Hugging Face directory of ``config``: every tensor the
    config's parameters need, found by its upstream name, transposed, stacked and joined as it is
    stored; a missing tensor, one nothing reads, or one of the wrong shape is an error naming it."""
    whole, shards = _tensors(directory)
    for name, parts in shards.items():
        if name in whole:
            raise CheckpointError(f"{directory}: tensor {name!r} is both whole ({whole[name].source}) and split "
                                  "over TP files")
        whole[name] = _joined(name, parts, directory)
    scheme = naming(whole)
    used: set[str] = set()

    def take(name: str, what: str) -> LazyTensor:
        if name not in whole:
            raise CheckpointError(f"{directory}: missing tensor {name!r} ({what}, {scheme} naming)")
        used.add(name)
        return whole[name]

    def norm(base: str, what: str) -> LazyTensor:
        for suffix in (".weight", ".scale"):  # hpcai-tech names a norm's parameter "scale"
            if base + suffix in whole:
                return take(base + suffix, what)
        return take(base + ".weight", what)

    def read(name: str, kind: str, path: str, prefix: str = "") -> LazyTensor:
        if kind == "norm":
            return norm(prefix + name, path)
        if kind == "table":
            return take(prefix + name, path)
        if kind == "linear":
            return transposed(take(prefix + name, path))
        experts = [transposed(take(prefix + name.format(e=e), path)) for e in range(config.num_experts)]
        try:
            return stacked(experts, f"{experts[0].source} (+{len(experts) - 1} experts)")
        except ValueError as e:
            raise CheckpointError(f"{directory}: {path}: {e}") from None

    sources = {}
    for path, (name, kind) in _GLOBAL[scheme].items():
        if path.endswith("lm_head/embeddings") and config.tie_embeddings:
            if name in whole:
                used.add(name)  # a tied model's copy of its embedding (read from the embedding)
            continue
        sources[path] = read(name, kind, path)
    for i in range(config.num_layers):
        prefix = _LAYER_PREFIX[scheme].format(i=i)
        for leaf, (name, kind) in _LAYER[scheme].items():
            if leaf.startswith("mlp/") and not config.shared_ffn_size:
                continue
            sources[f"transformer/decoder_layer_{i}/{leaf}"] = read(name, kind, leaf, prefix)
    unused = sorted(n for n in whole if n not in used and not _IGNORED.fullmatch(n))
    if unused:
        raise CheckpointError(f"{directory}: tensor(s) {shown(', '.join(unused[:5]))}{' ...' if len(unused) > 5 else ''} are not "
                              f"parameters of this config ({len(unused)} in all; {scheme} naming, "
                              f"{config.num_layers} layers, {config.num_experts} experts)")
    return sources
