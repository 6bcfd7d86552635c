"""Structured output: grammars turned into next-token masks (``Request.json_schema``).

A request with a JSON schema (``{"type": "object"}`` for any object) or a Lark grammar (``lark``:
the server's regex, choice, grammar and forced tool calls) gets a ``Matcher``. Each decode step the
engine asks it for a bitmask of the allowed next tokens, masks the logits on device, samples, and
feeds the sampled token back with ``accept``. When the output is complete (``done``: only EOS may
follow) the engine ends the request at once (``runner/outputs.py``).

The grammar engine is llguidance (an Earley parser over a lexer, walking a trie of the vocabulary
for each mask). The three maintained engines, measured on a shared, loaded 2-core CPU (so +-50%):
200 tokens for each of three schemas (flat object with enum and array, nested objects, any object),
mask + accept per token in microseconds, mean / p99, feeding known-valid JSON or random walks
over the allowed tokens:

    engine              install              vocab 8k (austen-moe)           vocab 131k (Grok-1)
                                             compile    valid JSON  random      compile   valid JSON  random
    llguidance 1.9.1    7.6 MB, no deps      1 ms       10 / 60     20 / 140    2 ms      25 / 120    90 / 280
    xgrammar 0.2.9      5.7 GB: torch+CUDA,  3 ms       5 / 10      12 / 80     30 ms     30 / 120    250 / 4200
                        triton, transformers
    outlines-core 0.2   5.3 MB               10 ms-7 s  8 / 27      15 / 70     0.6-15 s  80 / 300    300 / 4400

xgrammar is fastest on the small vocabulary but needs torch (a CUDA build) in a JAX project;
outlines-core compiles each schema to a regex DFA over the whole vocabulary (7 s and 15 s for "any
object", and only to a bounded nesting depth). llguidance compiles in milliseconds, handles
recursive JSON, has no dependencies, and has the lowest tail at 131k tokens (still well under a
decode step).

The bitmask, shared with the device side: int32 words ``words[ceil(V / 32)]``; token t is allowed iff

    (words[t >> 5] >> (t & 31)) & 1

(little-endian bit order within a word; ids beyond the tokenizer's pieces are never allowed).

Formatting: a schema may set llguidance's spacing options itself, in its ``x-guidance``
(``JSON_OPTIONS``: ``whitespace_flexible``, ``whitespace_pattern``, ``item_separator``,
``key_separator``); the server sets them for every JSON output it asks for: compact (``COMPACT``)
unless a request gives ``guided_whitespace_pattern``. A schema without them gets ``_WHITESPACE``:
whitespace allowed but bounded, so a model can pretty-print yet cannot loop on spaces forever. One
optional leading space is allowed before a JSON document because a SentencePiece model usually
starts its reply with a ``▁``-prefixed piece (``▁{"``); a Lark grammar gets none it does not write
itself.

A Lark grammar travels in ``Request.json_schema`` as ``{LARK_KEY: source}`` (``lark``), the one
field a request has for the rules of its output; ``LARK_KEY`` is no JSON-schema keyword, and the
server refuses a schema that uses it.

Threads: ``TokenGrammar.compile_grammar`` and ``Matcher(...)`` may run in server worker threads
(the cache and the template copy are locked); after that a ``Matcher`` belongs to the engine's
thread, which calls ``fill_mask`` and ``accept`` (llguidance releases the GIL while it computes a
mask, and calls back into ``_Pieces`` for the bytes a grammar forces).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import threading

import llguidance
import numpy as np

from runner import schema as schema_checks

KINDS = ("json_object", "json_schema")
MAX_COMPILED = 64  # compiled grammars kept per tokenizer (LRU)
# A schema that sets no spacing of its own: between any two JSON tokens nothing, one space, or one
# line break and an indent of up to 16 spaces or tabs: room for compact and pretty-printed JSON,
# none for runs of blank lines (a small model, the shipped one among them, otherwise spends its
# budget on newlines: measured, 3 of 3 schemas ended by length at 200 tokens with up to 20
# whitespace characters a gap)
_WHITESPACE = r"(\x20|\x0D?\x0A[\x20\x09]{0,16})?"
# llguidance's JSON options (a schema's "x-guidance") that say how the JSON is spaced; the others
# (lenient: unknown keywords ignored, coerce_one_of: oneOf read as anyOf) would loosen the schema
JSON_OPTIONS = ("whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator")
# No whitespace between JSON tokens, ',' and ':' alone: the server's default. Measured on the
# shipped model, 8 seeds of each of three schemas at 200 tokens (a flat object; an array of objects
# beside a number of unbounded digits; a boolean and a patterned string): with _WHITESPACE, 8, 5
# and 8 ended, in 110, 178 and 75 tokens on average; compact, 8, 1 and 8, in 34, 179 and 21 (the
# number: compact, no space can end it, and this model writes digits; bound its digits).
COMPACT = {"whitespace_flexible": False}
LARK_KEY = "x-lark"  # {LARK_KEY: source}: a Lark grammar, not a JSON schema (see the module docstring)
_JSON_SPACE = r"[\x20\x09\x0A\x0D]*"  # what JSON allows between its tokens (RFC 8259, section 2)
# llguidance's limits, with one changed. Its Earley parser checks the items of a new row against
# max_items_in_row (default 2,000) only when a token is consumed, never while it computes a mask, so
# a mask can allow a token whose row then breaks the limit: an object of 500 optional properties
# opens a row of 4 items each after its "{", which the mask allowed and the matcher then refused
# (measured: 497 properties served, 499 refused; anyOf of 2,000 objects, likewise). The work of one
# mask is bounded by step_max_items (50,000 items), which the mask computation does check, so rows
# are allowed that many items as well: what the mask allows can then be consumed, and a schema too
# wide for a step fails while its mask is computed (a clear error, see TokenGrammar._probe), never
# after it.
_STEP_ITEMS = llguidance.LLParserLimits().step_max_items
_LIMITS = llguidance.LLParserLimits(verbose_errors=False,  # short errors: they go back to clients as 400s
                                    max_items_in_row=_STEP_ITEMS)


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# ---- constraints as requests carry them, and the checks that need no tokenizer ------------------
def lark(source: str) -> dict:
    """The ``Request.json_schema`` of a Lark grammar (llguidance's dialect, which embeds JSON
    schemas as ``%json {...}``): the output is a string the grammar's ``start`` rule matches."""
    if not isinstance(source, str):
        raise TypeError(f"a Lark grammar is text, got {type(source).__name__}")
    return {LARK_KEY: source}


