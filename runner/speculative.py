"""Prompt-lookup (n-gram) speculative decoding: its device rules and its host control, one state
machine stated here.

Grok-1 has no draft model, but a continuation that repeats or edits its context drafts itself:
the tokens that followed the most recent earlier occurrence of the request's last n tokens are
likely to follow again. One forward over the k drafted positions costs about one decode step
while the step is bound by reading the weights, so every accepted draft token is a token for
free.

**The state machine.** Each speculating slot is, on the device, in one of two states:

- *drafting* (``draft_len > 0``): each speculative step drafts up to ``min(k, draft_len)`` tokens
  (``ngram_draft``), verifies them in one forward (``verify``) and keeps the accepted prefix and
  the token after it. A fully accepted draft grows ``draft_len`` by one (up to ``k``); otherwise it
  falls to what was accepted; a refused draft, or nothing to follow, takes it to 0:
- *waiting* (``draft_len == 0``): it decodes plainly for ``wait`` steps (``PROBE_AFTER``, doubled
  for each stall in a row, ``MAX_DOUBLINGS`` times at most), then returns to drafting with a
  draft of one token (a probe).

The host sees each decode call's outputs two calls late at most, and chooses each call's kind
from what it has read (``Drafting``, one per speculating request, and ``plan_call``):

- a call is *plain* while no slot may draft (as of the call two before it: ``DecodeOutput.ready``)
  or any slot has a grammar (its mask needs its last token);
- else it is *speculative*: of one step while no slot's drafts were being accepted (probing),
  of the plan's steps while one's were (its text repeats: a longer call costs the host less a
  token).

Every choice depends on outputs read by the time the call is planned, whether the engine reads
before it plans or after it dispatches, so the choice, and the tokens, never depend on the
host's timing. The rules are pure JAX over a batch of rows, so they run where the tokens are (a
token history in the decode state) and the host never proposes stale drafts:

- ``ngram_draft``: each row's draft, from its token history alone (-1 marks an unknown token:
  it never matches).
- ``verify``: which drafted tokens a row keeps, and the token that follows them, such that the
  kept tokens have exactly the distribution plain decoding would give them: a greedy row keeps a
  draft token while it is the argmax; a sampled row keeps draft token d with probability p(d)
  (the draft is a point mass, so min(1, p/q) = p), and at the first rejected position samples
  from p with d removed, renormalised (the residual max(0, p - q) normalised); after a fully
  accepted draft it samples the next position from p itself.
- ``speculate``: one speculative step of every slot: draft, verify in one forward with the cache,
  roll the row's ``step`` back past what it kept, adapt its draft length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from runner.requests import Speculation
from runner.sampling import TOP_K, SampleOutput, filter_logits, sample_token
from runner.state import DecodeOutput, DecodeState, TokenMask, ends


def ngram_draft(history_BS, length_B, k: int, max_n: int = 3, min_n: int = 1):
    """Each row's draft of up to ``k`` tokens: for the longest n in ``[min_n, max_n]`` whose last
    n tokens (of the row's first ``length_B`` history tokens) occurred earlier, the tokens that
    followed their most recent earlier occurrence that is followed by k tokens, or if none is,
    their most recent earlier occurrence. Returns (draft ``[B, k]`` int32, padded with
    -1; its length ``[B]`` int32, 0 where nothing matched)."""
    b, s = history_BS.shape
    positions = jnp.arange(s)
    draft = jnp.full((b, k), -1, jnp.int32)
    count = jnp.zeros((b,), jnp.int32)
    for n in range(min_n, max_n + 1):  # longer n-grams later: they win where they match
        # the row's last n tokens
        last = jnp.take_along_axis(history_BS, jnp.clip(length_B[:, None] - n + jnp.arange(n), 0, s - 1), axis=1)
        match = jnp.ones((b, s), bool)
        for i in range(n):  # window starting at j equals the last n tokens
            shifted = jnp.pad(history_BS[:, i:], ((0, 0), (0, i)), constant_values=-1)
            match &= shifted == last[:, i: i + 1]
        # an earlier occurrence (not the last n tokens themselves): one followed by a token
        match &= positions[None, :] < (length_B - n)[:, None]
        # the most recent followed by k tokens, else the most recent (in a run of one repeated
        # token, the occurrence just before the end is followed by one token only)
        full = jnp.max(jnp.where(match & (positions[None, :] <= (length_B - n - k)[:, None]), positions[None, :], -1),
                       axis=1)
        best = jnp.where(full >= 0, full, jnp.max(jnp.where(match, positions[None, :], -1), axis=1))
        found = best >= 0
        start = best + n
        available = jnp.minimum(k, length_B - start)
        idx = jnp.clip(start[:, None] + jnp.arange(k), 0, s - 1)
        candidate = jnp.where(jnp.arange(k)[None, :] < available[:, None],
                              jnp.take_along_axis(history_BS, idx, axis=1), -1)
        draft = jnp.where(found[:, None], candidate, draft)
        count = jnp.where(found, available, count)
    return draft.astype(jnp.int32), count.astype(jnp.int32)


def verify(probs_BKV, draft_BK, count_B, greedy_B, keys_B2, argmax_BT=None):
    """The tokens a row keeps from its draft and the one after them.

    ``probs_BKV`` are the target distributions at the row's k + 1 positions (position i predicts
    the token after draft token i - 1; position 0 the first new token), after the row's own
    sampling rules; ``draft_BK`` its draft (``count_B`` real tokens); ``greedy_B`` rows keep
    argmax (``argmax_BT``, the raw logits' where given: exactly plain greedy decoding's token, else
    the probabilities'); ``keys_B2`` one PRNG key a row for this call. Returns (accepted ``[B]``
    int32: draft tokens kept, the next ``[B]`` int32: the token after them)."""
    b, k1, v = probs_BKV.shape
    k = k1 - 1
    uniform_key, residual_key, free_key = (jax.vmap(lambda key: jax.random.split(key, 3))(keys_B2)
                                           .transpose(1, 0, 2))
    safe_draft = jnp.clip(draft_BK, 0, v - 1)
    p_draft = jnp.take_along_axis(probs_BKV[:, :k], safe_draft[..., None], axis=-1)[..., 0]  # [B, k]
    argmax_BK = jnp.argmax(probs_BKV, axis=-1) if argmax_BT is None else argmax_BT  # [B, k + 1]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(uniform_key)
    keep = jnp.where(greedy_B[:, None], argmax_BK[:, :k] == draft_BK, u < p_draft)
    keep &= jnp.arange(k)[None, :] < count_B[:, None]
    accepted = jnp.argmin(jnp.concatenate([keep, jnp.zeros((b, 1), bool)], axis=1), axis=1)  # first False
    at = accepted  # the position whose distribution gives the next token
    p_at = jnp.take_along_axis(probs_BKV, at[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = at < count_B  # the draft token at `at` was refused: sample from p without it
    refused = jnp.take_along_axis(safe_draft, jnp.minimum(at, k - 1)[:, None], axis=1)[:, 0] if k else at
    residual = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == refused[:, None]), 0.0, p_at)
    sampled = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(
        jnp.where(rejected[:, None], residual_key, free_key), residual)
    greedy_next = jnp.take_along_axis(argmax_BK, at[:, None], axis=1)[:, 0]
    return accepted.astype(jnp.int32), jnp.where(greedy_B, greedy_next, sampled).astype(jnp.int32)


# ---- the device step -------------------------------------------------------------------------

# Steps a slot whose drafting stalled (a draft refused whole, or nothing to follow) decodes plainly
# before it drafts one token again: 16, doubled for each stall in a row up to 16 x 2^3 (a
# request whose text never repeats costs one probe every 128 tokens at most).
PROBE_AFTER, MAX_DOUBLINGS = 16, 3


def speculate(apply, sampler, params, state: DecodeState, mask: TokenMask, kv_len: int, k: int):
    """One speculative step of every slot: each drafts up to ``min(k, its draft_len)`` tokens from
    its own history (``ngram_draft``), the step's token and the draft go through one forward with
    the cache (``k + 1`` positions a row, the draft's own length of them real), ``verify`` keeps
    the draft's accepted prefix and the token after it, and the row's ``step`` is rolled back to
    just past what it kept (the cache beyond it is stale, never attended). A row without a draft
    samples its one token as a plain step does (``sample_token``, its own key, its rules), so a
    request that does not speculate keeps its tokens beside those that do (up to float rounding:
    its logits come from a forward over k + 1 positions). Greedy rows keep the argmax at every
    position: plain decoding's tokens. No ``lax.cond`` picks a one-position forward where no row
    has a draft: on XLA:CPU the cond added 1.7 plain steps' time to a step of the bench config
    (BENCHMARKS.md).

    ``mask`` is the call's, all off: the host never makes a call with a structured output
    speculative. Returns the state and a ``DecodeOutput`` of ``[k + 1, B]`` tokens (with
    drafted/accepted)."""
    step_B = state.memory.step
    split = jax.vmap(jax.random.split)(state.keys)
    keys, sample_keys = split[:, 0], split[:, 1]
    # a row at the end of the attended positions waits for a call over more of them
    valid_B = state.active & (step_B < kv_len)
    draft_BK, found_B = ngram_draft(state.history, step_B + 1, k)
    room_B = jnp.minimum(state.remaining - 1, kv_len - step_B - 1)  # tokens it may still add after the first
    count_B = jnp.where(valid_B, jnp.clip(jnp.minimum(jnp.minimum(found_B, state.draft_len), room_B), 0, k), 0)
    real_BK = jnp.arange(k)[None, :] < count_B[:, None]
    tokens_BT = jnp.concatenate([state.tokens[:, None], jnp.where(real_BK, draft_BK, 0)], axis=1)
    out = apply({"params": params}, tokens_BT, state.memory, jnp.where(valid_B, count_B + 1, 0), False, kv_len)
    raw_BTV = out.logits.astype(jnp.float32)
    emitted_BT, accepted_B = _verified(sampler, state, mask, raw_BTV, draft_BK, count_B, sample_keys)
    sample = _sample_output(sampler, state, raw_BTV, emitted_BT)
    kept_BT, ends_BT, n_B = _kept(state, emitted_BT, accepted_B, valid_B)
    ended_B = jnp.any(kept_BT & ends_BT, axis=1)
    last_B = jnp.take_along_axis(emitted_BT, jnp.maximum(n_B - 1, 0)[:, None], axis=1)[:, 0]
    # the state: the cache rolled back to the kept tokens, the history and the adaptive draft length
    b, t = emitted_BT.shape
    rows_BT = jnp.where(kept_BT, jnp.arange(b)[:, None], b)
    draft_len, wait, misses = _adapt(state, valid_B, count_B, found_B, accepted_B)
    state = state.replace(
        memory=out.memory.replace(step=step_B + n_B),
        tokens=jnp.where(n_B > 0, last_B, state.tokens),
        keys=jnp.where(valid_B[:, None], keys, state.keys),
        remaining=state.remaining - n_B,
        active=state.active & ~ended_B,
        unstoppable=state.unstoppable - n_B,
        counts=state.counts.at[rows_BT, emitted_BT].add(1, mode="drop"),
        history=state.history.at[rows_BT, step_B[:, None] + 1 + jnp.arange(t)[None, :]].set(emitted_BT, mode="drop"),
        draft_len=draft_len, wait=wait, misses=misses)
    return state, DecodeOutput(sample, kept_BT.T, (kept_BT & ends_BT).T, count_B, jnp.minimum(accepted_B, n_B),
                               ready_to_draft(state))


def _verified(sampler, state: DecodeState, mask: TokenMask, raw_BTV, draft_BK, count_B, sample_keys):
    """Each row's ``k + 1`` candidate tokens (its accepted draft, then the token after it) and how
    many of its draft it accepted; a row without a draft gets the plain step's sample (its rules at
    position 0)."""
    b, t, _ = raw_BTV.shape
    plain = sample_token(raw_BTV[:, 0], state.settings, sample_keys, sampler, state.constraints(mask))
    settings_R = jax.tree_util.tree_map(lambda a: jnp.repeat(a, t, axis=0), state.settings)
    filtered = filter_logits(raw_BTV.reshape(b * t, -1), settings_R, sampler).reshape(b, t, -1)
    accepted_B, next_B = verify(jax.nn.softmax(filtered, axis=-1), draft_BK, count_B,
                                state.settings.temperature <= 0, sample_keys, argmax_BT=jnp.argmax(raw_BTV, axis=-1))
    drafting = count_B > 0
    next_B = jnp.where(drafting, next_B, plain.token_id)
    accepted_B = jnp.where(drafting, accepted_B, 0)
    j = jnp.arange(t)[None, :]
    emitted_BT = jnp.where(j < accepted_B[:, None], jnp.pad(draft_BK, ((0, 0), (0, 1))), next_B[:, None])
    return emitted_BT, accepted_B


def _sample_output(sampler, state: DecodeState, raw_BTV, emitted_BT) -> SampleOutput:
    """The step's ``SampleOutput`` (``[k + 1, B]``): the reported log-probabilities are the
    model's own at each position, computed only if a row asked for them."""
    b, t, _ = raw_BTV.shape
    top = min(TOP_K, state.counts.shape[1])
    flat_RV = raw_BTV.reshape(b * t, -1)

    def summary():
        top_logits, top_ids, lse, _ = sampler.logits_summary(flat_RV, top)
        chosen = jnp.take_along_axis(flat_RV, emitted_BT.reshape(-1, 1), axis=-1)[:, 0] - lse
        return (chosen.reshape(b, t), top_ids.astype(jnp.int32).reshape(b, t, top),
                jnp.exp(top_logits - lse[:, None]).reshape(b, t, top))

    def none():
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, top), jnp.int32), jnp.zeros((b, t, top), jnp.float32)

    logprob_BT, top_ids_BTk, top_probs_BTk = jax.lax.cond(jnp.any(state.settings.logprobs >= 0), summary, none)
    return SampleOutput(token_id=emitted_BT.T, logprob=logprob_BT.T, top_k_token_ids=top_ids_BTk.transpose(1, 0, 2),
                        top_k_probs=top_probs_BTk.transpose(1, 0, 2))


