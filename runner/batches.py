"""A plan's rows as the host arrays of a device call: each request's chunk, slot, sampling
settings, seed, stop ids and prefix-cache block tables written into a ``PrefillBatch`` row.

The executor sees only these arrays (``runner/executor.py``); the scheduler's ``RequestState`` and
the ``Request`` behind it stop here.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

from runner.requests import Request
from runner.sampling import SampleSettings
from runner.state import MAX_STOP_IDS, PrefillBatch

if TYPE_CHECKING:
    from runner.scheduler import PrefillRow, RequestState


def stop_ids(request: Request, eos_token: int) -> list[int]:
    """The ids that end ``request``: EOS first (unless it ignores EOS), then its stop tokens."""
    eos = [] if request.ignore_eos else [eos_token]
    return eos + sorted(set(request.stop_token_ids) - set(eos))


def prefill_row(batch: PrefillBatch, i: int, row: PrefillRow, eos_token: int) -> None:
    """Write ``row`` (a chunk of one request) as row ``i`` of the host arrays of ``batch``, its
    tokens packed at its offset."""
    s, offset = row.sequence, row.offset
    chunk = slice(offset, offset + row.length)
    batch.tokens[chunk] = s.ids[row.start: row.start + row.length]
    batch.row[chunk], batch.offset[i] = i, offset
    batch.lengths[i] = row.length
    batch.first[i] = row.start == s.cached  # its first chunk
    if batch.first[i] and s.cached:
        batch.cached[i] = s.cached
        batch.read[i, : len(s.read_blocks)] = s.read_blocks
    batch.last[i] = row.start + row.length == len(s.ids)
    # position j predicts prompt token j + 1: what a scoring prefill scores (the last predicts none)
    targets = s.ids[row.start + 1: row.start + row.length + 1]
    batch.targets[offset: offset + len(targets)] = targets
    request_row(batch, i, s, eos_token)


def request_row(batch: PrefillBatch, i: int, sequence: RequestState, eos_token: int) -> None:
    """The slot and settings of ``sequence``'s request in row ``i`` of ``batch``."""
    request = sequence.request
    batch.slots[i] = sequence.slot
    settings = batch.settings
    settings.temperature[i], settings.nucleus_p[i], settings.top_k[i] = (request.temperature, request.nucleus_p,
                                                                          request.top_k)
    settings.logprobs[i] = -1 if request.logprobs is None else request.logprobs
    for name in ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        getattr(settings, name)[i] = getattr(request, name)
    batch.seed[i] = seed_key(request.rng_seed if request.rng_seed is not None else default_seed(request))
    batch.max_len[i] = request.max_len
    batch.min_tokens[i] = request.min_tokens
    batch.speculative[i] = sequence.speculative
    stop = stop_ids(request, eos_token)
    batch.stop_ids[i, : len(stop)] = stop


def empty_batch(rows: int, bucket: int, batch_size: int, blocks: int = 0, pool_blocks: int = 0, *,
                vocab_size: int) -> PrefillBatch:
    """A prefill batch of ``rows`` padding rows (slot = batch size) and ``bucket`` padding tokens,
    as host arrays; its prefix cache tables have ``blocks`` columns and name no block
    (``pool_blocks``: the pool's size); its masks ``ceil(vocab_size / 32)`` words, all off."""
    return PrefillBatch(
        slots=np.full((rows,), batch_size, np.int32), tokens=np.zeros((bucket,), np.int32),
        row=np.full((bucket,), rows, np.int32), offset=np.zeros((rows,), np.int32),
        lengths=np.zeros((rows,), np.int32), first=np.zeros((rows,), bool), last=np.zeros((rows,), bool),
        settings=SampleSettings.host(rows), seed=np.zeros((rows, 2), np.uint32),
        max_len=np.ones((rows,), np.int32), min_tokens=np.zeros((rows,), np.int32),
        speculative=np.zeros((rows,), np.int32),
        stop_ids=np.full((rows, MAX_STOP_IDS), -1, np.int32),
        mask=np.zeros((rows, -(-vocab_size // 32)), np.uint32), masked=np.zeros((rows,), bool),
        targets=np.full((bucket,), -1, np.int32), cached=np.zeros((rows,), np.int32),
        read=np.zeros((rows, blocks), np.int32), save=np.full((rows, blocks), pool_blocks, np.int32))


def seed_key(seed: int) -> np.ndarray:
    """A seed's PRNG key: its 64 bits (mod 2**64) as two uint32 words, high first
    (``runner.requests.SEED_LIMIT``): ``jax.random.PRNGKey(seed)`` for a seed below 2**32."""
    bits = seed % 2**64
    return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


def default_seed(request: Request) -> int:
    """The seed of a request that names none: derived from its id, so every process of a
    multi-host run draws the same tokens (each runs the same scheduler on the same requests)."""
    return zlib.crc32(request.request_id.encode())
