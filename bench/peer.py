"""The peer a CPU user would otherwise pick: Hugging Face transformers (PyTorch, CPU) running a
Mixtral model (the closest architecture it has to Grok-1: GQA attention, top-2 of 8 experts with
gated experts, RoPE) of the benchmark config's dimensions, random weights, float32.

    pip install -e '.[bench]'      # torch 2.13.0 (CPU build) and transformers
    python -m bench.peer [--batches 1,8] [--prompt 128] [--new-tokens 32]

``python -m bench`` runs it in the same run when torch and transformers are installed. Timing as in
the main benchmark: TTFT = ``generate`` of one new token; TPOT = (time for ``new_tokens`` tokens -
TTFT) / (new_tokens - 1), greedy, with its KV cache; medians over repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time


def available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def mixtral_like(config):
    """A ``MixtralForCausalLM`` with the dimensions of our ``ModelConfig`` (tied embedding, as Grok-1)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    hf = MixtralConfig(
        vocab_size=config.vocab_size, hidden_size=config.emb_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.key_size,
        num_local_experts=config.num_experts, num_experts_per_tok=config.num_selected_experts,
        max_position_embeddings=config.sequence_len, tie_word_embeddings=True, rope_theta=config.rope_base,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(hf).to(torch.float32).eval()
    return model


def fast_tokenizer(model_file: str):
    """The shipped SentencePiece BPE model as a transformers tokenizer that encodes identically.

    SentencePiece BPE merges pieces in the order of their scores (here, their ids); a Hugging Face
    BPE model takes the same merges as a ranked list, so each piece that is the concatenation of two
    others becomes the merge of those two, ranked by the merged piece's id. No dummy prefix and an
    identity normalizer, as the model was trained; spaces become U+2581 and split words, and bytes
    fall back to ``<0xNN>`` pieces.
    """
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_file=model_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = sorted((vocab[piece], vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
                    for piece, i in vocab.items() if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i))
                    for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                     unk_token=sp.id_to_piece(sp.unk_id()), byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " ")])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=sp.id_to_piece(sp.bos_id()),
                                   eos_token=sp.id_to_piece(sp.eos_id()), unk_token=sp.id_to_piece(sp.unk_id()),
                                   pad_token=sp.id_to_piece(sp.pad_id()))


def measure(config, batches=(1, 8), prompt_len: int = 128, new_tokens: int = 32, repeats: int = 3) -> dict:
    import torch
    import transformers

    model = mixtral_like(config)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for batch in batches:
        ids = torch.randint(4, config.vocab_size, (batch, prompt_len))
        mask = torch.ones_like(ids)

        def generate(n):
            with torch.inference_mode():
                start = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
                seconds = time.perf_counter() - start
            assert out.shape == (batch, prompt_len + n)
            return seconds

        generate(2)  # warm-up
        ttft = statistics.median(generate(1) for _ in range(repeats))
        total = statistics.median(generate(new_tokens) for _ in range(repeats))
        tpot = max(total - ttft, 0.0) / (new_tokens - 1)
        rows.append({"batch": batch, "prompt": prompt_len, "ttft": ttft, "tpot": tpot,
                     "decode_tokens_per_s": batch / tpot, "output_tokens_per_s": batch * new_tokens / total})
    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "params": params, "rows": rows}


def main(argv=None):
    from bench.common import BENCH

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not available():
        raise SystemExit("bench.peer needs torch and transformers: pip install -e '.[bench]'")
    result = measure(BENCH, [int(b) for b in args.batches.split(",")], args.prompt, args.new_tokens, args.repeats)
    print_table(result)


def print_table(result: dict) -> None:
    print(f"Hugging Face transformers {result['transformers']}, torch {result['torch']} "
          f"({result['threads']} threads), MixtralForCausalLM, {result['params'] / 1e6:.0f}M parameters, fp32")
    print("| batch | prompt | TTFT s | TPOT ms | decode tok/s | output tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        print(f"| {r['batch']} | {r['prompt']} | {r['ttft']:.2f} | {r['tpot'] * 1e3:.1f} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['output_tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
