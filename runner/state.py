"""The decode state: everything a step reads and writes, one row per batch slot; the pytree of a
prefill call's chunks; and the stop rule.

``DecodeState`` is donated to every call, so XLA updates it in place. ``start`` and ``release``
are the only ways a slot's row changes outside a decode step. Its invariants:
- a free slot, or one whose prompt is still being prefilled, is a row whose ``active`` flag is
  False: it still runs through a decode step (the batch is fixed) but its ``step`` does not
  advance, it reaches no expert and its outputs are ignored;
- ``start`` starts a row afresh (after its prompt was written to ``memory``): settings, key,
  stop ids, budget and first token are the new request's, whatever the row held before;
- stale K/V beyond a row's ``step`` are never attended to (``model/memory.py``).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from model.memory import KVMemory
from runner.sampling import Constraints, SampleOutput, SampleSettings

MAX_STOP_IDS = 8  # EOS plus up to 7 stop tokens per request
# Each chunk of a packed prefill starts at a multiple of this (``runner.scheduler``): every block
# of that many queries then reads one cache row (``backends.xla.attend_rows``, whose block it is)
CHUNK_ALIGN = 16


@flax.struct.dataclass
class PrefillBatch:
    """Prompt chunks of up to ``P`` requests, one row each, computed in one call: the arrays of a
    prefill call, as one pytree (so its sharding is a pytree too). The chunks are packed into one
    row of ``T`` tokens (the call's bucket), row p's at ``tokens[offset[p]: offset[p] +
    lengths[p]]``, so a call's shape is its bucket alone, whatever its rows. A row whose slot is
    the batch size is padding: nothing is read for it and nothing it computes is written."""

    slots: jax.Array  # [P] int32: the batch row each chunk goes to (batch size = padding)
    tokens: jax.Array  # [T] int32: the rows' chunks, packed
    row: jax.Array  # [T] int32: the row each token belongs to (P = padding)
    offset: jax.Array  # [P] int32: where each row's chunk starts in ``tokens``
    lengths: jax.Array  # [P] int32: real tokens in each chunk
    first: jax.Array  # [P] bool: the request's first chunk (its row starts at step 0)
    last: jax.Array  # [P] bool: the request's last chunk (its first token is sampled; it starts decoding)
    settings: SampleSettings  # [P] each
    seed: jax.Array  # [P, 2] uint32: the PRNG key of its seed (runner.requests: SEED_LIMIT)
    max_len: jax.Array  # [P] int32
    min_tokens: jax.Array  # [P] int32: tokens before a stop id may be sampled
    speculative: jax.Array  # [P] int32: draft tokens a speculative step may verify (0: off)
    stop_ids: jax.Array  # [P, MAX_STOP_IDS] int32 (-1 = unused; EOS first unless it ignores EOS)
    # its first token's allowed-token bitmask (``Constraints.mask``), where ``masked``
    mask: jax.Array  # [P, ceil(V / 32)] uint32
    masked: jax.Array  # [P] bool
    # [T] int32: the prompt token after each packed position, which a scoring prefill scores (-1: none)
    targets: jax.Array
    # The prefix cache (``runner.prefix_cache``), with blocks of ``block`` positions; ``NB`` =
    # ``sequence_len // block``. A first chunk whose prompt starts with cached blocks starts at
    # ``cached`` and reads positions ``[0, cached)`` from the pool blocks ``read``; ``save[p, j]``
    # is the pool block that block j of the row's positions is written to after the call
    # (``num_blocks``: none). Without a pool, zeros and ignored.
    cached: jax.Array  # [P] int32: positions read from the pool (a multiple of block)
    read: jax.Array  # [P, NB] int32
    save: jax.Array  # [P, NB] int32


def ends(token_B, stop_ids_BS, remaining_B):
    """The stop rule, the one place it is stated: a request ends with a token among its stop ids
    (EOS is always one), or when it may generate no more tokens. Every step applies it on the
    device; the host only names the reason (``runner.scheduler.finish_reason``)."""
    return jnp.any(token_B[:, None] == stop_ids_BS, axis=1) | (remaining_B <= 0)


@flax.struct.dataclass
class PrefixPool:
    """The device's prefix block pool: ``[L, num_blocks, K, block, H]`` keys and values of prompt
    prefixes (every layer's, like ``KVMemory``), in the cache's dtype (or int8 records);
    ``runner.prefix_cache.PrefixCache`` says which block holds what. A block is only ever copied
    into a slot, never attended in place."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


@flax.struct.dataclass
class TokenMask:
    """A decode call's allowed-token bitmasks (``Constraints.mask``), one row per slot: a row
    ``on`` samples its call's first step under its mask and then waits for the host, which
    advances its grammar with that token and passes the next mask with the next call. A row
    ``hold`` takes no step at all (a structured output whose last token the host has not read
    yet: its mask is not known)."""

    words: jax.Array  # [B, ceil(V / 32)] uint32
    on: jax.Array  # [B] bool
    hold: jax.Array  # [B] bool

@flax.struct.dataclass
class DecodeState:
    memory: KVMemory
    tokens: jax.Array  # [B] int32: each slot's last token, the input of its next step
    settings: SampleSettings
    keys: jax.Array  # [B, 2] uint32: each slot's PRNG key
    active: jax.Array  # [B] bool
    remaining: jax.Array  # [B] int32: tokens the slot may still generate
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32: ids that end the slot's request (-1 = unused)
    unstoppable: jax.Array  # [B] int32: tokens the slot must still generate before a stop id may come
    counts: jax.Array  # [B, V] int32: times the slot's request generated each token (the penalties)
    seen: jax.Array  # [B, V] bool: the tokens of its prompt (the repetition penalty)
    # Speculative decoding (runner/speculative.py): each slot's tokens by position, prompt and
    # output (-1: unknown, e.g. a prefix read from the cache), its request's most draft tokens a
    # step (0: off), the draft length it takes now (adapted to how its drafts fare), while that
    # is 0 the steps until it tries a draft of one again, and how many times in a row its
    # drafting stalled (each doubles the wait).
    history: jax.Array  # [B, S] int32
    speculative: jax.Array  # [B] int32
    draft_len: jax.Array  # [B] int32
    wait: jax.Array  # [B] int32
    misses: jax.Array  # [B] int32
    pool: Optional[PrefixPool] = None  # the prefix cache's blocks (None: no prefix cache)

    def start(self, batch: PrefillBatch, first: SampleOutput, keys) -> "DecodeState":
        """The state with the requests of ``batch``'s last-chunk rows in their slots (their
        prompts already written to ``memory``): settings, stop ids, budget and first token
        (``first``, which may already end a request) are the new request's, whatever the row held
        before; ``keys [P, 2]`` are their PRNG keys from now on. Other rows change nothing."""
        b = self.tokens.shape[0]
        at = jnp.where(batch.last, batch.slots, b)  # rows that start decoding; the others drop out
        put = lambda full, new: full.at[at].set(new.astype(full.dtype), mode="drop")  # noqa: E731
        token, remaining = first.token_id, batch.max_len - 1
        position = jnp.take(self.memory.step, batch.slots, mode="fill", fill_value=0)  # the first token's
        return self.replace(
            history=self.history.at[at, position].set(token, mode="drop"),
            speculative=put(self.speculative, batch.speculative),
            draft_len=put(self.draft_len, batch.speculative),
            wait=put(self.wait, jnp.zeros_like(batch.speculative)),
            misses=put(self.misses, jnp.zeros_like(batch.speculative)),
            tokens=put(self.tokens, token),
            settings=jax.tree_util.tree_map(put, self.settings, batch.settings),
            keys=put(self.keys, keys),
            active=put(self.active, ~ends(token, batch.stop_ids, remaining)),
            remaining=put(self.remaining, remaining),
            stop_ids=put(self.stop_ids, batch.stop_ids),
            unstoppable=put(self.unstoppable, batch.min_tokens - 1),
            counts=self.counts.at[at, token].add(1, mode="drop"),  # its rows were zeroed (``with_prompts``)
        )

    def with_prompts(self, batch: PrefillBatch, slots_T, positions_T) -> "DecodeState":
        """The state with the token history of ``batch``'s rows: a first chunk's row starts with
        none, then every packed prompt token is marked seen in its slot ``slots_T`` (the batch
        size: padding) and written at its position ``positions_T``."""
        b, v = self.seen.shape
        fresh = jnp.where(batch.first, batch.slots, b)
        seen = self.seen.at[fresh].set(False, mode="drop")
        counts = self.counts.at[fresh].set(0, mode="drop")
        history = self.history.at[fresh].set(-1, mode="drop")
        return self.replace(seen=seen.at[slots_T, batch.tokens].set(True, mode="drop"), counts=counts,
                            history=history.at[slots_T, positions_T].set(batch.tokens, mode="drop"))

    def constraints(self, mask: "TokenMask") -> Constraints:
        """Every row's ``Constraints`` for its next token: its history, its stop ids banned while
        ``unstoppable``, and ``mask`` (the decode call's)."""
        banned = jnp.where((self.unstoppable > 0)[:, None], self.stop_ids, -1)
        return Constraints(counts=self.counts, seen=self.seen, banned=banned, mask=mask.words, masked=mask.on)


    def release(self, slot) -> "DecodeState":
        """The state with ``slot`` free: it stops generating at once."""
        return self.replace(active=self.active.at[slot].set(False))


@flax.struct.dataclass
class DecodeOutput:
    """``steps`` decode steps of every slot: ``sample`` fields are ``[steps, B, ...]``; ``valid``
    says which slots generated a token at that step (a slot stops on device as soon as its request
    ends, so later steps of the same call are not valid for it). A prefill call's output has the
    same form, one step of its ``P`` rows: valid where the row sampled (a last chunk)."""

    sample: SampleOutput
    valid: jax.Array  # [steps, B] bool
    ended: jax.Array  # [steps, B] bool: the token ends its request (``ends``)
    # A speculative call's (else None): each of its ``n`` steps' draft tokens per slot, and how
    # many of them were accepted; its ``steps`` above are n x (1 + the most draft tokens), a
    # step's tokens in a row, the first ``accepted + 1`` of them valid (fewer where one ends).
    drafted: Optional[jax.Array] = None  # [n, B] int32
    accepted: Optional[jax.Array] = None  # [n, B] int32
    # a decode call's (else None): the slots whose next step may draft (a speculating request
    # whose draft length is not 0): the host makes a call speculative only while one may
    ready: Optional[jax.Array] = None  # [B] bool