def is_lark(constraint) -> bool:
    return isinstance(constraint, dict) and LARK_KEY in constraint


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def lark_regex(pattern: str) -> str:
    """``pattern`` (llguidance's regex syntax, Rust's ``regex`` crate) as a Lark regex token."""
    return "/" + llguidance.regex_to_lark(pattern, "") + "/"


def lark_json(schema: dict) -> str:
    """A JSON schema embedded in a Lark rule: a JSON value the schema accepts (its own document:
    its ``$ref``s resolve in it)."""
    return "%json " + json.dumps(schema, ensure_ascii=False, allow_nan=False)


def _remembered(check):
    """``check`` (of one text; ValueError naming what is wrong) with its verdicts on the last 256
    texts kept: a client sends the same tools, regex or grammar with each request, and a check
    costs the server's event loop 1 to 3 ms."""
    @functools.lru_cache(maxsize=256)
    def verdict(text: str):
        try:
            check(text)
        except ValueError as e:
            return str(e)
        return None

    @functools.wraps(check)
    def checked(text) -> None:
        if not isinstance(text, str):
            return check(text)
        message = verdict(text)
        if message is not None:
            raise ValueError(message)
    return checked


@_remembered
def check_lark(source: str) -> None:
    """``ValueError`` naming the problem (and where: ``at line(column)``) if llguidance cannot
    compile the Lark grammar."""
    if not isinstance(source, str):
        raise ValueError(f"a grammar is text, got {type(source).__name__}")
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(source), limits=_LIMITS)
    if error:
        raise ValueError(f"cannot compile the grammar: {_one_line(error)}")


