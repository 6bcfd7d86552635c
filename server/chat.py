"""Chat messages rendered into one prompt.

A checkpoint may ship its own template: ``chat_template.jinja`` in the checkpoint directory; the
server may be given one (``ChatTemplate.from_file``: a Jinja2 file, or a Hugging Face
``tokenizer_config.json`` holding one). Without one, the plain default below is used: a ``Role:
content`` line per message and a final ``Assistant:`` to complete, which a model trained on prose
can continue.

A template is rendered as Hugging Face's ``apply_chat_template`` renders it, so that the templates
published beside models work unchanged: Jinja2's sandbox (no attribute access to Python internals,
no file or module access) with ``trim_blocks``, ``lstrip_blocks`` and loop controls, an undefined
name rendering as nothing (templates test ``message.tool_calls`` on messages that have none),
``tojson`` without HTML escaping, and these names:

- ``messages``: dicts with ``role`` and ``content`` (text, or None), and where the message has
  them ``name``, ``tool_call_id`` and ``tool_calls`` (``[{"id", "type": "function", "function":
  {"name", "arguments"}}]``, the arguments as a dict: what Hugging Face's templates expect);
- ``tools``: the request's tools (``[{"type": "function", "function": {...}}]``) or None;
- ``add_generation_prompt``; ``bos_token`` and ``eos_token`` (the tokenizer's BOS and EOS);
- ``raise_exception(message)``: the template refuses the messages (a 400 with its message);
- ``strftime_now(format)``: the date, as some templates print it;
- a request's ``chat_template_kwargs``, under their own names.

The ``bos_token`` and ``eos_token`` a template writes become the tokenizer's ids
(``ChatTemplate.prompt``), not the characters of their pieces: SentencePiece never reads a control
piece from text.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import threading
import time
from typing import Optional

import jinja2
import jinja2.ext
import jinja2.sandbox

TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = (  # a tool call as its JSON ({"name": ..., "arguments": {...}}) after its message's text
    "{% for m in messages %}{{ m.role | capitalize }}: {% if m.content %}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls or [] %}{{ call.function | tojson }}{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Grok-2's chat format, as sglang's TiktokenTokenizer (srt/tokenizer/tiktoken_tokenizer.py) and vLLM's
# Grok2Tokenizer write it: the release ships no template, and this is what both servers apply
GROK2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'Human: ' + message['content'].strip() + '<|separator|>\n\n' }}"
    "{% elif message['role'] == 'system' %}{{ 'System: ' + message['content'].strip() + '<|separator|>\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + '<|separator|>\n\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# the names the server gives a template; a request's chat_template_kwargs may not replace them
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
            "strftime_now")


# A render's budgets (``ChatTemplate(time_budget=..., output_budget=...)``, ``serve
# --chat-template-seconds`` and ``--chat-template-chars``): a template comes from a checkpoint or a
# file, and rendering runs its loops on the server's host. A chat prompt longer than the longest
# context (Grok-2's 131,072 tokens are under a million characters) is of no use, and a template
# renders a conversation in milliseconds: 1 s and 4,000,000 characters stop a hostile one
# (nested ``range`` loops, ``''.ljust(10**10)``, ``tojson(indent=10**9)``) long before it costs.
TIME_BUDGET = 1.0
OUTPUT_BUDGET = 4_000_000
MAX_INDENT = 64  # tojson's indent: templates indent by 2 or 4


class _Refusal(Exception):
    """The template called ``raise_exception``."""


class _OverBudget(Exception):
    """A render went past its time or output budget."""


class _Budget:
    """One render's deadline and character budget, checked at every call, operator and
    attribute the sandbox sees, and on the output as it is produced."""

    def __init__(self, seconds: float, chars: int):
        self.deadline, self.chars, self.seconds = time.monotonic() + seconds, chars, seconds

    def tick(self):
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"took longer than its {self.seconds:g} s budget")

    def size(self, n: int, what: str):
        if n > self.chars:
            raise _OverBudget(f"{what} of {n:,} characters is over its budget of {self.chars:,}")


_budget = threading.local()  # the render running on this thread


def _current() -> _Budget:
    budget = getattr(_budget, "value", None)
    return budget if budget is not None else _Budget(TIME_BUDGET, OUTPUT_BUDGET)


def _length(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _grown(name: str, s: str, args: tuple) -> int:
    """At most the length str method ``name`` makes of ``s`` with ``args`` (0: not one that grows
    a string to a size its arguments choose)."""
    ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    if name in ("ljust", "rjust", "center", "zfill"):
        return ints[0] if ints else 0
    if name == "expandtabs":
        return len(s) * max(1, ints[0] if ints else 8)
    if name == "replace" and len(args) > 1:  # "" replaced inserts between every character
        return (len(s) + 1) * (_length(args[1]) + 1)
    return 0


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, its operators, calls and attribute reads checked against the
    current render's ``_Budget``: sizes a result would have are refused before it is built."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context, operator, left, right):
        budget = _current()
        budget.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _length(seq) and isinstance(n, int):
                    budget.size(_length(seq) * n, "a repeated string or list")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            budget.size(right * abs(left).bit_length() // 3, "a power")  # about its decimal digits
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            budget.size(len(left) + sum(a if isinstance(a, int) and a > 0 else _length(a) for a in args),
                        "a formatted string")
        out = super().call_binop(context, operator, left, right)
        budget.size(_length(out), "a result")
        return out

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        budget = _current()
        budget.tick()
        if isinstance(getattr(__obj, "__self__", None), str):
            name = getattr(__obj, "__name__", "")
            budget.size(_grown(name, __obj.__self__, args), f"str.{name}'s result")
        out = super().call(__context, __obj, *args, **kwargs)
        budget.size(_length(out), "a result")
        return out

    def getattr(self, obj, attribute):
        _current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _current().tick()
        return super().getitem(obj, argument)


_WIDTHS = ("center", "indent", "wordwrap", "truncate", "format")  # filters given a width or a format's


def _bounded_filter(name: str, f):
    """Jinja2's filter ``name``, its result checked against the render's budget, and for those
    given a width (``_WIDTHS``) the width before it runs."""
    def bounded(*args, **kwargs):
        budget = _current()
        budget.tick()
        if name in _WIDTHS:
            for a in list(args[1:]) + list(kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool):
                    budget.size(a, f"the {name} filter's width")
        out = f(*args, **kwargs)
        budget.size(_length(out), f"the {name} filter's result")
        return out

    if hasattr(f, "jinja_pass_arg"):  # pass_context / pass_environment: the same first argument
        bounded.jinja_pass_arg = f.jinja_pass_arg
    return bounded


def _raise_exception(message):
    raise _Refusal(str(message))


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # Hugging Face's tojson: JSON as json.dumps writes it (Jinja's own escapes <, >, & and ')
    if isinstance(indent, str):
        _current().size(len(indent), "tojson's indent")
    elif indent is not None and not (isinstance(indent, int) and 0 <= indent <= MAX_INDENT):
        raise _OverBudget(f"tojson's indent must be from 0 to {MAX_INDENT}")
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_TEMPLATE, origin: str = "the default template",
                 time_budget: float = TIME_BUDGET, output_budget: int = OUTPUT_BUDGET):
        """``source`` compiled (a ValueError naming ``origin`` if it is not a template); each
        render stops past ``time_budget`` seconds or ``output_budget`` characters (a 400)."""
        self.origin, self.time_budget, self.output_budget = origin, time_budget, output_budget
        env = _Environment(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                           extensions=[jinja2.ext.loopcontrols])
        env.filters.update({name: _bounded_filter(name, f) for name, f in env.filters.items()})
        env.filters["tojson"] = _bounded_filter("tojson", _tojson)
        env.globals.pop("lipsum", None)  # lorem ipsum of any length: no chat template's need
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: not a valid Jinja2 template: {e.message} (line {e.lineno})") from None
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: not a valid Jinja2 template: {e}") from None
        except (RecursionError, MemoryError) as e:  # 5,000 nested ifs: Python's parser gives up
            raise ValueError(f"{origin}: not a usable Jinja2 template: too deeply nested to compile "
                             f"({type(e).__name__})") from None

    @classmethod
    def from_file(cls, path: str, **budgets) -> "ChatTemplate":
        """The template in ``path``: a Jinja2 file, or a Hugging Face ``tokenizer_config.json``
        (``.json``) with its ``chat_template`` (text, or a list of named templates: the one named
        "default"). Errors name the file. ``budgets``: ``time_budget`` and ``output_budget``."""
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            raise ValueError(f"{path}: cannot read the chat template: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: the chat template is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if path.endswith(".json"):
            source = cls._from_config(source, path)
        return cls(source, origin=path, **budgets)

    @staticmethod
    def _from_config(text: str, path: str) -> str:
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(f"{path}: expected a Jinja2 template, or a JSON object whose chat_template is one (or "
                             "a list of named ones with a 'default'), got no such template")
        return template

    @classmethod
    def for_checkpoint(cls, directory: str | None, **budgets) -> "ChatTemplate":
        """A checkpoint's own template: its ``chat_template.jinja``, else the ``chat_template`` of
        its ``tokenizer_config.json``, else Grok-2's format where it holds Grok-2's tokenizer
        (``tokenizer.tok.json``), else the default."""
        if not directory:
            return cls(**budgets)
        path = os.path.join(directory, TEMPLATE_FILE)
        if os.path.isfile(path):
            return cls.from_file(path, **budgets)
        config = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    data = json.loads(f.read())
            except (OSError, ValueError):
                data = None  # not a template source; from_file names the file if one is asked for
            if isinstance(data, dict) and "chat_template" in data:
                return cls.from_file(config, **budgets)
        if os.path.isfile(os.path.join(directory, "tokenizer.tok.json")):
            return cls(GROK2_TEMPLATE, origin="Grok-2's chat format (as sglang and vLLM write it)", **budgets)
        return cls(**budgets)

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
               special_tokens: Optional[dict[str, str]] = None, extra: Optional[dict] = None,
               continue_final_message: bool = False) -> str:
        """The prompt text of ``messages`` (see the module docstring for what the template is
        given; ``special_tokens``: ``bos_token`` and ``eos_token``, "" if not given).
        ``continue_final_message``: the text ends where the last message's content does (vLLM's
        option: the model continues that message). ValueError naming ``messages`` if the
        template refuses them or fails on them."""
        names = {**(extra or {}), "messages": messages, "tools": tools,
                 "add_generation_prompt": add_generation_prompt,
                 "bos_token": "", "eos_token": "", **(special_tokens or {})}
        budget = _Budget(self.time_budget, self.output_budget)
        _budget.value = budget
        try:
            parts, size = [], 0
            for part in self.template.generate(**names):
                size += len(part)
                budget.size(size, "the rendered prompt")
                budget.tick()
                parts.append(part)
            text = "".join(parts)
        except _OverBudget as e:
            raise ValueError(f"messages: {self.origin} could not render them: {e}") from None
        except (RecursionError, MemoryError) as e:
            raise ValueError(f"messages: {self.origin} could not render them: {type(e).__name__} "
                             "(a template recursing without end, or a value too large)") from None
        except _Refusal as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from None
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: {self.origin} could not render them: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # a template's own mistake on
            # these messages (``None | trim``...): still theirs to see, as a 400
            raise ValueError(f"messages: {self.origin} could not render them: {type(e).__name__}: {e}") from None
        finally:
            _budget.value = None
        if continue_final_message:
            last = messages[-1].get("content") or ""
            end = text.rfind(last) if last else -1
            if end < 0:
                raise ValueError("messages: continue_final_message: the chat template does not write the last "
                                 "message's content as it is, so it cannot be continued")
            text = text[: end + len(last)]
        return text

    def prompt(self, messages: list[dict], tokenizer, context: int, **options):
        """The prompt the server runs: ``render``'s text, or its ids where the template wrote
        ``bos_token`` or ``eos_token``: those become the tokenizer's ids (SentencePiece never reads
        a control piece from text), and only those the template wrote, never a ``<s>`` in a
        message. A text that cannot fit ``context`` tokens is returned as text, so its length is
        refused for the price of reading it (``InferenceRunner._encode``), never of encoding it."""
        marks, ids = {}, {}  # name -> its mark, mark -> its id
        for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
            if i >= 0:
                marks[name] = f"\x00{_MARK}{name}\x00"
                ids[marks[name]] = i
        text = self.render(messages, special_tokens=marks, **options)
        if not any(mark in text for mark in ids):
            return text
        found = re.compile("|".join(re.escape(mark) for mark in ids))
        plain = found.sub("", text)
        if len(plain) >= context and tokenizer.min_tokens(plain) >= context:
            return plain  # too long with or without its special tokens
        out, start = [], 0
        for match in found.finditer(text):
            if start < match.start():
                out += tokenizer.encode(text[start:match.start()])
            out.append(ids[match.group()])
            start = match.end()
        if start < len(text):
            out += tokenizer.encode(text[start:])
        return out


# what a template writes for bos_token and eos_token before they become ids (ChatTemplate.prompt):
# random, so that no message can spell them
_MARK = secrets.token_hex(16)
