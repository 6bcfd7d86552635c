"""Structured output (runner/grammar.py): random walks through the grammar's masks always end in
JSON that validates against the schema; masks never allow padded vocabulary ids; bad schemas fail."""

import concurrent.futures
import functools
import json
import random

import jsonschema
import numpy as np
import pytest

from runner import grammar
from tokenization import SentencePieceTokenizer as Tokenizer
from tests.helpers import REPO, SHARED_DATA

AUSTEN_TOKENIZER = REPO / "checkpoints" / "austen-moe" / "tokenizer.model"
GROK_TOKENIZER = SHARED_DATA / "grok1-tokenizer.model"
EXTRA_IDS = 40  # a model vocabulary padded past the tokenizer, not to a multiple of 32

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["heroine", "suitor", "aunt"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "address", "items"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}


def load(path):
    if not path.is_file():
        pytest.skip(f"tokenizer not found at {path}")
    tokenizer = Tokenizer(str(path))
    return tokenizer, grammar.TokenGrammar(tokenizer, tokenizer.vocab_size + EXTRA_IDS, tokenizer.sp.eos_id())


@pytest.fixture(scope="module")
def austen():
    return load(AUSTEN_TOKENIZER)


@functools.cache
def token_bytes(sp):
    """What each piece spells, by the rule in grammar._Pieces, written out again here to check it."""
    out = []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        out.append(b"" if sp.is_control(i) or sp.is_unknown(i) else bytes([int(piece[3:5], 16)]) if sp.is_byte(i)
                   else piece.replace("\u2581", " ").encode())
    return tuple(out)


def walk(tokenizer, token_grammar, compiled, seed, cap=40, limit=800):
    """Sample uniformly among the allowed tokens, EOS whenever allowed; after ``cap`` tokens, prefer
    the single characters that close a string or a structure, so every walk ends."""
    sp, rng = tokenizer.sp, random.Random(seed)
    spelled = token_bytes(sp)
    single = {}
    for i, b in enumerate(spelled):
        single.setdefault(b, i)
    closing = [single[c] for c in (b"}", b"]", b'"', b",", b":", b"0", b"1")]
    matcher = grammar.Matcher(compiled)
    words = np.zeros(matcher.num_words, np.int32)
    ids, in_string, escaped = [], False, False
    for _ in range(limit):
        matcher.fill_mask(words)
        allowed = np.flatnonzero(grammar.allowed_tokens(words, token_grammar.vocab_size))
        assert allowed.size and allowed.max() < sp.vocab_size(), "padded vocabulary ids must never be allowed"
        allowed_set = set(allowed.tolist())
        if token_grammar.eos_id in allowed_set:
            token = token_grammar.eos_id
        elif len(ids) >= cap:
            prefer = [single[b'"']] if in_string else closing
            token = next((t for t in prefer if t in allowed_set), int(rng.choice(allowed)))
        else:
            token = int(rng.choice(allowed))
        assert matcher.accept(token), f"the mask allowed {sp.id_to_piece(token)!r} but accept refused it"
        if token == token_grammar.eos_id:
            assert matcher.done
            return ids
        ids.append(token)
        for byte in spelled[token]:  # track whether we are inside a JSON string
            if in_string and not escaped and byte == ord('"'):
                in_string = False
            elif not in_string and byte == ord('"'):
                in_string = True
            escaped = in_string and not escaped and byte == ord("\\")
    pytest.fail(f"walk did not end in {limit} tokens: {sp.decode(ids)!r}")


def check_walks(tokenizer, token_grammar, kind, schema, seeds):
    compiled = token_grammar.compile_grammar(kind, schema if kind == "json_schema" else None)
    spelled = token_bytes(tokenizer.sp)
    for seed in seeds:
        ids = walk(tokenizer, token_grammar, compiled, seed)
        text = b"".join(spelled[i] for i in ids).decode("utf-8")  # strict: no broken characters
        assert tokenizer.decode(ids).strip() == text.strip()
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kind, schema", [("json_schema", PERSON), ("json_schema", ORDER), ("json_object", ANY_OBJECT)],
                         ids=["person", "order", "any-object"])
def test_random_walks_produce_valid_json(austen, kind, schema):
    check_walks(*austen, kind, schema, seeds=range(6))


