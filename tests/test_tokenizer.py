import pytest

from tokenization import IncrementalDetokenizer, SentencePieceTokenizer as Tokenizer
from tests.helpers import SHARED_DATA

GROK_TOKENIZER = SHARED_DATA / "grok1-tokenizer.model"
EXAMPLE = "The answer to life the universe and everything is of course"
EXAMPLE_IDS = [422, 3033, 356, 1180, 333, 9072, 360, 2175, 391, 359, 1805]  # docs/grok1.md §10


@pytest.fixture(scope="module")
def grok_tokenizer():
    if not GROK_TOKENIZER.is_file():
        pytest.skip(f"Grok-1 tokenizer not found at {GROK_TOKENIZER}")
    return Tokenizer(str(GROK_TOKENIZER))


def test_grok1_tokenizer_encodes_the_reference_prompt(grok_tokenizer):
    assert grok_tokenizer.vocab_size == 131072
    assert grok_tokenizer.encode(EXAMPLE) == EXAMPLE_IDS
    assert grok_tokenizer.decode(EXAMPLE_IDS) == EXAMPLE
    assert [grok_tokenizer.sp.id_to_piece(i) for i in range(4)] == ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]


def stream(tokenizer, prompt, text):
    """Stream the ids of ``text`` after ``prompt``; also return what the deltas must add up to."""
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(t) for t in ids]
    expected = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]
    return ids, deltas, detok.flush(), expected


@pytest.mark.parametrize("text", [" café ☃ 日本語 — ok", " plain words only", " 1234 numbers\n\nnew lines"])
def test_incremental_detokenization_with_byte_fallback(grok_tokenizer, test_tokenizer, text):
    for tokenizer in (grok_tokenizer, Tokenizer(test_tokenizer)):
        ids, deltas, rest, expected = stream(tokenizer, "Hello there", text)
        assert "".join(deltas) + rest == expected
        assert not any("\ufffd" in d for d in deltas)


def test_multi_byte_characters_are_held_back_until_complete(test_tokenizer):
    tokenizer = Tokenizer(test_tokenizer)  # a small vocabulary: non-ASCII goes through byte pieces
    ids, deltas, rest, expected = stream(tokenizer, "the", " ☃")
    assert "".join(deltas) == expected
    assert len(ids) >= 3 and tokenizer.sp.id_to_piece(ids[-1]).startswith("<0x")
    assert deltas[-1].endswith("☃") and all("\ufffd" not in d for d in deltas) and rest == ""


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer(str(tmp_path / "nope.model"))


def test_special_tokens_are_kept_as_their_pieces_when_asked(test_tokenizer):
    tokenizer = Tokenizer(test_tokenizer)
    eos = tokenizer.sp.eos_id()
    words, more = tokenizer.encode(" a house"), tokenizer.encode(" ☃ then")
    prompt = tokenizer.encode("the")
    after = lambda ids: tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]  # noqa: E731
    first, full = after(words), after(words + more)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        text = "".join(detok.add(t) for t in words + [eos] + more) + detok.flush()
        eos_text = "" if skip else tokenizer.sp.id_to_piece(eos)
        assert text == first + eos_text + full[len(first):], skip


def _texts(seed: int):
    """Texts that stress the bound: Austen's prose, whitespace and control characters the normalizer
    drops or keeps, characters outside the vocabulary (byte pieces), compositions and expansions."""
    import random

    from tests.helpers import REPO

    rng = random.Random(seed)
    card = (REPO / "checkpoints" / "austen-moe" / "README.md").read_text(encoding="utf-8")
    out = [card[a: a + rng.randrange(1, 3000)] for a in (rng.randrange(len(card)) for _ in range(60))]
    alphabet = [lambda: chr(rng.randrange(0x20, 0x7F)), lambda: chr(rng.randrange(0xA0, 0x3000)),
                lambda: chr(rng.randrange(0, 0x20)), lambda: " ", lambda: "\u3000", lambda: "\ufdfa",
                lambda: "\u0301", lambda: chr(rng.randrange(0x10000, 0x10FFFF))]
    out += ["".join(rng.choice(alphabet)() for _ in range(rng.randrange(1, 400))) for _ in range(150)]
    return out + [" " * 1000, "\x01" * 1000, "a" * 5000, "\ufdfa" * 100, "e\u0301" * 300, "the " * 999]


def test_min_tokens_is_a_lower_bound_that_costs_no_encoding(grok_tokenizer, test_tokenizer):
    """``min_tokens`` lets the runner refuse a prompt far too long for its context without
    encoding it; it must never exceed the true count, or a prompt that fits would be refused."""
    from tests.helpers import REPO

    austen = Tokenizer(str(REPO / "checkpoints" / "austen-moe" / "tokenizer.model"))
    for tokenizer in (grok_tokenizer, Tokenizer(test_tokenizer), austen):
        assert tokenizer.max_piece_chars >= 2
        for text in _texts(0):
            assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), repr(text[:60])
        assert tokenizer.min_tokens("the " * 100_000) >= 400_000 // tokenizer.max_piece_chars > 1000


def test_min_tokens_is_zero_without_byte_fallback(tmp_path):
    """Without byte fallback unknown characters merge into one <unk> of any length: no bound."""
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("\n".join(["a b c ab bc abc"] * 200))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=12,
                                   model_type="bpe", byte_fallback=False, minloglevel=2)
    tokenizer = Tokenizer(str(tmp_path / "sp.model"))
    assert tokenizer.max_piece_chars is None and tokenizer.min_tokens("zzzz " * 1000) == 0
    assert 0 < len(tokenizer.encode("zzzz " * 1000)) <= 2000
