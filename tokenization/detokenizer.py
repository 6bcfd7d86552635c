"""Incremental detokenization for streaming, for any ``Tokenizer``.

Decoding a stream token by token is subtle: SentencePiece drops the leading space of the first
piece it decodes, and a character split over several tokens (byte-fallback pieces ``<0xE2>``
``<0x80>`` ``<0x99>``, or a byte-level BPE's partial bytes) decodes to U+FFFD until its last byte
arrives. ``IncrementalDetokenizer`` therefore decodes a short window that starts a few tokens back
(so the space is kept) and holds text back while it ends in an incomplete character, emitting
exactly the new suffix each time.
"""

from __future__ import annotations

from tokenization.base import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that concatenate to the full text."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids, context: int = 5, skip_special_tokens: bool = True):
        self.tokenizer, self.context = tokenizer, context
        self.ids = list(prompt_ids[-context:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # text up to here has been emitted
        self.keep_special = not skip_special_tokens  # control tokens (</s>...) as their pieces

    def add(self, token_id: int) -> str:
        if self.keep_special and self.tokenizer.is_special(int(token_id)):
            # a special token decodes to nothing: its name goes out as it is, after whatever was
            # held back, and the window goes on past it
            text = self.flush() + self.tokenizer.special_text(int(token_id))
            self.ids.append(int(token_id))
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - self.context)
            return text
        self.ids.append(int(token_id))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if text.endswith(_REPLACEMENT) or len(text) <= len(prefix):
            return ""  # an incomplete character (or nothing printable yet): wait for more bytes
        delta = text[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
