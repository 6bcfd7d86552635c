"""The three tokenizer files of the Grok family behind one interface: SentencePiece (tested in
test_tokenizer.py), a Hugging Face tokenizer.json and Grok-2's tiktoken JSON: chosen by content,
round trips, bytes, streaming, specials and the grammar engine's view; a malformed file is one
error naming it."""

import json

import pytest

from runner import grammar
from tokenization import IncrementalDetokenizer, find_tokenizer, load_tokenizer
from tests.tokenizer_files import SPECIALS, write_tiktoken_json, write_tokenizer_json

TEXTS = ["the house of mister darcy", "café naïve “quoted” — ☃ 😀 done", "  spaces\n\nand lines\t", "{\"a\": [1, 2]}"]


@pytest.fixture(scope="module", params=["tokenizer.json", "tiktoken"])
def tokenizer(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    path = (write_tokenizer_json if request.param == "tokenizer.json" else write_tiktoken_json)(directory)
    return load_tokenizer(path)


def test_chosen_by_content_with_grok2s_specials(tokenizer):
    assert tokenizer.kind in ("tokenizer.json", "tiktoken")
    assert tokenizer.vocab_size == 512 and tokenizer.eos_id == 2
    assert [tokenizer.special_text(i) for i in range(3)] == list(SPECIALS)
    assert all(tokenizer.is_special(i) for i in range(3)) and not tokenizer.is_special(100)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trips_and_spells_its_bytes(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert b"".join(bytes(tokenizer.token_bytes(i)) for i in ids) == text.encode()
    assert len(ids) >= tokenizer.min_tokens(text)
    byte_ids = tokenizer.byte_ids()
    assert [bytes(tokenizer.token_bytes(i)) for i in byte_ids] == [bytes([b]) for b in range(256)]


def test_the_prompt_bound_is_a_lower_bound_and_says_how_it_was_found(tokenizer):
    """What lets a runner refuse a text far too long without encoding it (tests/test_tokenizer.py
    holds SentencePiece to the same): never above the true count, and biting on long texts."""
    from tests.test_tokenizer import _texts

    for text in _texts(1) + ["<|separator|>" * 50, "<|eos|><|pad|>" * 40]:
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), repr(text[:60])
    text = "the house " * 10_000
    assert tokenizer.min_tokens(text) >= 100_000 // tokenizer.max_token_bytes > 1000
    assert tokenizer.min_tokens_reason(text) == f"its 100000 bytes, at most {tokenizer.max_token_bytes} a token"


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": ""}},
    {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                      "use_regex": True}]}},
])
def test_a_tokenizer_json_that_may_rewrite_or_drop_text_claims_no_bound(tmp_path, change):
    """A normaliser may shorten the text and a whitespace split drops it, so the bytes bound
    nothing: no bound, and the runner encodes (here both hold text of more bytes than tokens
    could spell at the byte bound)."""
    spec = json.loads(open(write_tokenizer_json(tmp_path)).read())
    (tmp_path / "tokenizer.json").write_text(json.dumps(dict(spec, **change)))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    text = ("x" if "normalizer" in change else " ") * 30000 + "a"
    assert tokenizer.min_tokens(text) == 0 and len(tokenizer.encode(text)) < 30000 // tokenizer.max_token_bytes
    assert tokenizer.min_tokens_reason(text).startswith("no bound")


def test_streams_a_character_split_over_tokens_whole(tokenizer):
    text = "naïve ☃ 😀 café"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    names = [tokenizer.token_name(i) for i in ids]
    assert any(n.startswith("bytes:") for n in names)  # a part of 😀


def test_special_tokens_are_left_out_of_text_unless_asked(tokenizer):
    ids = tokenizer.encode("the house") + [2]
    assert tokenizer.decode(ids) == "the house"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(kept.add(i) for i in ids) + kept.flush() == "the house<|eos|>"


def test_a_special_tokens_text_in_a_prompt_is_that_token(tokenizer):
    """As sglang's and vLLM's Grok-2 tokenizers (and Hugging Face's) encode: the chat template's
    <|separator|> is the separator token."""
    ids = tokenizer.encode("Human: hi<|separator|>\n\nAssistant:")
    assert 1 in ids


def test_the_grammar_engine_reads_the_vocabulary(tokenizer):
    token_grammar = grammar.TokenGrammar(tokenizer, 512, tokenizer.eos_id)
    compiled = token_grammar.compile_grammar("json_schema", {"type": "object", "properties": {
        "name": {"type": "string"}}, "required": ["name"], "additionalProperties": False})
    assert compiled.new_matcher() is not None
    forced = token_grammar.pieces('{"name": "')
    assert b"".join(bytes(tokenizer.token_bytes(i)) for i in forced) == b'{"name": "'


def test_a_directory_prefers_the_sentencepiece_then_tiktoken_then_json(tmp_path):
    assert find_tokenizer(str(tmp_path)) is None
    write_tokenizer_json(tmp_path)
    assert find_tokenizer(str(tmp_path)).endswith("tokenizer.json")
    write_tiktoken_json(tmp_path)
    assert find_tokenizer(str(tmp_path)).endswith("tokenizer.tok.json")


@pytest.mark.parametrize("content, message", [
    ({"regular_tokens": [{"bytes": [300], "token": 5}], "special_tokens": [], "word_split": "V1"},
     r"regular_tokens\[0\] must be"),
    ({"regular_tokens": [], "special_tokens": [], "word_split": "V2"}, "word_split 'V2' is not V1"),
    ({"regular_tokens": "no", "special_tokens": []}, "regular_tokens must be a list"),
    ({"something": 1}, "neither a Hugging Face tokenizer.json"),
    ({"model": {"type": "nonsense"}}, "not a Hugging Face tokenizer.json"),
])
def test_a_malformed_file_is_an_error_naming_it(tmp_path, content, message):
    path = tmp_path / "tokenizer.tok.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as error:
        load_tokenizer(str(path))
    assert str(path) in str(error.value)
