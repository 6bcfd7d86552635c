import pytest

from runner import IncrementalDetokenizer, Tokenizer
from tests.helpers import SHARED_DATA

GROK_TOKENIZER = SHARED_DATA / "grok1-tokenizer.model"
EXAMPLE = "The answer to life the universe and everything is of course"
EXAMPLE_IDS = [422, 3033, 356, 1180, 333, 9072, 360, 2175, 391, 359, 1805]  # GROK1.md §10


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
