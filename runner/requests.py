"""``Request`` (what a caller asks for) and ``TokenEvent`` (what ``run()`` streams back).

Field names keep Grok-1's (``prompt``, ``temperature``, ``nucleus_p``, ``rng_seed``, ``max_len``);
``top_k``, ``stop_token_ids`` and token-id prompts are additions. A request validates its own fields
on construction (a ``ValueError`` naming the field), and the runner checks what depends on the
model (vocabulary, context length) when it is submitted, before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from typing import Optional, Sequence, Union

_ids = itertools.count()

FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")
INT32_MAX = 2**31 - 1  # token ids, top_k and max_len reach the device as int32
# Seeds: any integer in [-2**63, 2**64) (an int64 or a uint64, what clients send). The PRNG key is
# the seed's 64 bits, mod 2**64, as its two uint32 words (high, low): distinct seeds of either
# range give distinct keys (a negative seed shares its bits, and its key, only with its uint64
# twin s + 2**64), and a seed below 2**32 gets jax.random.PRNGKey(seed)'s key, [0, seed].
SEED_MIN, SEED_LIMIT = -(2**63), 2**64
MAX_LOGPROBS = 20  # alternatives a token may report: the most the OpenAI API asks for
MAX_SPECULATIVE = 16  # draft tokens a speculative step may verify at most
MAX_STOP_STRINGS = 4  # stop strings a request may give (OpenAI's limit)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ids_of(field: str, value, allow_empty: bool) -> tuple[int, ...]:
    """``value`` (a list, tuple or 1-D numpy array of integers) as a tuple of ints in [0, 2**31)."""
    if hasattr(value, "ndim") and hasattr(value, "tolist"):  # numpy arrays and scalars
        if value.ndim != 1:
            raise ValueError(f"Request.{field} must be a 1-D sequence of token ids, got an array of shape "
                             f"{tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"Request.{field} must be a list of token ids, got {type(value).__name__}")
    bad = [t for t in value if not _is_int(t) or not 0 <= t <= INT32_MAX]
    if bad:
        raise ValueError(f"Request.{field} must hold integer token ids in [0, 2**31), got {bad[:5]!r}")
    if not value and not allow_empty:
        raise ValueError(f"Request.{field} is empty: expected non-empty text or token ids")
    return tuple(int(t) for t in value)


class RequestError(ValueError):
    """A request failed while being served because of its own input (``field``, a ``Request``
    field): its JSON schema took the grammar engine past a limit. Its message starts
    ``Request.<field>``, as a validation error's does; the request's error event carries ``field``
    (``TokenEvent.error_field``), so a server answers the client's mistake as one (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"Request.{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """What a caller asks for; validated completely when made, and immutable after (a field
    cannot be changed past its check: ``dataclasses.replace`` makes a new, checked request)."""

    prompt: Union[str, Sequence[int]]  # text, or token ids used as they are
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    nucleus_p: float = 1.0  # top-p in (0, 1]; 1 = off
    rng_seed: Optional[int] = None  # None: derived from request_id; the same seed, the same tokens
    max_len: int = 256  # tokens to generate at most
    top_k: int = 0  # 0 = off
    stop_token_ids: Optional[Sequence[int]] = ()  # generation ends after any of these (EOS always ends it)
    # Stop strings (vLLM's and OpenAI's ``stop``): generation ends where the text contains one; the
    # string and what follows it are not part of the output (``TokenEvent.stop_reason`` names it).
    stop: Sequence[str] = ()
    request_id: Optional[str] = None  # assigned if None; unique among the live requests of a runner
    # Log-probabilities, computed only when asked (vLLM's ``logprobs``/``prompt_logprobs``): None:
    # none; k: each generated token's log-probability and its k most likely alternatives (at most
    # ``runner.sampling.TOP_K``). ``prompt_logprobs`` does the same for each prompt token, computed
    # by the prefill on a runner made with ``score_prompts=True``.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # vLLM's sampling extras, each off at its default. Applied on the device to the model's logits
    # in vLLM's order (runner/sampling.py): the stop ids are banned until ``min_tokens`` tokens were
    # generated; the repetition penalty divides a positive logit (multiplies a negative one) of a
    # token seen in the prompt or the output; the frequency penalty subtracts ``penalty x count``
    # of the output's tokens, the presence penalty ``penalty`` once per token in the output; then
    # temperature, and ``min_p`` drops tokens less likely than min_p x the most likely one, before
    # top-k and top-p.
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    min_tokens: int = 0  # in [0, max_len]
    ignore_eos: bool = False  # EOS does not end the request (its stop_token_ids and max_len still do)
    skip_special_tokens: bool = True  # False: control tokens (EOS...) appear in the text as their pieces
    # Structured output: a JSON schema the output must satisfy (``{"type": "object"}``: any JSON
    # object). A grammar engine (``runner.grammar``) masks each token to those that keep the text a
    # prefix of a valid document; the request ends once the document is complete.
    json_schema: Optional[dict] = None
    # Speculative decoding by n-gram lookup (runner/speculative.py): up to this many tokens a
    # step drafted from the request's own prompt and output, verified in one forward. None: the
    # runner's default (``InferenceRunner.speculative``, off unless it was started with it); 0:
    # off. At most the runner's ``speculative``. Greedy output is plain decoding's; sampled output
    # keeps its distribution (not its exact tokens for a seed). Not with the penalties, min_tokens
    # or json_schema (whose rules change token by token).
    speculative: Optional[int] = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)  # frozen: the checked values are set once, here
        self._check_prompt(set_)
        self._check_sampling(set_)
        self._check_counts(set_)
        self._check_stops_and_id(set_)

    def _check_prompt(self, set_) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError("Request.prompt is empty: expected non-empty text or token ids")
            try:
                self.prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"Request.prompt is not encodable text (UTF-8): {e.reason} at character "
                                 f"{e.start} ({self.prompt[e.start:e.end]!r})") from None
        else:
            set_("prompt", list(_ids_of("prompt", self.prompt, allow_empty=False)))

    def _check_sampling(self, set_) -> None:
        """The sampling settings: finite numbers in their ranges, flags, the schema."""
        for name in ("temperature", "nucleus_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"Request.{name} must be a finite number, got {value!r}")
            set_(name, float(value))
        if self.temperature < 0:
            raise ValueError(f"Request.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.nucleus_p <= 1:
            raise ValueError(f"Request.nucleus_p must be in (0, 1], got {self.nucleus_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"Request.min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"Request.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"Request.{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Request.{name} must be a bool, got {getattr(self, name)!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"Request.json_schema must be a JSON schema (a dict) or None, got "
                             f"{type(self.json_schema).__name__}")

    def _check_counts(self, set_) -> None:
        """The integer settings: top_k, max_len, min_tokens, the seed, logprobs, speculative."""
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"Request.top_k must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        if not _is_int(self.max_len) or not 0 < self.max_len <= INT32_MAX:
            raise ValueError(f"Request.max_len must be a positive integer below 2**31, got {self.max_len!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_len:
            raise ValueError(f"Request.min_tokens must be an integer in [0, max_len={self.max_len}], got "
                             f"{self.min_tokens!r}")
        if self.rng_seed is not None and (not _is_int(self.rng_seed) or not SEED_MIN <= self.rng_seed < SEED_LIMIT):
            raise ValueError(f"Request.rng_seed must be an integer in [-2**63, 2**64) or None, got {self.rng_seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"Request.{name} must be None or an integer in [0, {MAX_LOGPROBS}] (alternatives "
                                 f"per token), got {value!r}")
            set_(name, None if value is None else int(value))
        if self.speculative is not None:
            if not _is_int(self.speculative) or not 0 <= self.speculative <= MAX_SPECULATIVE:
                raise ValueError(f"Request.speculative must be None or an integer in [0, {MAX_SPECULATIVE}] (draft "
                                 f"tokens a step; 0 = off), got {self.speculative!r}")
            set_("speculative", int(self.speculative))
            clash = self.per_token_rules()
            if self.speculative and clash:
                raise ValueError(f"Request.speculative={self.speculative} does not combine with {', '.join(clash)}: "
                                 "their rules change with every token of a drafted run; set speculative=0")

    def _check_stops_and_id(self, set_) -> None:
        set_("top_k", int(self.top_k))
        set_("max_len", int(self.max_len))
        set_("min_tokens", int(self.min_tokens))
        set_("rng_seed", None if self.rng_seed is None else int(self.rng_seed))
        stop = () if self.stop_token_ids is None else self.stop_token_ids
        set_("stop_token_ids", _ids_of("stop_token_ids", stop, allow_empty=True))
        strings = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if (not isinstance(strings, (list, tuple)) or len(strings) > MAX_STOP_STRINGS
                or any(not isinstance(s, str) or not s for s in strings)):
            raise ValueError(f"Request.stop must be up to {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}")
        set_("stop", tuple(strings))
        if self.request_id is None:
            set_("request_id", f"req-{next(_ids)}")
        elif not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id must be a non-empty string, got {self.request_id!r}")


    def per_token_rules(self) -> list[str]:
        """Its settings whose rule changes with every token it generates, which speculative
        decoding does not take: a request with any speculates only if it asks (an error), never
        by the runner's default."""
        rules = {"repetition_penalty": self.repetition_penalty != 1, "frequency_penalty": self.frequency_penalty != 0,
                 "presence_penalty": self.presence_penalty != 0, "min_tokens": self.min_tokens > 0,
                 "json_schema": self.json_schema is not None}
        return [name for name, on in rules.items() if on]

    def speculates(self, default: int) -> int:
        """The most draft tokens a step it takes on a runner whose default is ``default``."""
        if self.speculative is not None:
            return self.speculative
        return 0 if self.per_token_rules() else default