@_remembered
def check_regex(pattern: str) -> None:
    """``ValueError`` naming the problem if ``pattern`` is not a regex llguidance reads."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex is text, got {type(pattern).__name__}")
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern), limits=_LIMITS)
    if error:  # its position is in the Lark rule llguidance wraps the regex in: left out
        raise ValueError(f"not a regex llguidance reads: {_one_line(error, position=False)}")


def check_schema(schema: dict) -> dict:
    """What can be checked of a JSON schema without a tokenizer: its depth, JSON, options,
    llguidance's compile, and a finite document; ``ValueError`` naming the problem. The schema
    as it will be compiled: with its spacing options (``_WHITESPACE`` if it gives none)."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    schema_checks.check_depth(schema)  # before anything walks it with recursion (json.dumps, llguidance)
    options = schema.get("x-guidance", {"whitespace_pattern": _WHITESPACE})
    if not isinstance(options, dict) or set(options) - set(JSON_OPTIONS):
        raise ValueError(f"x-guidance: only llguidance's spacing options {list(JSON_OPTIONS)} are taken, got "
                         f"{options!r}")
    schema = {**schema, "x-guidance": options}
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"schema is not JSON: {e}") from None
    _check_schema_text(text)
    return schema


@_remembered
def _check_schema_text(text: str) -> None:
    schema = json.loads(text)
    # the schema alone first: its errors read without the Lark wrapper around them
    try:
        plain = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. an integer past 64 bits
        raise ValueError(f"cannot compile the JSON schema: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(plain, limits=_LIMITS)
    if error:
        raise ValueError(f"cannot compile the JSON schema: {_short(error)}")
    schema_checks.check_satisfiable(schema)  # what llguidance compiles but no document satisfies


@_remembered
def check_whitespace(pattern: str) -> None:
    """``ValueError`` unless ``pattern`` (a regex for the whitespace between JSON tokens) is a
    valid regex whose every match is JSON whitespace (space, tab, CR, LF): anything else there
    would make the output invalid JSON. Decided by llguidance over a vocabulary of single bytes:
    the pattern's matches that are not JSON whitespace must be no string at all, so no byte may
    start one."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"expected a non-empty regex, got {pattern!r}")
    check_regex(pattern)
    beyond = llguidance.LLMatcher.grammar_from_lark(f"start: BEYOND\nBEYOND: {lark_regex(pattern)} & "
                                                    f"~{lark_regex(_JSON_SPACE)}")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), beyond, log_level=0, limits=_LIMITS)
    if matcher.is_error():
        raise ValueError(f"the grammar engine cannot read it: {_one_line(matcher.get_error())}")
    words = np.zeros(num_mask_words(257), np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    # an empty language: llguidance finds no token at all and says so (NoExtensionBias)
    if matcher.is_error() and "NoExtensionBias" not in matcher.get_error():
        raise ValueError(f"the grammar engine cannot read it: {_one_line(matcher.get_error())}")
    if not matcher.is_error() and allowed_tokens(words, 256).any():
        raise ValueError(f"{pattern!r} matches more than JSON whitespace (spaces, tabs, line breaks); the output "
                         "would not be JSON")


class _Bytes:
    """A vocabulary of the 256 bytes and an EOS, for questions about languages, not models."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff</s>"]

    def __call__(self, text) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_BYTE_TOKENIZER: llguidance.LLTokenizer | None = None


def _byte_tokenizer() -> llguidance.LLTokenizer:
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:  # a race builds two equal ones: harmless
        _BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=256)
    return _BYTE_TOKENIZER