def _kept(state: DecodeState, emitted_BT, accepted_B, valid_B):
    """Which of each row's ``k + 1`` tokens it keeps (its accepted draft and the next, up to one
    that ends it: ``ends``), which of them end it, and how many it keeps (0 for a row that did
    not step)."""
    b, t = emitted_BT.shape
    j = jnp.arange(t)[None, :]
    remaining_BT = state.remaining[:, None] - (j + 1)
    ends_BT = ends(emitted_BT.reshape(-1), jnp.repeat(state.stop_ids, t, axis=0), remaining_BT.reshape(-1)).reshape(b, t)
    candidate_BT = valid_B[:, None] & (j <= accepted_B[:, None])
    ended_B = jnp.any(candidate_BT & ends_BT, axis=1)
    first_end_B = jnp.argmax(candidate_BT & ends_BT, axis=1)
    kept_BT = candidate_BT & (~ended_B[:, None] | (j <= first_end_B[:, None]))
    return kept_BT, ends_BT, jnp.sum(kept_BT, axis=1).astype(jnp.int32)


def _adapt(state: DecodeState, valid_B, count_B, found_B, accepted_B):
    """The state machine's step (module docstring): each row's next ``draft_len``, ``wait`` and
    ``misses`` (stalls in a row) after a step that drafted ``count_B`` tokens and accepted
    ``accepted_B`` of them."""
    drafting = count_B > 0
    grow = drafting & (accepted_B == count_B)
    unmatched = valid_B & (state.draft_len > 0) & (found_B == 0)  # nothing to follow: as good as refused
    draft_len = jnp.where(drafting, jnp.where(grow, jnp.minimum(state.draft_len + 1, state.speculative), accepted_B),
                          jnp.where(unmatched, 0, state.draft_len))
    stalled = (drafting | unmatched) & (draft_len == 0)
    misses = jnp.where(stalled, state.misses + 1, jnp.where(drafting & (accepted_B > 0), 0, state.misses))
    draft_len, wait = count_down(state.replace(draft_len=draft_len), valid_B & ~stalled)
    wait = jnp.where(stalled, PROBE_AFTER << jnp.minimum(misses - 1, MAX_DOUBLINGS), wait)
    return draft_len, wait, misses


