"""Tokenizers: the three files the Grok family ships, each read by its own library, behind one
interface (``Tokenizer``), and the incremental detokenizer streams use.

- ``tokenizer.model``: SentencePiece (Grok-1, the shipped model);
- ``tokenizer.json``: Hugging Face ``tokenizers`` (conversions of Grok-1 and Grok-2);
- ``tokenizer.tok.json``: Grok-2's tiktoken-style JSON.

``load_tokenizer(path)`` picks by what the file is; ``find_tokenizer(directory)`` by what a
checkpoint directory holds, in that order of preference.
"""

from __future__ import annotations

import json
import os

from tokenization.base import Tokenizer
from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.sentencepiece import SentencePieceTokenizer

FILES = ("tokenizer.model", "tokenizer.tok.json", "tokenizer.json")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path``: a SentencePiece model, a Hugging Face ``tokenizer.json`` or a
    tiktoken JSON (told apart by their content). ``ValueError`` naming the file otherwise."""
    from untrusted import TOKENIZER_BYTES, read_bounded

    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    data = read_bounded(path, "tokenizer", TOKENIZER_BYTES, "TOKENIZER_BYTES")  # read once, parsed once
    if not data.lstrip().startswith(b"{"):  # a SentencePiece model is a protocol buffer
        return SentencePieceTokenizer(path)
    try:
        spec = json.loads(data)
    except (ValueError, RecursionError):
        return SentencePieceTokenizer(path)  # which says it is not one either
    if isinstance(spec, dict) and "regular_tokens" in spec:
        from tokenization.tiktoken_json import TiktokenTokenizer

        return TiktokenTokenizer(path, spec)
    if isinstance(spec, dict) and "model" in spec:
        from tokenization.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(path, spec, data)
    raise ValueError(f"{path}: JSON that is neither a Hugging Face tokenizer.json (no \"model\") nor a tiktoken "
                     "tokenizer (no \"regular_tokens\")")


def find_tokenizer(directory: str) -> str | None:
    """The first of ``FILES`` in ``directory``, or None. Whatever holds the name counts: a
    directory or a broken link there is not skipped as if absent, and reading it is the error
    (``checkpoints`` refuses anything but a regular file, naming it)."""
    for name in FILES:
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            return path
    return None


__all__ = ["FILES", "IncrementalDetokenizer", "SentencePieceTokenizer", "Tokenizer", "find_tokenizer",
           "load_tokenizer"]