class _Pieces:
    """The vocabulary as llguidance's ``TokenizerWrapper`` reads it: the bytes of every id.

    A token's bytes are its text's (``tokenization.Tokenizer.token_bytes``: a byte-fallback piece
    or a byte-level token is its byte, SentencePiece's ``▁`` a space); special tokens (and
    SentencePiece's unknown piece) are special (llguidance marks them with a leading 0xFF byte,
    so no text can produce them), and ids past the tokenizer's (a model vocabulary padded beyond
    it) are empty, never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
        unknown = getattr(tokenizer, "is_unknown", lambda i: False)
        self.tokens, self.special_token_ids, plain = [], [], []
        for i in range(tokenizer.vocab_size):
            if tokenizer.is_special(i) or unknown(i):
                self.tokens.append(b"\xff" + tokenizer.special_text(i).encode()
                                   if tokenizer.is_special(i) else b"\xff" + bytes(tokenizer.token_bytes(i)))
                self.special_token_ids.append(i)
            else:
                self.tokens.append(bytes(tokenizer.token_bytes(i)))
                plain.append(i)
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        byte_ids = tokenizer.byte_ids()
        if byte_ids is None:
            raise ValueError("structured output needs a tokenizer that spells every byte (byte fallback pieces "
                             "<0x00>..<0xFF>, or a byte-level BPE)")
        self.byte_ids = byte_ids
        single = set(byte_ids)
        self.piece_of = {}  # bytes -> the first normal piece spelling them (not a lone byte's id)
        for i in plain:
            if i not in single or len(self.tokens[i]) != 1:
                self.piece_of.setdefault(self.tokens[i], i)
        for b, i in enumerate(byte_ids):
            self.piece_of.setdefault(bytes([b]), i)
        self.dummy_prefix = self._bytes(tokenizer.encode("x")) == b" x"  # Grok-1's tokenizer: yes

    def _bytes(self, ids) -> bytes:
        return b"".join(self.tokens[i] for i in ids)

    def __call__(self, text: str) -> list[int]:
        """Ids whose bytes are exactly ``text``: llguidance tokenizes the bytes a grammar forces.

        SentencePiece's dummy prefix would put a space in front (and llguidance would then allow a
        token that it cannot apply), so the first piece loses that space; should the bytes still
        differ from ``text`` (a normalizer rewrote it), ``text`` is spelled in byte pieces.
        """
        if not isinstance(text, str):
            raise TypeError("tokenize text, not bytes")  # TokenizerWrapper then passes str
        data, ids = text.encode(), self.tokenizer.encode(text)
        if self.dummy_prefix and ids and self._bytes(ids) == b" " + data:
            first = self.tokens[ids[0]][1:]  # the first piece without the prefix space
            ids = self._spell(first) + ids[1:]
        return ids if self._bytes(ids) == data else [self.byte_ids[b] for b in data]

    def _spell(self, data: bytes) -> list[int]:
        return [self.piece_of[data]] if data in self.piece_of else [self.byte_ids[b] for b in data]


class CompiledGrammar:
    """One grammar bound to one vocabulary: a matcher at the start, copied for each request.

    Building a matcher builds its lexer over the vocabulary (0.3-5 ms); a deep copy of a fresh one
    takes a few microseconds, so requests with the same schema share that work.
    """

    def __init__(self, kind: str, template: llguidance.LLMatcher, vocab_size: int, eos_id: int):
        self.kind, self.vocab_size, self.eos_id = kind, vocab_size, eos_id
        self._template, self._lock = template, threading.Lock()

    def new_matcher(self) -> llguidance.LLMatcher:
        with self._lock:  # copies may be made in several server threads at once
            return self._template.deep_copy()


class TokenGrammar:
    """llguidance's view of one tokenizer and model vocabulary, and the grammars compiled for it."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        size = tokenizer.vocab_size
        if vocab_size < size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {size} pieces")
        if not 0 <= eos_id < size:
            raise ValueError(f"eos_id {eos_id} is not a tokenizer piece (0..{size - 1})")
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.num_words = num_mask_words(vocab_size)
        self.pieces = _Pieces(tokenizer, vocab_size, eos_id)
        wrapper = llguidance.TokenizerWrapper(self.pieces)
        self.ll_tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos_id)
        self._compiled: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile_grammar(self, kind: str, schema: dict | None = None) -> CompiledGrammar:
        """The grammar of a structured output: "json_object" (any object) or "json_schema"
        (``schema``: a JSON schema, or a Lark grammar as ``lark`` makes it).

        Raises ValueError naming the problem when the schema cannot be compiled or served (nested
        too deep, no finite document satisfies it, unknown type, unsupported keyword, dangling
        $ref, unsatisfiable constraints, bad regex pattern, too wide for the engine's step; a Lark
        grammar that does not compile or that no text matches).
        """
        if kind not in KINDS:
            raise ValueError(f"response_format type {kind!r} is not one of {KINDS}")
        if kind == "json_object":
            if schema is not None:
                raise ValueError("json_object takes no schema; use json_schema")
            schema = {"type": "object"}
        elif not isinstance(schema, dict):
            raise ValueError(f"json_schema needs a schema object, got {type(schema).__name__}")
        if is_lark(schema):
            if set(schema) != {LARK_KEY} or not isinstance(schema[LARK_KEY], str):
                raise ValueError(f"a Lark grammar is {{{LARK_KEY!r}: source}} alone, got the keys {sorted(schema)}")
        else:
            schema_checks.check_depth(schema)  # before anything walks it with recursion (json.dumps, llguidance)
        try:
            # property order is kept, not sorted: it is the order the properties are generated in
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"schema is not JSON: {e}") from None
        key = (kind, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(kind, schema)  # outside the lock: other threads keep compiling
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, kind: str, schema: dict) -> CompiledGrammar:
        if is_lark(schema):
            check_lark(schema[LARK_KEY])
            source, what = schema[LARK_KEY], "grammar"
        else:
            schema = check_schema(schema)
            # the JSON grammar allows no leading whitespace; a Lark rule in front allows one space
            source, what = f"start: /[ ]?/ json\njson: {lark_json(schema)}", "JSON schema"
        template = llguidance.LLMatcher(self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(source),
                                        log_level=0, limits=_LIMITS)
        if template.is_error():
            raise ValueError(f"cannot compile the {what}: {_short(template.get_error())}")
        self._probe(template, depth=0 if is_lark(schema) else 2)
        return CompiledGrammar(kind, template, self.vocab_size, self.eos_id)

    def _probe(self, template: llguidance.LLMatcher, depth: int = 2) -> None:
        """The first masks a request will need, computed now: at the start, and (``depth`` 2, a
        JSON document) after the tokens that open the document (``{``, ``[``, with or without the
        leading space, one token for each spelling), and after those that open its first element
        (``[{``). A grammar the engine cannot start (no document at all, or a first object or
        array wider than a step's item budget) is then this request's ValueError rather than an
        error once it generates. Deeper rows are not probed: an engine error there ends its
        request alone, as the schema's fault (runner/outputs.py)."""
        words = np.zeros(self.num_words, np.int32)
        what = "JSON schema" if depth else "grammar"

        def allowed(matcher) -> list[int]:
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            if matcher.is_error():
                raise ValueError(f"cannot serve the {what}: the grammar engine failed on its first tokens "
                                 f"({_short(matcher.get_error())}){_hint(matcher.get_error())}")
            ids = np.flatnonzero(allowed_tokens(words, self.vocab_size)).tolist()
            if not set(ids) - {self.eos_id} and not matcher.is_accepting():
                raise ValueError("no JSON document satisfies the schema (the grammar engine finds no token to "
                                 "start one)" if depth else "no text matches the grammar (the grammar engine finds "
                                 "no token to start one)")
            return ids

        def open_(matcher, levels: int) -> None:
            openings = {}  # spelling -> one token spelling it
            for token in allowed(matcher):
                spelled = self.pieces.tokens[token]
                if spelled.strip(b" ") in (b"{", b"["):
                    openings.setdefault(spelled, token)
            for spelled, token in openings.items() if levels else ():
                inside = matcher.deep_copy()
                if inside.try_consume_tokens([token]) != 1 or inside.is_error():
                    raise ValueError(f"cannot serve the JSON schema: the grammar engine refused its opening "
                                     f"{spelled.decode()!r} ({_short(inside.get_error())}){_hint(inside.get_error())}")
                if levels > 1:
                    open_(inside, levels - 1)
                else:
                    allowed(inside)

        open_(template.deep_copy(), depth)