def count_down(state: DecodeState, stepped_B):
    """(draft_len, wait) after a step: a speculating row that waits (draft length 0) and stepped
    is a step closer to trying a draft of one token again."""
    waiting = stepped_B & (state.draft_len == 0) & (state.speculative > 0)
    wait = jnp.where(waiting, state.wait - 1, state.wait)
    return jnp.where(waiting & (wait <= 0), 1, state.draft_len), wait


def ready_to_draft(state: DecodeState):
    """The rows whose next step may draft: the host makes the next call speculative only if one may."""
    return state.active & (state.speculative > 0) & (state.draft_len > 0)


# ---- the host's control ------------------------------------------------------------------------

@dataclasses.dataclass
class Drafting:
    """One speculating request's control on the host: ``k``, the most draft tokens a step; its
    ``Speculation`` tally as read; and, by decode call, whether after that call its next step may
    draft (``ready``) and whether that call accepted any of its drafted tokens (``accepting``)."""

    k: int
    tally: Speculation = Speculation()
    ready: dict = dataclasses.field(default_factory=dict)
    accepting: dict = dataclasses.field(default_factory=dict)

    def may_draft(self, call: int) -> bool:
        """Whether decode call ``call`` should be speculative for it, as of call ``call - 2``
        (read by then whatever the host's timing). True before it took part in any."""
        return self.ready.get(call - 2, True)

    def pays(self, call: int) -> bool:
        """Whether its drafts were being accepted as of call ``call - 2``: a call may then take
        several speculative steps."""
        return self.accepting.get(call - 2, False)

    def read(self, call: int, out, column: int, generated: int) -> None:
        """Decode call ``call``'s outputs (host arrays) for its row ``column``, which generated
        ``generated`` tokens: the tally grows, and whether it may draft next is recorded."""
        if out.ready is not None:
            self.ready = {c: r for c, r in self.ready.items() if c > call - 4}  # the few it may still ask for
            self.ready[call] = bool(out.ready[column])
            self.accepting = {c: a for c, a in self.accepting.items() if c > call - 4}
            self.accepting[call] = out.accepted is not None and bool(out.accepted[:, column].sum() > 0)
        was = self.tally
        if out.drafted is None:  # a plain call: a token a step
            self.tally = dataclasses.replace(was, steps=was.steps + generated, tokens=was.tokens + generated)
            return
        per_step = out.valid.reshape(len(out.drafted), -1, out.valid.shape[1])
        self.tally = Speculation(steps=was.steps + int(per_step[:, :, column].any(axis=1).sum()),
                                 tokens=was.tokens + generated, drafted=was.drafted + int(out.drafted[:, column].sum()),
                                 accepted=was.accepted + int(out.accepted[:, column].sum()))


def plan_call(drafting: list[Drafting], call: int, k: int, steps: int, constrained: bool) -> tuple[int, int]:
    """Decode call ``call``'s (most draft tokens a step, 0 for a plain call; steps), for slots
    whose speculating requests are ``drafting`` and a plain call of ``steps`` steps
    (``constrained``: a slot has a grammar)."""
    if constrained or not any(d.may_draft(call) for d in drafting):
        return 0, steps
    return k, steps if any(d.pays(call) for d in drafting) else 1
