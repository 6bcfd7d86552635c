"""SentencePiece models (``tokenizer.model``): Grok-1's tokenizer and the shipped model's."""

from __future__ import annotations

import functools
import os
import re
from typing import Optional

import sentencepiece as spm

from tokenization.base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; ``encode`` adds no BOS, as Grok-1's runner."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist")
        self.path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path}: not a SentencePiece model ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.vocab_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def is_special(self, token: int) -> bool:
        return self.sp.is_control(int(token))

    def is_unknown(self, token: int) -> bool:
        return self.sp.is_unknown(int(token))

    def special_text(self, token: int) -> str:
        return self.sp.id_to_piece(int(token))

    def byte_ids(self) -> list[int] | None:
        ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        return ids if all(self.sp.is_byte(i) for i in ids) else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` at the cost of normalizing ``text``, not of
        encoding it (measured on a 4 MB text: 14 MB and 0.08 s against 177 MB and 1.4 s), so a
        text far too long for a model is refused for the price of reading it.

        Sound because the pieces ``encode`` returns spell the normalized text (the normalizer is the
        model's own: it may drop or merge characters, never invent them) and, with byte fallback,
        a character outside the vocabulary becomes byte pieces, each a part of one character: so a
        token covers at most ``max_piece_chars`` characters. Without byte fallback, unknown
        characters merge into one ``<unk>`` of any length, and the bound is 0.
        """
        if self.max_piece_chars is None:
            return 0
        return -(-len(self.sp.normalize(text)) // self.max_piece_chars)

    def min_tokens_reason(self, text: str) -> str:
        return (f"its {len(self.sp.normalize(text))} characters once normalized, at most "
                f"{self.max_piece_chars} a token")

    @functools.cached_property
    def max_piece_chars(self) -> Optional[int]:
        """The longest piece's characters (its ``▁`` one), or None without byte fallback."""
        sp = self.sp
        bytes_ = [sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        if not all(sp.is_byte(i) for i in bytes_):
            return None
        return max(len(sp.id_to_piece(i)) for i in range(sp.get_piece_size())
                   if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)))

    def token_name(self, token: int) -> str:
        """A token's name in logprobs, the same for the chosen token and its alternatives, and
        distinct for distinct tokens: its piece as text (SentencePiece's word marker as a space),
        and a byte-fallback piece as OpenAI names a token that is not text alone, ``bytes:\\xe2``
        (also an ASCII byte, whose character may be another token's piece)."""
        if self.sp.is_byte(int(token)):
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token))
        return self.sp.id_to_piece(int(token)).replace("\u2581", " ")

    def token_bytes(self, token: int) -> list[int]:
        """A token's bytes in the text (OpenAI's chat ``bytes``); a control token's, its piece's."""
        piece = self.sp.id_to_piece(int(token))
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return [int(byte.group(1), 16)] if byte else list(piece.replace("\u2581", " ").encode("utf-8"))

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])
