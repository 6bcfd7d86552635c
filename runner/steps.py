"""The device steps, pure functions of (parameters, decode state, a batch): what the executor
(``runner/executor.py``) jits, each with the state donated so XLA updates it in place.

- ``prefill``: the prompt chunks of several requests into their slots (with the prefix pool's
  blocks read and saved inside the call), and the first token of each request whose last chunk
  it is.
- ``fork``: a slot's cache copied into another slot for a request with the same prompt, its first
  token sampled from the prefill's logits under its own settings.
- ``decode``: ``steps`` decode steps of every slot in one call (a scan), each slot stopping at
  its EOS, stop tokens or budget; or speculative steps (``runner.speculative.speculate``).

``apply(variables, tokens, memory, lengths, last_only, kv_len)`` is the model, and ``sampler`` the
backend that ``sample_token`` cuts and summarises on (and that copies the prefix pool's blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.memory import KVMemory
from runner.sampling import Constraints, sample_token, score_positions
from runner.speculative import count_down, ready_to_draft, speculate
from runner.state import DecodeOutput, DecodeState, PrefillBatch, PrefixPool, TokenMask, ends


def prefill(apply, sampler, params, state: DecodeState, batch: PrefillBatch, score: bool = False):
    """The prompt chunks of ``batch`` (``P`` rows, one request each, in distinct slots, packed into
    one row of tokens) into their slots of ``state``, in place, and the first token of each request
    whose last chunk it is sampled. A token attends to its own slot's positions up to its own (the
    attention reads no more: ``model.transformer.LanguageModel``), so one compiled call a bucket
    serves chunks of any rows and lengths. With ``score`` (static) every position is unembedded and
    scored against ``batch.targets`` (``PromptScores``, else None): prompt log-probabilities, as
    part of the prefill. ``apply`` is the model; ``sampler`` the backend that ``sample_token`` cuts
    and summarises on. Pure: jitted with ``state`` donated."""
    memory, b = state.memory, state.tokens.shape[0]
    slots = batch.slots  # b for a padding row: read as zeros, written nowhere
    step = jnp.take(memory.step, slots, mode="fill", fill_value=0)
    starts = jnp.where(batch.first, batch.cached, step)
    slots_T = jnp.take(slots, batch.row, mode="fill", fill_value=b)
    positions_T = (jnp.take(starts, batch.row, mode="fill", fill_value=0) + jnp.arange(batch.tokens.shape[0])
                   - jnp.take(batch.offset, batch.row, mode="fill", fill_value=0))
    if state.pool is not None:  # a first chunk after a cached prefix starts from its blocks
        memory = read_prefix(state.pool, batch, memory, sampler)
    last_P = batch.offset + jnp.maximum(batch.lengths - 1, 0)
    out = apply({"params": params}, batch.tokens[None], memory, None, False, None, slots_T[None], positions_T[None],
                None if score else last_P)
    memory = out.memory.replace(step=memory.step.at[slots].set(starts + batch.lengths, mode="drop"))
    if state.pool is not None:
        state = state.replace(pool=save_prefix(state.pool, batch, memory, sampler))
    if score:
        scores = score_positions(out.logits, batch.targets[None], sampler)
        logits = out.logits[0, last_P]
    else:
        scores, logits = None, out.logits[0]
    state = state.with_prompts(batch, slots_T, positions_T)
    keys, sample_keys = _seeded(batch)
    # Only a request's last chunk samples: a call of middle chunks never draws or summarises.
    # (The logits are also returned: a request with the same prompt forks from them, ``fork``.)
    draw = functools.partial(sample_token, logits, batch.settings, sample_keys, sampler,
                             _first_rules(batch, state.seen, slots))
    nothing = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(draw))
    first = jax.lax.cond(jnp.any(batch.last), draw, lambda: nothing)
    state, output = _start(state.replace(memory=memory), batch, first, keys)
    # padded to the batch size: one compiled fork serves prefill calls of any row count
    logits_BV = jnp.zeros((b, logits.shape[-1]), logits.dtype).at[: logits.shape[0]].set(logits)
    return state, output, logits_BV, scores


def read_prefix(pool: PrefixPool, batch: PrefillBatch, memory: KVMemory, backend) -> KVMemory:
    """``memory`` with positions ``[0, batch.cached)`` of each row's slot copied from its pool blocks
    ``batch.read``, in place (a copy: the slot never refers to the pool again), by ``backend``'s
    ``copy_blocks``: for the rows that start from a cached prefix only."""
    size, b = pool.block_size, memory.batch_size
    j_J = jnp.arange(batch.read.shape[1], dtype=jnp.int32)
    valid = (j_J[None, :] < (batch.cached // size)[:, None]) & (batch.slots < b)[:, None]
    k, v = backend.copy_blocks((memory.k, memory.v), (pool.k, pool.v), valid,
                               jnp.broadcast_to(batch.slots[:, None], valid.shape),
                               jnp.broadcast_to(j_J * size, valid.shape), batch.read, jnp.zeros_like(batch.read), size)
    return memory.replace(k=k, v=v)


def save_prefix(pool: PrefixPool, batch: PrefillBatch, memory: KVMemory, backend) -> PrefixPool:
    """``pool`` with block j of each row's slot (as the call left it) written to pool block
    ``batch.save[p, j]`` where that is a block (the rest is dropped), by ``backend``'s
    ``copy_blocks``. The call reads the pool (``read_prefix``) before it writes it."""
    size, b, none = pool.block_size, memory.batch_size, pool.num_blocks
    valid = (batch.save < none) & (batch.slots < b)[:, None]  # [P, NB]
    j_J = jnp.arange(valid.shape[1], dtype=jnp.int32)
    k, v = backend.copy_blocks((pool.k, pool.v), (memory.k, memory.v), valid, batch.save, jnp.zeros_like(batch.save),
                               jnp.broadcast_to(batch.slots[:, None], valid.shape),
                               jnp.broadcast_to(j_J * size, valid.shape), size)
    return PrefixPool(k=k, v=v)


def _seeded(batch: PrefillBatch):
    """Each row's PRNG key from now on, and the key of its first draw. The keys derive from the
    seed alone, so chunking or forking never changes a request's samples."""
    split = jax.vmap(jax.random.split)(batch.seed)  # [P, 2, 2]
    return split[:, 0], split[:, 1]