@dataclasses.dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored given the tokens before it (``Request.prompt_logprobs``)."""

    token_id: int
    logprob: Optional[float]  # None for the first prompt token: nothing comes before it
    top_tokens: tuple  # ((token id, probability), ...) the most likely tokens at its position


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A request's speculative decoding (``Request.speculative``): its decode steps (forwards
    after the prefill's first token), the tokens they generated, and of those steps' drafts the
    tokens drafted and the drafted tokens accepted."""

    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request, or, with ``token_id`` None, its end without one
    (finish reason ``cancelled``, or ``error`` with the message in ``error``)."""

    request: Request
    index: int  # 0 for the request's first generated token
    token_id: Optional[int]
    text: str  # the new text this token completes ('' while a character is still incomplete)
    # log-probability of the token under the model (temperature 1); None unless Request.logprobs
    logprob: Optional[float]
    top_tokens: tuple  # ((token id, probability), ...) its Request.logprobs most likely alternatives
    finish_reason: Optional[str] = None  # set on the request's last event: one of FINISH_REASONS
    error: Optional[str] = None  # with finish reason "error": what went wrong serving this request
    # with an error caused by the request's own input (a RequestError): the Request field at fault
    error_field: Optional[str] = None
    # on the first event of a request with prompt_logprobs: each prompt token, scored
    prompt_logprobs: Optional[tuple] = None
    # prompt tokens whose KV came from the prefix cache, not computed (the usage's cached_tokens)
    cached_tokens: int = 0
    # on the last event of a request that a stop string ended: that string (vLLM's stop_reason)
    stop_reason: Optional[str] = None
    # on the last event of a request that speculated: its Speculation so far
    speculation: Optional["Speculation"] = None

    @property
    def request_id(self) -> str:
        return self.request.request_id
