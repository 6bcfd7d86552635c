"""``PrefixCache``: the host's index of the prefix block pool, which prompts' KV blocks it holds.

A prompt's K/V at position i depends only on tokens 0..i (CONCEPTS.md), so two prompts that share
their first n tokens share those positions' K/V. The device keeps a pool of ``num_blocks`` blocks
of ``block_size`` positions (``runner.state.PrefixPool``); this index says which prompt prefix
each block holds. A block is keyed by a hash of its tokens and of everything before it (the key
of the block before), seeded with the model's identity, and it also keeps its tokens and its
parent's key: a hit compares them exactly, so a hash collision can only miss, never hand one
request another's KV.

A request's first chunk reads its cached blocks, copied into its slot, and its prefill computes
only the rest of the prompt; each chunk saves the prompt's blocks it completed into free (or
least recently used) blocks of the pool. Both happen inside the prefill call (``runner.engine
.prefill``), which reads the pool before it writes it, so a block read by one row and recycled
for another row's save in the same call is read intact. A block written by a call becomes a
hit only once that call has been dispatched (``commit``): later calls run after it on the
device. A request reads its blocks in the call that admits it and never afterwards, so no
running request depends on a block (copies, not shared pages: ``runner.engine.prefill``);
eviction is least recently used first, a chain's deepest block before its parents.

The index is plain host state, changed only by the scheduler, in the same order on every
process of a multi-host run, so every process reads and writes the same blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Optional

import numpy as np


@dataclasses.dataclass
class Block:
    index: int  # in the device pool
    key: bytes
    parent: bytes  # the key of the block before it (the seed for a prompt's first block)
    tokens: tuple[int, ...]
    ready: bool = False  # its writing call was dispatched: a later call may read it


class PrefixCache:
    """Which block of the device pool holds which prompt prefix (see the module docstring).

    ``seed`` identifies the model (a different model's blocks never match); ``queries`` and
    ``hits`` count prompt tokens looked up and found (vLLM's ``prefix_cache_queries`` /
    ``prefix_cache_hits``)."""

    def __init__(self, num_blocks: int, block_size: int, seed: bytes = b""):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"PrefixCache needs positive num_blocks and block_size, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.seed = hashlib.blake2b(seed, digest_size=16).digest()
        self.queries = self.hits = 0
        self.clear()

    def clear(self) -> None:
        """Forget every block (the pool's contents are lost: a device call failed)."""
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # oldest use first
        self._free = list(range(self.num_blocks - 1, -1, -1))  # popped from the end: block 0 first

    def __len__(self) -> int:
        return len(self._blocks)

    def key(self, parent: bytes, tokens) -> bytes:
        return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()

    def match(self, ids: list[int]) -> list[Block]:
        """The blocks holding the longest cached prefix of ``ids`` that leaves at least its last
        token to compute (its logits start the request). Changes nothing: ``use`` does."""
        usable = (len(ids) - 1) // self.block_size
        found, parent = [], self.seed
        for j in range(usable):
            tokens = tuple(ids[j * self.block_size: (j + 1) * self.block_size])
            key = self.key(parent, tokens)
            block = self._blocks.get(key)
            if block is None or not block.ready or block.tokens != tokens or block.parent != parent:
                break
            found.append(block)
            parent = key
        return found

    def use(self, ids: list[int], found: list[Block]) -> None:
        """A request with prompt ``ids`` takes the blocks ``found`` (``match``, this round): they
        are the most recently used, and the lookup is counted in ``queries`` and ``hits``."""
        for block in reversed(found):  # the deepest is evicted first: parents most recently used
            self._blocks.move_to_end(block.key)
        self.queries += len(ids)
        self.hits += len(found) * self.block_size

    def allocate(self, ids: list[int], first: int, end: int) -> list[tuple[int, int]]:
        """Pool blocks for the prompt blocks ``first`` .. ``end - 1`` of ``ids`` (each fully
        computed by the call being made): ``(block number in the prompt, pool block)`` for each one
        not cached yet. They become hits at ``commit``. A block is taken from the free ones, else
        the least recently used ready one is evicted; none left (all are being written in this
        call): the rest are not saved."""
        parent = self.seed
        for j in range(first):
            parent = self.key(parent, ids[j * self.block_size: (j + 1) * self.block_size])
        out = []
        for j in range(first, end):
            tokens = tuple(ids[j * self.block_size: (j + 1) * self.block_size])
            key = self.key(parent, tokens)
            if key not in self._blocks:
                index = self._take()
                if index is None:
                    break
                self._blocks[key] = Block(index, key, parent, tokens)
                out.append((j, index))
            parent = key
        return out

    def commit(self) -> None:
        """The call writing the allocated blocks was dispatched: they may be read from now on."""
        for block in self._blocks.values():
            block.ready = True

    def drop(self, pool_blocks: list[int]) -> None:
        """Forget allocated blocks whose call was never made (their row could not be)."""
        drop = set(pool_blocks)
        for key in [k for k, b in self._blocks.items() if b.index in drop and not b.ready]:
            self._free.append(self._blocks.pop(key).index)

    def _take(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for key, block in self._blocks.items():  # least recently used first
            if block.ready:
                del self._blocks[key]
                return block.index
        return None
