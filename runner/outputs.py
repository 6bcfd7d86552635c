"""``OutputProcessor``: a request's tokens as the events its client reads, in one place.

Everything that turns token ids into what a client sees lives here: each request's incremental
detokenizer, its grammar's matcher (a structured output: the mask of allowed next tokens before a
call, and each sampled token checked against it after), the name of the reason a request ended,
its prompt's log-probabilities and its ``TokenEvent``s. The engine calls it on the engine thread:
a matcher's mask must be ready before the next call, and a token's text costs 6.9 us (the
shipped tokenizer, 20,000 tokens of Austen, a 2-core AMD EPYC): 0.2 ms of a decode call of 8
slots x 4 steps that takes about 40 ms (0.5%), so it stays there.

Stop *tokens* end a request on the device (``runner.state.ends``); stop *strings* are text: each
request's ``StopMatcher`` (``runner/stops.py``) holds back a tail that may begin one, and a match
ends the request here (its slot is released: the device did not stop it).
"""

from __future__ import annotations

from typing import Callable, Optional

from runner.requests import PromptLogprob, Request, RequestError, TokenEvent
from runner.scheduler import RequestState
from runner.stops import StopMatcher
from tokenization import IncrementalDetokenizer


def finish_reason(token: int, request: Request, eos_token: int) -> str:
    """The name of the reason a request ended with ``token`` (the device decided that it did, by
    ``runner.state.ends``)."""
    if token == eos_token and not request.ignore_eos:
        return "eos"
    return "stop" if token in request.stop_token_ids else "length"