def _first_rules(batch: PrefillBatch, seen_BV, seen_rows) -> Constraints:
    """The ``Constraints`` of each row's first token: no output yet, its prompt's tokens (row
    ``seen_rows[p]`` of ``seen_BV``), its stop ids banned if it has a ``min_tokens``, its mask."""
    seen = jnp.take(seen_BV, seen_rows, axis=0, mode="fill", fill_value=False)
    return Constraints(counts=jnp.zeros(seen.shape, jnp.int32), seen=seen,
                       banned=jnp.where((batch.min_tokens > 0)[:, None], batch.stop_ids, -1),
                       mask=batch.mask, masked=batch.masked)


def _start(state: DecodeState, batch: PrefillBatch, first, keys):
    """``state.start`` for ``batch``'s last-chunk rows, and the call's output: one step of P rows."""
    ended = batch.last & ends(first.token_id, batch.stop_ids, batch.max_len - 1)
    output = DecodeOutput(jax.tree_util.tree_map(lambda a: a[None], first), batch.last[None], ended[None])
    return state.start(batch, first, keys), output


def fork(sampler, state: DecodeState, logits_BV, row, source, batch: PrefillBatch):
    """Slot ``source``'s cache copied into the slot of the one-row ``batch`` (a request with the
    same prompt), and that request started with its first token sampled from ``logits_BV[row]``
    (the last logits of the prefill that wrote ``source``) under its own settings and seed: what
    its own prefill would have computed, bit for bit. Pure: jitted with ``state`` donated."""
    memory, dst = state.memory, batch.slots[0]

    def copy(full):
        return full.at[dst].set(full[source])

    def copy_kv(full):  # [L, B, K, S, H]: the row of every layer
        return full.at[:, dst].set(full[:, source])

    memory = memory.replace(k=jax.tree_util.tree_map(copy_kv, memory.k), v=jax.tree_util.tree_map(copy_kv, memory.v),
                            step=copy(memory.step))
    state = state.replace(memory=memory, seen=copy(state.seen), counts=state.counts.at[dst].set(0),
                          history=copy(state.history))
    keys, sample_keys = _seeded(batch)
    first = sample_token(logits_BV[row][None], batch.settings, sample_keys, sampler,
                         _first_rules(batch, state.seen, source[None]))
    return _start(state, batch, first, keys)


