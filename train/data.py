"""Corpus, tokenizer and token streams for the shipped default model (shared by training and
evaluation so that both rebuild exactly the same data).

- Corpus: ``../shared/data/austen.txt`` (six Jane Austen novels; 80-column hard-wrapped lines).
- Chapters: a chapter starts at a line ``CHAPTER <n>`` / ``Chapter <n>`` (269 in the file); text
  before the first heading (title page) is front matter and goes to training. Chapter ``i`` (0-based,
  file order, across all novels) is held out iff ``i % 20 == 19``.
- Paragraphs: text between blank lines, internal newlines joined with single spaces. Each paragraph
  is encoded on its own (no giant strings; no dummy prefix, so encoding "p1\\np2" in one go gives
  the same ids) and paragraphs are joined by
  the user-defined piece ``"\\n"`` (``NEWLINE_PIECE``), so ``decode`` gives text with line breaks.
"""

from __future__ import annotations

import os
import re

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(os.path.dirname(REPO), "shared", "data", "austen.txt")
HOLDOUT_EVERY = 20
VOCAB_SIZE = 8192
NEWLINE_PIECE = "\n"
_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")


def read_chapters(path: str = CORPUS) -> tuple[list[str], list[list[str]]]:
    """(front-matter paragraphs, [paragraphs of chapter i]) in file order."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    front, chapters, current, para = [], [], None, []

    def flush():
        if para:
            text = " ".join(s.strip() for s in para)
            (front if current is None else current).append(re.sub(r"\s+", " ", text).strip())
            para.clear()

    for line in lines:
        if _CHAPTER.match(line.strip()):
            flush()
            current = [line.strip()]
            chapters.append(current)
        elif not line.strip():
            flush()
        else:
            para.append(line)
    flush()
    return front, chapters


def split_paragraphs(path: str = CORPUS) -> tuple[list[str], list[str]]:
    """(training paragraphs, held-out paragraphs); held out = chapters i with i % 20 == 19."""
    front, chapters = read_chapters(path)
    train, held = list(front), []
    for i, paras in enumerate(chapters):
        (held if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).extend(paras)
    return train, held


def train_tokenizer(model_prefix: str, paragraphs: list[str], vocab_size: int = VOCAB_SIZE) -> str:
    """SentencePiece BPE on the training paragraphs; Grok-1 special ids; returns the .model path."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, byte_fallback=True,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, user_defined_symbols=[NEWLINE_PIECE],
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        max_sentence_length=1 << 16, num_threads=2, minloglevel=2)
    return model_prefix + ".model"


def load_tokenizer(path: str):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=path)


def encode_paragraphs(sp, paragraphs: list[str]) -> np.ndarray:
    """One int32 stream: paragraph, "\\n", paragraph, "\\n", ... (encoded paragraph by paragraph)."""
    nl = sp.piece_to_id(NEWLINE_PIECE)
    out = []
    for ids in sp.encode(paragraphs):
        out.extend(ids)
        out.append(nl)
    return np.asarray(out, np.int32)


def token_streams(tokenizer_path: str, path: str = CORPUS) -> tuple[np.ndarray, np.ndarray]:
    """(training stream, held-out stream) of token ids."""
    sp = load_tokenizer(tokenizer_path)
    train, held = split_paragraphs(path)
    return encode_paragraphs(sp, train), encode_paragraphs(sp, held)


def heldout_windows(stream: np.ndarray, sequence_len: int, bos: int) -> np.ndarray:
    """Consecutive non-overlapping windows ``[bos, t_0 .. t_{L-2}]`` -> [N, sequence_len]; the
    loss is on predicting positions 1..L-1 of each window from the previous ones (the window's
    ``L-1`` stream tokens). A partial last window is dropped."""
    n = (len(stream)) // (sequence_len - 1)
    body = stream[: n * (sequence_len - 1)].reshape(n, sequence_len - 1)
    return np.concatenate([np.full((n, 1), bos, np.int32), body], axis=1)