class OutputProcessor:
    """Detokenizers, grammar matchers and events of every request of one engine; ``tokenizer``
    None: token ids only, no text. ``grammar_of(request)`` compiles a request's JSON grammar."""

    def __init__(self, tokenizer, eos_token: int, grammar_of: Optional[Callable[[Request], object]] = None):
        self.tokenizer, self.eos_token, self.grammar_of = tokenizer, eos_token, grammar_of

    def start(self, sequence: RequestState) -> None:
        """Before ``sequence``'s first chunk is dispatched: its grammar's matcher, its detokenizer and
        its stop strings' matcher."""
        if sequence.request.json_schema is not None:
            from runner.grammar import Matcher

            sequence.matcher = Matcher(self.grammar_of(sequence.request))
        sequence.detokenizer = (IncrementalDetokenizer(self.tokenizer, sequence.ids, skip_special_tokens=
                                                       sequence.request.skip_special_tokens)
                                if self.tokenizer is not None else None)
        sequence.stops = StopMatcher(list(sequence.request.stop)) if sequence.request.stop else None

    @staticmethod
    def first_mask(batch, i: int, sequence: RequestState) -> None:
        """Row ``i``'s mask: a structured output's first token, where its last chunk samples it."""
        if sequence.matcher is not None and batch.last[i]:
            sequence.matcher.fill_mask(batch.mask[i])
            batch.masked[i] = True
            sequence.unread += 1

    @staticmethod
    def masks(decoding: list[RequestState], host_mask):
        """A decode call's ``TokenMask`` (``host_mask``, filled; None if no row has a grammar) and the
        structured outputs it samples: each whose tokens are all read takes one step under its
        grammar's mask of allowed next tokens; one with a token still in flight is held."""
        constrained = [s for s in decoding if s.matcher is not None]
        if not constrained:
            return None, []
        from runner.grammar import fill_masks

        mask = host_mask()
        stepping = [s for s in constrained if not s.unread]
        if stepping:
            fill_masks([(s.slot, s.matcher) for s in stepping], mask.words)
        mask.on[[s.slot for s in stepping]] = True
        mask.hold[[s.slot for s in constrained if s.unread]] = True
        for s in stepping:
            s.unread += 1
        return mask, stepping

    @staticmethod
    def scores(scores, chunks: dict[int, tuple[int, int]], rows: dict[int, RequestState]) -> None:
        """A scoring prefill's ``PromptScores`` into each row's request: for each position of its
        chunk (``chunks``: first prompt position, length), the prompt token after it with its
        log-probability and alternatives (the chunk's last position scores the next chunk's
        first token; the prompt's last position has nothing to score)."""
        for column, sequence in rows.items():
            if sequence.finished:
                continue
            (start, length), k, ids = chunks[column], sequence.request.prompt_logprobs, sequence.ids
            if start == 0:
                sequence.scores.append(PromptLogprob(ids[0], None, ()))
            n = min(length, len(ids) - 1 - start)
            chosen = scores.logprob[column, :n].tolist()
            top_ids, top_probs = scores.top_ids[column, :n, :k].tolist(), scores.top_probs[column, :n, :k].tolist()
            sequence.scores += [PromptLogprob(ids[start + j + 1], chosen[j], tuple(zip(top_ids[j], top_probs[j])))
                                for j in range(n)]

    def token(self, sequence: RequestState, out, step: int, column: int) -> tuple[TokenEvent, bool]:
        """The event of the token a call sampled for ``sequence`` (its step ``step``, row
        ``column``), and whether its grammar or a stop string ended it (the device did not: its
        slot must be released). ``RequestError`` if the grammar engine gave up on its schema."""
        sample, request = out.sample, sequence.request
        token = int(sample.token_id[step, column])
        sequence.generated += 1
        # the device applied the stop rule (runner.state.ends); here it is only named
        reason = finish_reason(token, request, self.eos_token) if out.ended[step, column] else None
        grammar_done = False
        if sequence.matcher is not None and reason != "stop":  # a stop token of the caller's ends it anywhere
            # The mask allowed this token. The matcher refuses it, or EOS before the document is
            # complete, only when the engine gave up on the schema (a limit hit in some later row
            # than TokenGrammar._probe computes): the request's own failure, never a silent end.
            if not sequence.matcher.accept(token):
                why = sequence.matcher.error or f"it refused token {token}, which its own mask allowed"
                raise RequestError("json_schema", f"the grammar engine gave up on the schema after "
                                   f"{sequence.generated - 1} tokens: {why}")
            grammar_done = reason is None and sequence.matcher.done
            reason = "stop" if grammar_done else reason  # the document is complete: the request ends here
        stopped = reason in ("eos", "stop") and not grammar_done  # a stop token's text is not part of the output
        text = "" if stopped or sequence.detokenizer is None else sequence.detokenizer.add(token)
        if reason is not None:
            text = self.last_text(sequence, text)
        elif sequence.stops is not None:
            text = sequence.stops.feed(text)
        release = grammar_done
        if sequence.stops is not None and sequence.stops.stopped:  # a stop string: the request ends here
            release, reason = release or reason is None, "stop"
        logprob, top = None, ()
        if request.logprobs is not None:  # else the call computed none for this row
            logprob = float(sample.logprob[step, column])
            k = request.logprobs
            top = tuple(zip(sample.top_k_token_ids[step, column, :k].tolist(),
                            sample.top_k_probs[step, column, :k].tolist()))
        prompt = tuple(sequence.scores) if sequence.scored and sequence.generated == 1 else None
        speculation = sequence.drafting.tally if reason is not None and sequence.drafting is not None else None
        event = TokenEvent(request, sequence.generated - 1, token, text, logprob, top, reason,
                           prompt_logprobs=prompt, cached_tokens=sequence.cached, speculation=speculation,
                           stop_reason=sequence.stops.matched if sequence.stops is not None else None)
        return event, release

    def cancelled(self, sequence: RequestState) -> TokenEvent:
        """The last event of a request cancelled by its client."""
        return TokenEvent(sequence.request, sequence.generated, None, self.last_text(sequence), 0.0, (), "cancelled")

    @staticmethod
    def error(request: Request, index: int, error: Exception | str) -> TokenEvent:
        """The last event of a request that failed: its message, and the field at fault where the
        request's own input caused it (``RequestError``)."""
        if isinstance(error, str):
            return TokenEvent(request, index, None, "", 0.0, (), "error", error=error)
        field = error.field if isinstance(error, RequestError) else None
        message = str(error) if field is not None else f"{type(error).__name__}: {error}"
        return TokenEvent(request, index, None, "", 0.0, (), "error", error=message, error_field=field)

    @staticmethod
    def last_text(sequence: RequestState, text: str = "") -> str:
        """At the end of a request: ``text`` and what its detokenizer held back, through its stop
        strings' matcher, which then releases what it held (nothing once a stop string matched)."""
        text += sequence.detokenizer.flush() if sequence.detokenizer is not None else ""
        if sequence.stops is None:
            return text
        return sequence.stops.feed(text) + sequence.stops.flush()
