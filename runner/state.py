"""The decode state: everything a step reads and writes, one row per batch slot, and the pytree
of one request's prefill arguments.

``DecodeState`` is donated to every call, so XLA updates it in place. ``insert`` and ``release``
are the only ways a slot's row changes outside a decode step. Its invariants:
- a free slot is a row whose ``active`` flag is False: it still runs through a step (the batch is
  fixed) but its ``step`` does not advance and its outputs are ignored;
- ``insert`` starts a row afresh (after its prompt was written to ``memory``): settings, key,
  stop ids, budget and first token are the new request's, whatever the row held before;
- stale K/V beyond a row's ``step`` are never attended to (``model/memory.py``).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from model.memory import KVMemory
from runner.sampling import SampleOutput, SampleSettings

MAX_STOP_IDS = 8  # EOS plus up to 7 stop tokens per request


@flax.struct.dataclass
class PrefillArgs:
    """One prompt chunk of one request: the scalars of a prefill call, as one pytree (so its
    sharding is a pytree too). ``tokens [1, T]`` is the chunk padded to its bucket."""

    slot: jax.Array  # int32: the batch row it goes to
    tokens: jax.Array  # [1, T] int32
    length: jax.Array  # int32: real tokens in the chunk
    reset: jax.Array  # bool: the request's first chunk (the row starts at step 0)
    temperature: jax.Array  # float32
    nucleus_p: jax.Array  # float32
    top_k: jax.Array  # int32
    seed: jax.Array  # uint32
    max_len: jax.Array  # int32
    stop_ids: jax.Array  # [MAX_STOP_IDS] int32 (-1 = unused; EOS first)


@flax.struct.dataclass
class DecodeState:
    memory: KVMemory
    tokens: jax.Array  # [B] int32: each slot's last token, the input of its next step
    settings: SampleSettings
    keys: jax.Array  # [B, 2] uint32: each slot's PRNG key
    active: jax.Array  # [B] bool
    remaining: jax.Array  # [B] int32: tokens the slot may still generate
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32: ids that end the slot's request (-1 = unused)

    def insert(self, args: PrefillArgs, memory: KVMemory, first: SampleOutput, key) -> "DecodeState":
        """The state with request ``args`` in its slot: ``memory`` holding its prompt, ``first`` its
        first sampled token (which may already end it), ``key`` its PRNG key from now on."""
        slot, s = args.slot, self.settings
        token = first.token_id[0]
        return DecodeState(
            memory=memory,
            tokens=self.tokens.at[slot].set(token),
            settings=SampleSettings(temperature=s.temperature.at[slot].set(args.temperature),
                                    nucleus_p=s.nucleus_p.at[slot].set(args.nucleus_p),
                                    top_k=s.top_k.at[slot].set(args.top_k)),
            keys=self.keys.at[slot].set(key),
            active=self.active.at[slot].set((args.max_len > 1) & ~jnp.any(token == args.stop_ids)),
            remaining=self.remaining.at[slot].set(args.max_len - 1),
            stop_ids=self.stop_ids.at[slot].set(args.stop_ids),
        )

    def release(self, slot) -> "DecodeState":
        """The state with ``slot`` free: it stops generating at once."""
        return self.replace(active=self.active.at[slot].set(False))


@flax.struct.dataclass
class DecodeOutput:
    """``steps`` decode steps of every slot: ``sample`` fields are ``[steps, B, ...]``; ``valid``
    says which slots generated a token at that step (a slot stops on device as soon as its request
    ends, so later steps of the same call are not valid for it)."""

    sample: SampleOutput
    valid: jax.Array  # [steps, B] bool
