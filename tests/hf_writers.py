"""Write a model in the Hugging Face layouts people download, with the upstream names and shapes:
what the loaders (checkpoints/hf_layout.py) are tested against. Nothing here is downloaded.

- ``sglang`` (Grok-2, ``xai-org/grok-2``): names as sglang's ``Grok1ForCausalLM.load_weights`` and
  sglang-jax's ``_create_layer_mappings`` (python/sgl_jax/srt/models/grok.py) read them; with
  ``tp=8`` the experts split as the release ships them, ``pytorch_model-00001-TP-00k.safetensors``
  (w1, w3 by output rows; w2 by input columns: sglang-jax's ``grok_concat_axis_map``) and every
  other tensor in ``pytorch_model-00001-TP-common.safetensors``; config keys as the release's
  config.json (as sglang-jax's Grok-2 test scripts paste it).
- ``hpcai`` (``hpcai-tech/grok-1``): its modeling_grok1.py's modules (``attn.q_proj``,
  ``moe_block.experts.E.linear``, norms' ``scale``) and config.json keys (``num_experts``,
  ``max_attn_value``, ``tie_word_embeddings``).
- ``keyfan`` (``keyfan/grok-1-hf``): Grok-1's names under ``transformer.`` as its modeling_grok.py
  and llama.cpp's GrokModel read them (``transformer.decoder_layer.N.moe.E.linear``).

Matrices are written PyTorch's way, ``[out, in]``; experts one tensor each. ``bin=True`` writes
PyTorch ``.bin`` state dicts, as hpcai-tech's and keyfan's conversions are published
(``pytorch_model-0000N-of-0000M.bin``): ``torch.save``'s zip archive, spelled out here without
torch (``write_torch_bin``).
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np

import struct
import zipfile

from checkpoints.native import SafetensorsWriter
from model.transformer import layers_apart

_ATTN = {"sglang": ("self_attn.{}_proj", "q k v o"), "hpcai": ("attn.{}_proj", "q k v o"),
         "keyfan": ("multi_head_attention.{}", "query key value linear")}
_NORMS = {"sglang": ("pre_attn_norm.weight", "post_attn_norm.weight", "pre_moe_norm.weight", "post_moe_norm.weight"),
          "hpcai": ("pre_attn_norm.scale", "post_attn_norm.scale", "pre_moe_norm.scale", "post_moe_norm.scale"),
          "keyfan": ("rms_norm.weight", "rms_norm_1.weight", "rms_norm_2.weight", "rms_norm_3.weight")}
_EXPERTS = {"sglang": ("block_sparse_moe.experts.{e}.{w}.weight", ("w1", "w3", "w2")),
            "hpcai": ("moe_block.experts.{e}.{w}.weight", ("linear", "linear_v", "linear_1")),
            "keyfan": ("moe.{e}.{w}.weight", ("linear", "linear_v", "linear_1"))}
_ROUTER = {"sglang": "block_sparse_moe.gate.weight", "hpcai": "moe_block.gate.weight", "keyfan": "router.weight"}


def hf_config(config, naming: str) -> dict:
    """The config.json of ``config`` in ``naming``'s keys."""
    c = config
    common = {"vocab_size": c.vocab_size, "hidden_size": c.emb_size, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_q_heads, "num_key_value_heads": c.num_kv_heads,
              "num_experts_per_tok": c.num_selected_experts, "max_position_embeddings": c.sequence_len,
              "rms_norm_eps": c.rms_norm_eps, "embedding_multiplier_scale": c.embedding_multiplier_scale,
              "output_multiplier_scale": c.output_multiplier_scale, "torch_dtype": c.fprop_dtype}
    if naming == "sglang":
        rope = c.rope_scaling if c.rope_scaling != "none" else "original"
        return {**common, "architectures": ["Grok1ForCausalLM"], "model_type": "git",
                "intermediate_size": c.shared_ffn_size, "moe_intermediate_size": c.ffn_size,
                "num_local_experts": c.num_experts, "residual_moe": bool(c.shared_ffn_size), "head_dim": c.key_size,
                "final_logit_softcapping": c.final_logit_cap, "attn_logit_softcapping": c.attn_logit_cap,
                "router_logit_softcapping": c.router_logit_cap, "rope_theta": c.rope_base,
                "attn_temperature_len": c.attn_temperature_len or -1, "sliding_window_size": -1,
                "global_attn_every_n": 1, "rope_type": rope,
                "original_max_position_embeddings": c.rope_original_context,
                "scaling_factor": c.rope_scaling_factor, "extrapolation_factor": 1.0, "attn_factor": 1.0,
                "beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow}
    grok1 = {**common, "intermediate_size": c.ffn_size, "attn_output_multiplier": c.attn_output_multiplier,
             "pad_token_id": c.pad_token, "bos_token_id": c.bos_token, "eos_token_id": c.eos_token,
             "tie_word_embeddings": True}
    if naming == "hpcai":
        return {**grok1, "architectures": ["Grok1ModelForCausalLM"], "num_experts": c.num_experts,
                "max_attn_value": c.attn_logit_cap}
    return {**grok1, "architectures": ["GrokForCausalLM"], "model_type": "grok", "num_local_experts": c.num_experts,
            "rope_theta": c.rope_base, "hidden_act": "gelu"}


def hf_tensors(params, config, naming: str) -> dict[str, np.ndarray]:
    """``{upstream name: array}`` of native ``params`` (float arrays)."""
    p = jax.tree_util.tree_map(np.asarray, jax.device_get(params))
    head = p["language_model"]
    out = {}
    embed = head["in_out_embed"]["embeddings"]
    out["transformer.in_out_embed.weight" if naming == "keyfan" else "model.embed_tokens.weight"] = embed
    out["transformer.rms_norm.weight" if naming == "keyfan" else
        "model.norm.scale" if naming == "hpcai" else "model.norm.weight"] = head["rms_norm"]["scale"]
    out["lm_head.weight"] = embed if config.tie_embeddings else head["lm_head"]["embeddings"]
    attn_name, attn_parts = _ATTN[naming]
    expert_name, expert_parts = _EXPERTS[naming]
    apart = layers_apart(p)["transformer"]  # the model's stacked layers, one a layer as files hold them
    for i in range(config.num_layers):
        layer = apart[f"decoder_layer_{i}"]
        at = (f"transformer.decoder_layer.{i}." if naming == "keyfan" else f"model.layers.{i}.")
        for part, leaf in zip(attn_parts.split(), ("query", "key", "value", "linear")):
            out[at + attn_name.format(part) + ".weight"] = layer["multi_head_attention"][leaf]["w"].T
        out[at + _ROUTER[naming]] = layer["router"]["w"].T
        for w, leaf in zip(expert_parts, ("linear", "linear_v", "linear_1")):
            for e in range(config.num_experts):
                out[at + expert_name.format(e=e, w=w)] = layer["moe"][leaf]["w"][e].T
        for name, leaf in zip(_NORMS[naming], ("rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3")):
            out[at + name] = layer[leaf]["scale"]
        if config.shared_ffn_size:
            for w, leaf in zip(("gate_proj", "up_proj", "down_proj"), ("linear", "linear_v", "linear_1")):
                out[at + f"mlp.{w}.weight"] = layer["mlp"][leaf]["w"].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _write(path: str, tensors: dict[str, np.ndarray]) -> None:
    writer = SafetensorsWriter(path, [(k, v.shape, v.dtype) for k, v in tensors.items()], {"format": "pt"})
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()


_TORCH_STORAGE = {"float32": "FloatStorage", "bfloat16": "BFloat16Storage", "float16": "HalfStorage"}


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)  # BININT


