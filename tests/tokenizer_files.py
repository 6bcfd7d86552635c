"""Small tokenizer files of the kinds Hugging Face directories hold, made here (nothing is
downloaded): a byte-level BPE ``tokenizer.json`` trained with the ``tokenizers`` library, and the
same vocabulary as Grok-2's ``tokenizer.tok.json`` (tiktoken's JSON: ``regular_tokens`` and
``special_tokens`` of ``{"bytes": [...], "token": id}``, ``word_split`` "V1", as sglang's and
vLLM's Grok-2 tokenizers read it), with Grok-2's special tokens at ids 0, 1, 2."""

from __future__ import annotations

import json
import os

SPECIALS = ("<|pad|>", "<|separator|>", "<|eos|>")
WORDS = ("the of and to a in that it was her she he not be as you had with for his my but on all at by this "
         "have which so from they were would no when are an been could mister elizabeth darcy bennet sister "
         "ball house letter café naïve “quoted” — 1 2 3 { } : \" , [ ] true false null").split()


def corpus() -> list[str]:
    import random

    rng = random.Random(0)  # and made-up words, enough pairs for a few hundred merges
    syllables = "ka lo mi ne su ta ri po ve da zu che sh qu ix ol".split()
    made = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(12))
            for _ in range(400)]
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)) for i in range(400)] + made


def write_tokenizer_json(directory, vocab_size: int = 512) -> str:
    """A byte-level BPE of ``vocab_size`` ids (Grok-2's specials first) and its
    tokenizer_config.json (EOS ``<|eos|>``); the path of tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|eos|>", "pad_token": "<|pad|>"}, f)
    return path


def write_tiktoken_json(directory, vocab_size: int = 512) -> str:
    """The same vocabulary as Grok-2's tokenizer.tok.json; its path."""
    from tokenization.huggingface import _byte_alphabet

    source = json.loads(open(write_tokenizer_json(os.path.join(directory, "bpe"), vocab_size)).read())
    alphabet = _byte_alphabet()
    regular = [{"bytes": [alphabet[c] for c in text], "token": token}
               for text, token in source["model"]["vocab"].items() if text not in SPECIALS]
    special = [{"bytes": list(text.encode()), "token": i} for i, text in enumerate(SPECIALS)]
    path = os.path.join(directory, "tokenizer.tok.json")
    with open(path, "w") as f:
        json.dump({"regular_tokens": sorted(regular, key=lambda e: e["token"]), "special_tokens": special,
                   "word_split": "V1", "vocab_size": vocab_size}, f)
    return path