def _hint(error: str) -> str:
    """What to do about an engine limit, for the client reading the 400."""
    if "Too many items" not in error:
        return ""
    return ("; the schema is too wide for one step of the engine: thousands of optional properties in one object, "
            "or of anyOf branches, are (list properties in required, or split the schema)")


def _one_line(error: str, position: bool = True) -> str:
    """llguidance's error about a grammar in one line: its first (``at line(column): ...``,
    without the position if ``position`` is False) and the regex parser's reason, if any, without
    the listing of the source that follows."""
    lines = [line.strip() for line in error.strip().splitlines()]
    first = lines[0] if position else re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    reason = next((line[len("error: "):] for line in lines if line.startswith("error: ")), None)
    return f"{first} {reason}" if reason else first


def _short(error: str) -> str:
    """llguidance's error without the parser state or backtrace it may append."""
    return error.split("\n<", 1)[0].strip()


_TOKEN_GRAMMARS: dict[tuple, TokenGrammar] = {}
_TOKEN_GRAMMARS_LOCK = threading.Lock()


def for_tokenizer(tokenizer, vocab_size: int) -> TokenGrammar:
    """The ``TokenGrammar`` of a tokenizer file and model vocabulary, built once (50 ms for 8k pieces, 1 s for 131k)."""
    key = (os.path.realpath(tokenizer.path), vocab_size)
    with _TOKEN_GRAMMARS_LOCK:
        if key not in _TOKEN_GRAMMARS:
            _TOKEN_GRAMMARS[key] = TokenGrammar(tokenizer, vocab_size, tokenizer.eos_id)
        return _TOKEN_GRAMMARS[key]