def _ints(values) -> bytes:
    return b"(" + b"".join(_int(n) for n in values) + b"t"  # MARK ... TUPLE


def write_torch_bin(path: str, tensors: dict[str, np.ndarray], archive: str = "pytorch_model") -> None:
    """``tensors`` as ``torch.save(state_dict)`` writes them (torch/serialization.py, ``_save``): a
    zip archive, stored, of ``<archive>/data.pkl``, a protocol-2 pickle of an OrderedDict of
    ``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`` whose
    storages are persistent ids ``("storage", torch.<Type>Storage, key, "cpu", numel)``, and
    ``<archive>/data/<key>``, each storage's bytes; plus ``version`` and ``byteorder``."""
    ordered = b"ccollections\nOrderedDict\n)R"  # GLOBAL, EMPTY_TUPLE, REDUCE
    stream = b"\x80\x02" + ordered + b"("
    for key, (name, array) in enumerate(tensors.items()):
        storage = _TORCH_STORAGE[np.dtype(array.dtype).name]
        shape = array.shape
        stride = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
        pid = b"(" + _text("storage") + b"ctorch\n" + storage.encode() + b"\n" + _text(str(key)) + _text("cpu") + \
            _int(array.size) + b"tQ"  # the persistent id's tuple, BINPERSID
        stream += _text(name) + b"ctorch._utils\n_rebuild_tensor_v2\n(" + pid + _int(0) + _ints(shape) + \
            _ints(stride) + b"\x89" + ordered + b"tR"  # args tuple, REDUCE
    stream += b"u."  # SETITEMS, STOP
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", stream)
        z.writestr(f"{archive}/byteorder", "little")
        for key, array in enumerate(tensors.values()):
            z.writestr(f"{archive}/data/{key}", np.ascontiguousarray(array).tobytes())
        z.writestr(f"{archive}/version", "3\n")


def write_hf(directory, params, config, naming: str, *, tp: int = 0, dtype=None, files: int = 2,
             tokenizer: str | None = None, bin: bool = False) -> None:
    """``params`` of ``config`` as a Hugging Face directory of ``naming``: config.json and
    safetensors (``files`` files, or with ``tp`` the experts split over ``tp`` TP files and the
    rest in a TP-common one), tensors cast to ``dtype`` if given, and ``tokenizer`` copied in
    under its own name."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config, naming), f, indent=1)
    tensors = hf_tensors(params, config, naming)
    if dtype is not None:
        dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    if tp:
        common, shards = {}, [{} for _ in range(tp)]
        for name, array in tensors.items():
            kind = name.rsplit(".", 2)[-2]
            if ".experts." in name and kind in ("w1", "w3", "w2"):
                axis = 1 if kind == "w2" else 0
                for rank, piece in enumerate(np.split(array, tp, axis=axis)):
                    shards[rank][name] = np.ascontiguousarray(piece)
            else:
                common[name] = array
        _write(os.path.join(directory, "pytorch_model-00001-TP-common.safetensors"), common)
        for rank, shard in enumerate(shards):
            _write(os.path.join(directory, f"pytorch_model-00001-TP-{rank:03d}.safetensors"), shard)
    else:
        names = list(tensors)
        for n in range(files):
            part = {k: tensors[k] for k in names[n::files]}
            if bin:
                write_torch_bin(os.path.join(directory, f"pytorch_model-{n + 1:05d}-of-{files:05d}.bin"), part)
            else:
                _write(os.path.join(directory, f"model-{n + 1:05d}-of-{files:05d}.safetensors"), part)
    if tokenizer is not None:
        from checkpoints.native import copy_tokenizer

        copy_tokenizer(tokenizer, str(directory))
