"""Hugging Face ``tokenizer.json`` files, read by the ``tokenizers`` library (the file's own
runtime: its normalizers, pre-tokenizers and models are many, and reimplementing them would be
a second, drifting copy). Byte-level BPE vocabularies (GPT-2's byte-to-character alphabet) and
SentencePiece-style ones (``▁`` for a space, ``<0xE2>`` byte fallback) both spell their tokens'
bytes here; ``tokenizer_config.json`` beside the file names BOS and EOS where it exists."""

from __future__ import annotations

import functools
import json
import os
import re

from tokenization.base import Tokenizer


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte in a token's string."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HuggingFaceTokenizer(Tokenizer):
    kind = "tokenizer.json"

    def __init__(self, path: str, spec=None, data: bytes | None = None):
        """The tokenizer of file ``path`` (``spec`` and ``data``: its JSON and bytes, if already
        read: the file is read and parsed once)."""
        from tokenizers import Tokenizer as Backend

        from untrusted import TOKENIZER_BYTES, library_failure, read_bounded, shown

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist")
        self.path = path
        if data is None:
            data = read_bounded(path, "tokenizer", TOKENIZER_BYTES, "TOKENIZER_BYTES")
        try:
            self.backend = Backend.from_str(data.decode("utf-8"))
        except BaseException as e:  # the library raises its own exception types, and panics
            if not library_failure(e):
                raise
            raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({shown(e)})") from None
        if spec is None:
            spec = json.loads(data)
        self.byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or \
            "ByteLevel" in json.dumps(spec.get("decoder"))
        self.normalizes = spec.get("normalizer") is not None
        self.pre_tokenizer = json.dumps(spec.get("pre_tokenizer"))
        self.specials = {int(i): t.content for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        self._bos, self._eos = self._named_ids(os.path.join(os.path.dirname(path), "tokenizer_config.json"))

    def _named_ids(self, config_path: str) -> tuple[int, int]:
        if not os.path.isfile(config_path):
            return -1, -1
        from untrusted import read_json

        config = read_json(config_path, "tokenizer config")
        ids = []
        for key in ("bos_token", "eos_token"):
            name = config.get(key) if isinstance(config, dict) else None
            name = name.get("content") if isinstance(name, dict) else name
            token = self.backend.token_to_id(name) if isinstance(name, str) else None
            ids.append(-1 if token is None else token)
        return ids[0], ids[1]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        from untrusted import library_failure, shown

        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        except BaseException as e:  # a pre-tokenizer's pattern failing on this text panics in Rust
            if not library_failure(e):
                raise
            raise ValueError(f"{self.path}: the tokenizer failed on this text ({type(e).__name__}: "
                             f"{shown(e, 120)})") from None

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def is_special(self, token: int) -> bool:
        return int(token) in self.specials

    def special_text(self, token: int) -> str:
        return self.specials[int(token)]

    def token_bytes(self, token: int) -> list[int]:
        piece = self.backend.id_to_token(int(token))
        if piece is None:
            return []
        if self.is_special(token):
            return list(piece.encode())
        if self.byte_level:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
            return list(piece.encode())  # an added token written as text
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return [int(byte.group(1), 16)] if byte else list(piece.replace("\u2581", " ").encode())

    def byte_ids(self) -> list[int] | None:
        if self.byte_level:
            alphabet = {b: c for c, b in _byte_alphabet().items()}
            ids = [self.backend.token_to_id(alphabet[b]) for b in range(256)]
        else:
            ids = [self.backend.token_to_id(f"<0x{b:02X}>") for b in range(256)]
        return ids if all(i is not None for i in ids) else None

    # pre-tokenizers that drop part of the text (whitespace, a delimiter), or a Split that does
    _DROPPING = ("Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit", "Removed")

    @functools.cached_property
    def keeps_every_byte(self) -> bool:
        """Whether each byte of a text is some token's: a byte-level tokenizer with every byte in
        its vocabulary (no unknown token), no normaliser (which may rewrite the text) and no
        pre-tokenizer that drops text. Only then does the byte bound of ``min_tokens`` hold."""
        return ('"ByteLevel"' in self.pre_tokenizer and not self.normalizes and self.byte_ids() is not None
                and not any(f'"{name}"' in self.pre_tokenizer for name in self._DROPPING))

    def min_tokens(self, text: str) -> int:
        return super().min_tokens(text) if self.keeps_every_byte else 0

    def min_tokens_reason(self, text: str) -> str:
        if self.keeps_every_byte:
            return super().min_tokens_reason(text)
        return "no bound: this tokenizer may rewrite or drop text before it encodes it"
