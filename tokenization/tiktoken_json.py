"""Grok-2's tokenizer, ``tokenizer.tok.json``: a byte-level BPE in tiktoken's terms, read with the
``tiktoken`` library as sglang's TiktokenTokenizer and vLLM's Grok2Tokenizer read it.

The file is a JSON object: ``regular_tokens`` and ``special_tokens``, each a list of ``{"bytes":
[0-255, ...], "token": id}`` (a regular token's id is its merge rank), ``word_split`` "V1" (the
pre-split pattern below) or a ``pat_str`` of its own, optionally ``vocab_size``. The special
tokens include ``<|pad|>``, ``<|separator|>`` (the chat template's turn end) and ``<|eos|>``.
As in sglang, a special token's text in a prompt is that token.
"""

from __future__ import annotations

import os

from tokenization.base import Tokenizer

# "V1": tiktoken's cl100k pattern with each digit a word of its own (sglang's PAT_STR_B)
V1_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
EOS = "<|eos|>"


def _entries(spec: dict, key: str, path: str) -> dict[bytes, int]:
    from untrusted import MAX_VOCAB

    items = spec.get(key)
    if not isinstance(items, list):
        raise ValueError(f"{path}: {key} must be a list of {{bytes, token}} objects")
    if len(items) > MAX_VOCAB:
        raise ValueError(f"{path}: {key} lists {len(items):,} tokens, more than MAX_VOCAB ({MAX_VOCAB:,})")
    out = {}
    for n, item in enumerate(items):
        data = item.get("bytes") if isinstance(item, dict) else None
        token = item.get("token") if isinstance(item, dict) else None
        if (not isinstance(data, list) or not all(type(b) is int and 0 <= b < 256 for b in data)
                or type(token) is not int or token < 0):
            raise ValueError(f"{path}: {key}[{n}] must be {{\"bytes\": [0-255, ...], \"token\": id >= 0}}")
        out[bytes(data)] = token
    return out


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, path: str, spec=None):
        """The tokenizer of file ``path`` (``spec``: its JSON, if already read)."""
        import tiktoken

        from untrusted import TOKENIZER_BYTES, read_json

        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist")
        self.path = path
        if spec is None:
            spec = read_json(path, "tokenizer", TOKENIZER_BYTES, "TOKENIZER_BYTES")
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: a tiktoken tokenizer file is a JSON object")
        ranks = _entries(spec, "regular_tokens", path)
        specials = {}
        for data, token in _entries(spec, "special_tokens", path).items():
            try:
                specials[data.decode("utf-8")] = token
            except UnicodeDecodeError:
                raise ValueError(f"{path}: special token {token}'s bytes are not UTF-8") from None
        pattern = spec.get("pat_str")
        if pattern is None:
            if spec.get("word_split") != "V1":
                raise ValueError(f"{path}: word_split {str(spec.get('word_split'))[:40]!r} is not V1 and no pat_str "
                                 "is given")
            pattern = V1_PATTERN
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:  # tiktoken panics on a text holding such a byte
            raise ValueError(f"{path}: byte 0x{missing[0]:02x} is no token ({len(missing)} of the 256 bytes are "
                             "missing): a byte-level BPE needs every byte as a token of its own")
        ids = list(ranks.values()) + list(specials.values())
        if len(set(ids)) != len(ids):
            raise ValueError(f"{path}: two tokens share an id")
        try:
            self.encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks,
                                              special_tokens=specials)
        except Exception as e:  # tiktoken's own checks (a rank gap, a bad pattern)
            raise ValueError(f"{path}: tiktoken refuses it ({str(e)[:200]})") from None
        self.specials = {token: text for text, token in specials.items()}
        self._bytes = {token: data for data, token in ranks.items()}
        self._size = max(ids) + 1 if ids else 0

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eos_id(self) -> int:
        return self.encoding._special_tokens.get(EOS, -1)

    def encode(self, text: str) -> list[int]:
        from untrusted import library_failure, shown

        try:
            return self.encoding.encode(text, allowed_special="all")
        except BaseException as e:  # its pattern failing on this text (a backtrack limit), or a panic
            if not library_failure(e):
                raise
            raise ValueError(f"{self.path}: the tokenizer failed on this text ({type(e).__name__}: "
                             f"{shown(e, 120)})") from None

    def decode(self, ids) -> str:
        return self.encoding.decode_bytes([int(i) for i in ids if int(i) in self._bytes]).decode("utf-8", "replace")

    def is_special(self, token: int) -> bool:
        return int(token) in self.specials

    def special_text(self, token: int) -> str:
        return self.specials[int(token)]

    def token_bytes(self, token: int) -> list[int]:
        token = int(token)
        if token in self.specials:
            return list(self.specials[token].encode())
        return list(self._bytes.get(token, b""))

    def byte_ids(self) -> list[int] | None:
        ranks = {data: token for token, data in self._bytes.items()}
        ids = [ranks.get(bytes([b])) for b in range(256)]
        return ids if all(i is not None for i in ids) else None
