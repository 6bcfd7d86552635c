#!/usr/bin/env python3
"""Save a random-weight MixtralForCausalLM (Grok-1-like dims) + WordLevel tokenizer.

Run with /tmp/peers/vllm-venv/bin/python.
"""
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/peers/hf-mixtral"
VOCAB = 8192

torch.manual_seed(0)
cfg = MixtralConfig(
    vocab_size=VOCAB, hidden_size=512, intermediate_size=2736,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
    tie_word_embeddings=True, rope_theta=10000, rms_norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    torch_dtype="float32",
)
model = MixtralForCausalLM(cfg).to(torch.float32).eval()
model.save_pretrained(OUT, safe_serialization=True)

vocab = {f"t{i}": i for i in range(VOCAB)}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins pieces with spaces
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0", unk_token="t3",
    model_max_length=2048,
)
fast.save_pretrained(OUT)

# sanity check
t2 = PreTrainedTokenizerFast.from_pretrained(OUT)
ids = t2("t5 t6 t7", add_special_tokens=False)["input_ids"]
print("ids", ids, "decode", repr(t2.decode([5, 6, 7])), "vocab", len(t2))
print("saved", OUT, "params", sum(p.numel() for p in model.parameters()))