def test_random_walks_with_the_grok1_tokenizer():
    """131k pieces and a dummy prefix (text starts with ``▁``): mask and accept must still agree."""
    tokenizer, token_grammar = load(GROK_TOKENIZER)
    # llguidance allows only this tokenization of the bytes a grammar forces (a key, an enum value),
    # so it must spell exactly them, without the dummy prefix's space
    pieces = grammar._Pieces(tokenizer, token_grammar.vocab_size, token_grammar.eos_id)
    for text in ['{"name": "', "roine\"", ' "', "city", "ü", "\n  "]:
        assert b"".join(pieces.tokens[i] for i in pieces(text)) == text.encode()
    assert not any(tokenizer.sp.is_byte(i) for i in pieces('{"name": "')), "whole pieces, not bytes"
    check_walks(tokenizer, token_grammar, "json_schema", PERSON, seeds=range(1))
    check_walks(tokenizer, token_grammar, "json_schema", ORDER, seeds=range(2))
    check_walks(tokenizer, token_grammar, "json_object", ANY_OBJECT, seeds=range(2))


def test_a_known_document_then_only_eos(austen):
    tokenizer, token_grammar = austen
    document = {"name": "Emma Woodhouse", "age": 21, "role": "heroine", "tags": ["Highbury", "matchmaker"]}
    matcher = grammar.Matcher(token_grammar.compile_grammar("json_schema", PERSON))
    words = np.zeros(matcher.num_words, np.int32)
    for token in tokenizer.encode(json.dumps(document)):
        assert not matcher.done
        assert matcher.accept(token)
    assert matcher.done  # the closing brace ends it: no trailing whitespace is allowed
    matcher.fill_mask(words)
    assert np.flatnonzero(grammar.allowed_tokens(words, token_grammar.vocab_size)).tolist() == [token_grammar.eos_id]
    assert matcher.accept(token_grammar.eos_id)


def test_disallowed_tokens_are_rejected_without_harm(austen):
    tokenizer, token_grammar = austen
    matcher = grammar.Matcher(token_grammar.compile_grammar("json_object"))
    sp = tokenizer.sp
    for token in [sp.piece_to_id("\u2581the"), sp.piece_to_id("<0x5B>"), token_grammar.eos_id, sp.bos_id(),
                  sp.vocab_size() + 3, token_grammar.vocab_size, -1]:
        assert not matcher.accept(token)
    for token in tokenizer.encode('{"a": [1, 2]}'):  # the matcher still works after the rejections
        assert matcher.accept(token)
    assert matcher.done


def test_one_leading_space_is_allowed(austen):
    tokenizer, token_grammar = austen
    compiled = token_grammar.compile_grammar("json_object")
    space = tokenizer.sp.piece_to_id("\u2581")
    matcher = grammar.Matcher(compiled)
    assert matcher.accept(space) and not matcher.accept(space)
    assert all(matcher.accept(t) for t in tokenizer.encode('{"a": 1}')) and matcher.done


