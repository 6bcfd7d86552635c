"""What every tokenizer offers the runner, the server and the grammar engine."""

from __future__ import annotations

import functools


class Tokenizer:
    """A tokenizer file, read by its own library. ``encode`` adds no BOS (as Grok's runners);
    ``decode`` leaves special tokens out (their text is ``special_text``)."""

    kind = "abstract"
    path: str

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (a model's vocabulary may be padded beyond them)."""
        raise NotImplementedError

    @property
    def bos_id(self) -> int:
        """The beginning-of-sequence id, or -1."""
        return -1

    @property
    def eos_id(self) -> int:
        """The end-of-sequence id, or -1."""
        return -1

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def is_special(self, token: int) -> bool:
        """A control token: no text of its own, never produced by a grammar from text."""
        raise NotImplementedError

    def special_text(self, token: int) -> str:
        """A special token's name (``</s>``, ``<|eos|>``), as a stream shows it when asked to."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> list[int]:
        """A token's bytes in the text (OpenAI's ``bytes``); a special token's, its name's."""
        raise NotImplementedError

    def token_name(self, token: int) -> str:
        """A token's name in logprobs, the same for the chosen token and its alternatives and
        distinct for distinct tokens: its text, or, where its bytes are not text alone (part of a
        character), OpenAI's ``bytes:\\xe2`` form."""
        if self.is_special(token):
            return self.special_text(token)
        data = bytes(self.token_bytes(token))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def byte_ids(self) -> list[int] | None:
        """The ids spelling each byte 0..255 alone (byte fallback, byte-level BPE), or None."""
        raise NotImplementedError

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (its name's, for a special token)."""
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    # ---- the prompt bound: what lets a runner refuse a text far too long without encoding it ----
    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` for the price of reading ``text``, never above
        the true count (0: no bound). Here: a token stands for at most ``max_token_bytes`` of the
        text's bytes, sound where every byte of the text is some token's (no normaliser rewrites
        it, nothing drops it, no unknown token swallows a run of it); tokenizers where that
        does not hold override this."""
        return -(-self._byte_count(text) // max(self.max_token_bytes, 1))

    def min_tokens_reason(self, text: str) -> str:
        """How ``min_tokens(text)`` was found, in a refusal's words ("its 40000 bytes, at most 16
        a token")."""
        return f"its {self._byte_count(text)} bytes, at most {self.max_token_bytes} a token"

    @staticmethod
    def _byte_count(text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))