def decode(apply, sampler, params, state: DecodeState, mask: TokenMask, n, kv_len: int, steps: int,
           speculative: int = 0):
    """``n`` decode steps of every slot (a loop on device), attending to the first ``kv_len``
    cache positions; each slot stops where ``ends`` says. A row whose ``mask`` is on takes the
    first step only, under its mask; one it holds takes none. ``n`` is dynamic, at most the static
    ``steps``: the outputs have ``steps`` rows, those past ``n`` not valid, so one compiled call
    serves every count of steps (a decode variant a KV bucket, not one a count too: fewer
    executables to build or load at start). With ``speculative`` (static, > 0; no mask), each of
    ``steps`` steps (``n`` is ignored) is ``speculate``'s: up to that many draft tokens a slot
    verified in one forward. Pure, like ``prefill``."""
    if speculative:
        def one_speculative(state, _):
            return speculate(apply, sampler, params, state, mask, kv_len, speculative)

        state, out = jax.lax.scan(one_speculative, state, jnp.arange(steps))
        flat = lambda a: a.reshape(steps * (speculative + 1), *a.shape[2:])  # noqa: E731: [n, k + 1, ...] -> [n (k + 1), ...]
        return state, DecodeOutput(jax.tree_util.tree_map(flat, out.sample), flat(out.valid), flat(out.ended),
                                   out.drafted, out.accepted, out.ready[-1])

    def one(state, step):
        split = jax.vmap(jax.random.split)(state.keys)  # [B, 2, 2]
        keys, sample_keys = split[:, 0], split[:, 1]
        valid = state.active & ~mask.hold & ~(mask.on & (step > 0))
        lengths = valid.astype(jnp.int32)  # free, finished, prefilling and waiting slots do not advance
        out = apply({"params": params}, state.tokens[:, None], state.memory, lengths, False, kv_len)
        rules = state.constraints(mask.replace(on=mask.on & (step == 0)))
        sample = sample_token(out.logits[:, 0], state.settings, sample_keys, sampler, rules)
        tokens = jnp.where(valid, sample.token_id, state.tokens)
        remaining = state.remaining - lengths
        ended = valid & ends(tokens, state.stop_ids, remaining)
        b = tokens.shape[0]
        rows = jnp.where(valid, jnp.arange(b), b)
        state = state.replace(memory=out.memory, tokens=tokens, keys=jnp.where(valid[:, None], keys, state.keys),
                              remaining=remaining, active=state.active & ~ended,
                              unstoppable=state.unstoppable - lengths,
                              counts=state.counts.at[rows, tokens].add(1, mode="drop"),
                              history=state.history.at[rows, out.memory.step].set(tokens, mode="drop"))
        draft_len, wait = count_down(state, valid)
        return state.replace(draft_len=draft_len, wait=wait), (sample, valid, ended)

    def body(i, carry):
        state, outs = carry
        state, out = one(state, i)
        return state, jax.tree_util.tree_map(lambda buf, o: buf.at[i].set(o), outs, out)

    shapes = jax.eval_shape(lambda s: one(s, jnp.int32(0))[1], state)
    outs = jax.tree_util.tree_map(lambda a: jnp.zeros((steps, *a.shape), a.dtype), shapes)
    state, (samples, valid, ended) = jax.lax.fori_loop(0, jnp.minimum(n, steps), body, (state, outs))
    return state, DecodeOutput(samples, valid, ended, ready=ready_to_draft(state))


