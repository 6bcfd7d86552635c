#!/usr/bin/env python3
"""Write a small random-weight Grok-1-like GGUF (arch "grok") for llama.cpp.

Run with /tmp/peers/tools-venv/bin/python (gguf-py installed from the same
llama.cpp source tree that llama-server was built from).
"""
import math
import sys

import numpy as np
import gguf

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/peers/grok-bench-f32.gguf"

# 8,192 for bench.load's peers; 32,768 for bench.speculation's (the bench config's vocabulary)
VOCAB = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
HIDDEN = 512
LAYERS = 8
N_HEAD = 8
N_KV = 2
HEAD_DIM = 64
FF = 2736
N_EXPERT = 8
N_EXPERT_USED = 2
CTX = 2048
ROPE_THETA = 10000.0
EPS = 1e-5
STD = 0.02

rng = np.random.default_rng(0)


def rnd(*shape):
    # numpy shape is the reverse of ggml's ne: (out, in) for matrices
    return (rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float32)


def ones(n):
    return np.ones((n,), dtype=np.float32)


arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GROK]  # "grok"
w = gguf.GGUFWriter(OUT, arch)

w.add_name("grok-bench-random")
w.add_file_type(gguf.LlamaFileType.ALL_F32)
w.add_context_length(CTX)
w.add_embedding_length(HIDDEN)
w.add_block_count(LAYERS)
w.add_feed_forward_length(FF)
w.add_expert_feed_forward_length(FF)
w.add_head_count(N_HEAD)
w.add_head_count_kv(N_KV)
w.add_key_length(HEAD_DIM)
w.add_value_length(HEAD_DIM)
w.add_rope_dimension_count(HEAD_DIM)
w.add_rope_freq_base(ROPE_THETA)
w.add_layer_norm_rms_eps(EPS)
w.add_expert_count(N_EXPERT)
w.add_expert_used_count(N_EXPERT_USED)
# Grok-1 multipliers, rescaled to these dims the way Grok-1 defines them:
# embedding_multiplier_scale = sqrt(hidden), attn_output_multiplier = 1/sqrt(head_dim),
# output_multiplier_scale = 1/sqrt(3), attention/router logit soft-cap 30.
w.add_embedding_scale(math.sqrt(HIDDEN))
w.add_attn_output_scale(HEAD_DIM ** -0.5)
w.add_logit_scale(0.5773502691896257)
w.add_attn_logit_softcapping(30.0)
w.add_router_logit_softcapping(30.0)

# tokenizer: SentencePiece-style ("llama") vocab with pieces t0..t32767
tokens = [f"t{i}" for i in range(VOCAB)]
scores = [-float(i) for i in range(VOCAB)]
types = [gguf.TokenType.NORMAL] * VOCAB
for special in (0, 1, 2):  # pad, bos, eos
    types[special] = gguf.TokenType.CONTROL
w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
w.add_token_list(tokens)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_pad_token_id(0)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(3)
w.add_add_bos_token(False)
w.add_add_eos_token(False)

# tensors (output.weight omitted: tied to token_embd)
w.add_tensor("token_embd.weight", rnd(VOCAB, HIDDEN))
w.add_tensor("output_norm.weight", ones(HIDDEN))
for i in range(LAYERS):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", ones(HIDDEN))
    w.add_tensor(p + "attn_q.weight", rnd(N_HEAD * HEAD_DIM, HIDDEN))
    w.add_tensor(p + "attn_k.weight", rnd(N_KV * HEAD_DIM, HIDDEN))
    w.add_tensor(p + "attn_v.weight", rnd(N_KV * HEAD_DIM, HIDDEN))
    w.add_tensor(p + "attn_output.weight", rnd(HIDDEN, N_HEAD * HEAD_DIM))
    w.add_tensor(p + "attn_output_norm.weight", ones(HIDDEN))
    w.add_tensor(p + "ffn_norm.weight", ones(HIDDEN))
    w.add_tensor(p + "ffn_gate_inp.weight", rnd(N_EXPERT, HIDDEN))
    w.add_tensor(p + "ffn_gate_exps.weight", rnd(N_EXPERT, FF, HIDDEN))
    w.add_tensor(p + "ffn_up_exps.weight", rnd(N_EXPERT, FF, HIDDEN))
    w.add_tensor(p + "ffn_down_exps.weight", rnd(N_EXPERT, HIDDEN, FF))
    w.add_tensor(p + "layer_output_norm.weight", ones(HIDDEN))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", OUT)
