"""``Request`` (what a caller asks for) and ``TokenEvent`` (what ``run()`` streams back).

Field names keep Grok-1's (``prompt``, ``temperature``, ``nucleus_p``, ``rng_seed``, ``max_len``);
``top_k``, ``stop_token_ids`` and token-id prompts are additions. A request validates its own fields
on construction (a ``ValueError`` naming the field), and the runner checks what depends on the
model (vocabulary, context length) when it is submitted, before anything runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Optional, Sequence, Union

_ids = itertools.count()

FINISH_REASONS = ("eos", "stop", "length", "cancelled")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(eq=False)
class Request:
    prompt: Union[str, Sequence[int]]  # text, or token ids used as they are
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    nucleus_p: float = 1.0  # top-p in (0, 1]; 1 = off
    rng_seed: Optional[int] = None  # None: derived from request_id; the same seed, the same tokens
    max_len: int = 256  # tokens to generate at most
    top_k: int = 0  # 0 = off
    stop_token_ids: Sequence[int] = ()  # generation ends after any of these (EOS always ends it)
    request_id: Optional[str] = None  # assigned if None

    def __post_init__(self):
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError("Request.prompt is empty: expected non-empty text or token ids")
        elif isinstance(self.prompt, (list, tuple)) or hasattr(self.prompt, "tolist"):
            ids = list(self.prompt.tolist() if hasattr(self.prompt, "tolist") else self.prompt)
            if not ids:
                raise ValueError("Request.prompt is empty: expected non-empty text or token ids")
            if not all(_is_int(t) for t in ids):
                raise ValueError(f"Request.prompt token ids must be integers, got {ids[:8]!r}")
            self.prompt = [int(t) for t in ids]
        else:
            raise ValueError(f"Request.prompt must be text or a list of token ids, "
                             f"got {type(self.prompt).__name__}")
        for name in ("temperature", "nucleus_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"Request.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"Request.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.nucleus_p <= 1:
            raise ValueError(f"Request.nucleus_p must be in (0, 1], got {self.nucleus_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"Request.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.max_len) or self.max_len <= 0:
            raise ValueError(f"Request.max_len must be a positive integer, got {self.max_len!r}")
        if self.rng_seed is not None and (not _is_int(self.rng_seed) or not 0 <= self.rng_seed < 2**32):
            raise ValueError(f"Request.rng_seed must be an integer in [0, 2**32) or None, got {self.rng_seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"Request.stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.request_id is None:
            self.request_id = f"req-{next(_ids)}"


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request (or, with ``token_id`` None, a cancellation)."""

    request: Request
    index: int  # 0 for the request's first generated token
    token_id: Optional[int]
    text: str  # the new text this token completes ('' while a character is still incomplete)
    logprob: float  # log-probability of the token under the model (temperature 1)
    top_tokens: tuple  # ((token id, probability), ...) the model's most likely alternatives
    finish_reason: Optional[str] = None  # set on the request's last event: one of FINISH_REASONS

    @property
    def request_id(self) -> str:
        return self.request.request_id