class Matcher:
    """One request's position in its grammar; used by one thread (the engine's)."""

    def __init__(self, compiled: CompiledGrammar):
        self.vocab_size, self.eos_id = compiled.vocab_size, compiled.eos_id
        self.num_words = num_mask_words(compiled.vocab_size)
        self._matcher = compiled.new_matcher()

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into ``words`` (int32 or uint32, ``num_words`` long, contiguous)."""
        if words.dtype not in (np.int32, np.uint32) or words.shape != (self.num_words,) or not words.flags.c_contiguous:
            raise ValueError(f"mask must be a contiguous int32[{self.num_words}], got {words.dtype}{list(words.shape)}")
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it here."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            return False
        if token == self.eos_id:  # try_consume_tokens never takes EOS; EOS ends a complete document
            return self._matcher.is_accepting() and self._matcher.consume_token(token)
        # unlike consume_token, a rejected token leaves the matcher as it was (and logs nothing)
        return self._matcher.try_consume_tokens([token]) == 1

    @property
    def done(self) -> bool:
        """The JSON is complete and nothing but EOS may follow (also after EOS, or on an engine error)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """The engine's error, if it gave up (e.g. a parser limit); empty otherwise."""
        return _short(self._matcher.get_error())


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_masks(rows: list[tuple[int, Matcher]], words_BW: np.ndarray) -> None:
    """``fill_mask`` for several requests at once, in llguidance's thread pool: row b of ``words_BW``."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    batch, num_words = words_BW.shape
    if words_BW.dtype not in (np.int32, np.uint32) or not words_BW.flags.c_contiguous:
        raise ValueError(f"masks must be a contiguous int32 array, got {words_BW.dtype}")
    for b, m in rows:
        if m.num_words != num_words or not 0 <= b < batch:
            raise ValueError(f"row {b} of a {batch}x{num_words} mask does not fit a {m.num_words}-word matcher")
    _EXECUTOR.unsafe_compute_mask_ptr([(m._matcher, b) for b, m in rows], words_BW.ctypes.data, num_words * 4, batch)


def allowed_tokens(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[vocab_size] from the bitmask, by the rule in the module docstring."""
    t = np.arange(vocab_size)
    return ((words.view(np.int32)[t >> 5] >> (t & 31)) & 1).astype(bool)


def apply_bitmask_numpy(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """``logits[..., V]`` with the disallowed tokens set to -inf (host side, for tests)."""
    allowed = allowed_tokens(words, logits.shape[-1])
    return np.where(allowed, logits, -np.inf).astype(logits.dtype)
