"""Hostile tokenizer files (issue 53): a file too large, a tiktoken vocabulary without every byte,
a pattern that fails on a prompt: one ValueError naming the file (a 400 when a request's text
meets it), never a panic out of a native library or an unbounded read."""

import json
import os

import pytest

from untrusted import TOKENIZER_BYTES
from tests.tokenizer_files import write_tiktoken_json, write_tokenizer_json
from tokenization import load_tokenizer


def test_a_tokenizer_file_past_its_limit_is_refused_unread(tmp_path):
    path = tmp_path / "tokenizer.json"
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(TOKENIZER_BYTES + 1)  # sparse: nothing is written to make it
    with pytest.raises(ValueError, match=r"tokenizer\.json: tokenizer of .* bytes is larger than TOKENIZER_BYTES"):
        load_tokenizer(str(path))


def test_a_tiktoken_vocabulary_missing_a_byte_is_refused_at_load(tmp_path):
    """tiktoken panicked on a text holding a byte no token spells."""
    path = write_tiktoken_json(tmp_path)
    spec = json.loads(open(path).read())
    spec["regular_tokens"] = [e for e in spec["regular_tokens"] if e["bytes"] != [0xE2]]
    with open(path, "w") as f:
        json.dump(spec, f)
    with pytest.raises(ValueError, match=r"tokenizer\.tok\.json: byte 0xe2 is no token"):
        load_tokenizer(path)


def test_a_tiktoken_pattern_failing_on_a_prompt_names_the_file(tmp_path):
    path = write_tiktoken_json(tmp_path)
    spec = json.loads(open(path).read())
    spec.pop("word_split")
    spec["pat_str"] = r"(a|aa)*(?=c)|."  # backtracks past fancy-regex's limit on a run of a's
    with open(path, "w") as f:
        json.dump(spec, f)
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("ab")
    with pytest.raises(ValueError, match=r"tokenizer\.tok\.json: the tokenizer failed on this text"):
        tokenizer.encode("a" * 3_000)


def test_a_tokenizer_json_pattern_failing_on_a_prompt_names_the_file(tmp_path):
    """A Split pre-tokenizer whose pattern fails on a text panicked in Rust (a BaseException)."""
    path = write_tokenizer_json(tmp_path)
    spec = json.loads(open(path).read())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"((a+)+)+c"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    with open(path, "w") as f:
        json.dump(spec, f)
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("ab")
    with pytest.raises(ValueError, match=r"tokenizer\.json: the tokenizer failed on this text"):
        tokenizer.encode("a" * 3_000)