@pytest.mark.parametrize("kind, schema, message", [
    ("json_schema", {"type": "strin"}, "Invalid type"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    ("json_schema", {"type": "string", "pattern": "(["}, "regex"),
    ("json_schema", {"not": {"type": "string"}}, "not"),
    ("json_schema", {"type": "string", "format": "no-such-format"}, "format"),
    ("json_schema", {"x": {1, 2}}, "not JSON"),
    ("json_schema", None, "schema"),
    ("json_schema", [1], "schema"),
    ("json_object", {"type": "object"}, "no schema"),
    ("text", None, "not one of"),
])
def test_bad_schemas_raise_value_error(austen, kind, schema, message):
    with pytest.raises(ValueError, match=message):
        austen[1].compile_grammar(kind, schema)


def test_compiled_grammars_are_cached_by_schema_with_lru_bound(austen, monkeypatch):
    token_grammar = austen[1]
    first = token_grammar.compile_grammar("json_schema", PERSON)
    assert token_grammar.compile_grammar("json_schema", json.loads(json.dumps(PERSON))) is first
    # property order decides the order they are written in, so it is part of the key
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    assert token_grammar.compile_grammar("json_schema", reordered) is not first
    monkeypatch.setattr(grammar, "MAX_COMPILED", 2)
    for n in range(3):
        token_grammar.compile_grammar("json_schema", {"type": "object", "properties": {f"p{n}": {"type": "integer"}}})
    assert len(token_grammar._compiled) == 2 and token_grammar.compile_grammar("json_schema", PERSON) is not first


def test_compiling_in_threads_while_matching(austen):
    tokenizer, token_grammar = austen
    schemas = [{"type": "object", "properties": {f"k{n}": {"type": "string"}}, "required": [f"k{n}"]} for n in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(lambda s: token_grammar.compile_grammar("json_schema", s), schemas * 3))
        matchers = list(pool.map(grammar.Matcher, compiled))
    for n, matcher in enumerate(matchers[:8]):
        assert all(matcher.accept(t) for t in tokenizer.encode(json.dumps({f"k{n}": "x"}))) and matcher.done


def test_batched_masks_match_single_masks(austen):
    tokenizer, token_grammar = austen
    matchers = [grammar.Matcher(token_grammar.compile_grammar("json_schema", s)) for s in (PERSON, ORDER, ANY_OBJECT)]
    for m, prefix in zip(matchers, ('{"name": "Ann', '{"id": 3, "address": {', '{"x": [')):
        assert all(m.accept(t) for t in tokenizer.encode(prefix))
    batch = np.full((5, token_grammar.num_words), 7, np.int32)
    grammar.fill_masks([(0, matchers[0]), (2, matchers[1]), (3, matchers[2])], batch)
    for row, m in zip((0, 2, 3), matchers):
        single = np.zeros(token_grammar.num_words, np.int32)
        m.fill_mask(single)
        np.testing.assert_array_equal(batch[row], single)
    assert (batch[[1, 4]] == 7).all()  # rows without a matcher are left alone


def test_mask_layout_and_host_application():
    # token t is allowed iff (words[t >> 5] >> (t & 31)) & 1: tokens 0, 2, 31 (the sign bit) and 39
    words = np.array([0b101 | -(1 << 31), 1 << 7], np.int32)
    assert np.flatnonzero(grammar.allowed_tokens(words, 40)).tolist() == [0, 2, 31, 39]
    assert np.flatnonzero(grammar.allowed_tokens(words.view(np.uint32), 40)).tolist() == [0, 2, 31, 39]
    logits = np.arange(40, dtype=np.float32)
    masked = grammar.apply_bitmask_numpy(logits, words)
    assert masked.dtype == np.float32
    assert np.isfinite(masked).nonzero()[0].tolist() == [0, 2, 31, 39] and masked[31] == 31.0
    batched = grammar.apply_bitmask_numpy(np.zeros((3, 40), np.float32), words)
    assert (np.isfinite(batched).sum(axis=1) == 4).all()


def test_fill_mask_checks_the_array(austen):
    matcher = grammar.Matcher(austen[1].compile_grammar("json_object"))
    for bad in (np.zeros(matcher.num_words, np.int64), np.zeros(matcher.num_words - 1, np.int32),
                np.zeros((matcher.num_words, 2), np.int32)[:, 0]):
        with pytest.raises(ValueError, match="mask"):
            matcher.fill_mask(bad)


def nested(levels, leaf=None):
    """``levels`` objects, each the only property ``a`` of the one around it."""
    schema = leaf or {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_too_deep_is_refused_before_anything_walks_it(austen):
    """Deeper than Python's own parser and json.dumps go (a RecursionError was a 500), and just past
    the limit: a ValueError naming it; within it, compiled."""
    from runner import schema as schema_checks

    for levels in (5000, schema_checks.MAX_DEPTH // 2 + 1):
        with pytest.raises(ValueError, match=f"nests more than {schema_checks.MAX_DEPTH} levels"):
            austen[1].compile_grammar("json_schema", nested(levels))
    austen[1].compile_grammar("json_schema", nested(schema_checks.MAX_DEPTH // 2 - 2))
    assert schema_checks.nesting_depth(nested(3), 100) == 7  # 3 x (schema, properties) + the leaf
    assert schema_checks.nesting_depth(nested(5000), 100) == 101  # the walk stops past the limit


ENDLESS = {  # no finite document satisfies any: llguidance compiles each
    "ref-root": {"$ref": "#"},
    "defs-cycle": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    "allOf-self": {"allOf": [{"$ref": "#"}]},
    "anyOf-self": {"anyOf": [{"$ref": "#"}]},
    "required-self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "minItems-self": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "prefixItems-self": {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
    "pattern-self": {"type": "object", "patternProperties": {"^a": {"$ref": "#"}}, "required": ["ab"]},
    "additional-self": {"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["x"]},
    "definitions": {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}},
    "mutual-required": {"$ref": "#/$defs/a", "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
}


@pytest.mark.parametrize("name", list(ENDLESS))
def test_a_schema_no_finite_document_satisfies_is_refused(austen, name):
    """Such a schema answered 200 with " " (the engine masked all but EOS after the optional
    space), or let the model open {"a": {"a": ... until its budget ran out."""
    with pytest.raises(ValueError, match="no finite JSON document satisfies the schema: '#"):
        austen[1].compile_grammar("json_schema", ENDLESS[name])


RECURSIVE = {  # recursion with a way out: served, and what is written validates
    "linked-list": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
                    "required": ["v"], "additionalProperties": False},
    "tree": {"$ref": "#/$defs/t", "$defs": {"t": {"anyOf": [
        {"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 2, "maxItems": 3}]}}},
    "nullable-self": {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                      "additionalProperties": False},
    "untyped-required-self": {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # any non-object is valid
    "mutual-with-base": {"$ref": "#/$defs/a", "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"],
              "additionalProperties": False},
        "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string", "maxLength": 5}]}}},
}


@pytest.mark.parametrize("name", list(RECURSIVE))
def test_recursive_schemas_with_a_way_out_are_served(austen, name):
    check_walks(*austen, "json_schema", RECURSIVE[name], seeds=range(3))


def optional_properties(n):
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


@pytest.mark.parametrize("schema", [optional_properties(500), optional_properties(2000),
                                    {"anyOf": [{"type": "object", "properties": {f"q{i}": {"type": "integer"}},
                                                "required": [f"q{i}"]} for i in range(2000)]}],
                         ids=["500-optional", "2000-optional", "anyOf-2000-objects"])
def test_wide_schemas_are_served_and_what_is_written_validates(austen, schema):
    """An object of 500 optional properties was a 500 ("the JSON grammar refused token 128 that
    its own mask allowed"): llguidance checks a row's size against max_items_in_row only when a
    token is consumed, not when a mask is computed. Rows may now hold a step's item budget, which
    the mask does check: what a mask allows is consumed (``walk`` asserts it at every token)."""
    check_walks(*austen, "json_schema", schema, seeds=range(2))


WIDE_ARRAYS = {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": i}} for i in range(2100)]}


@pytest.mark.parametrize("schema", [WIDE_ARRAYS, {"type": "array", "items": WIDE_ARRAYS}], ids=["top", "first-item"])
def test_a_schema_too_wide_for_a_step_is_refused_when_compiled(austen, schema):
    """Past a step's item budget at its first rows (after "[" and "[["): refused now, not once generating."""
    with pytest.raises(ValueError, match="cannot serve the JSON schema: .*Too many items"):
        austen[1].compile_grammar("json_schema", schema)


def test_a_schema_too_wide_deeper_in_fails_its_matcher_not_silently(austen):
    """Deeper than the compile-time probe: the mask computed there is the engine's error, and then
    only EOS is allowed, which ``accept`` refuses (the document is not complete): the engine core
    turns that into the request's error (runner/core.py), never an end that looks like success."""
    tokenizer, token_grammar = austen
    schema = {"type": "object", "properties": {"a": WIDE_ARRAYS}, "required": ["a"], "additionalProperties": False}
    matcher = grammar.Matcher(token_grammar.compile_grammar("json_schema", schema))
    assert all(matcher.accept(t) for t in tokenizer.encode('{"a": [')) and not matcher.error
    words = np.zeros(matcher.num_words, np.int32)
    matcher.fill_mask(words)
    assert "Too many items" in matcher.error and "\n" not in matcher.error
    assert np.flatnonzero(grammar.allowed_tokens(words, token_grammar.vocab_size)).tolist() == [token_grammar.eos_id]
    assert not matcher.accept(token_grammar.eos_id)
