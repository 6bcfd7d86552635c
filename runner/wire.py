"""Several hosts: process 0's commands (submissions and cancellations) broadcast to every process
at the start of each round, so every process applies the same commands and runs the same calls.

Requests travel as their fields and prompt ids (JSON); a follower's requests have no client, so
their events go nowhere (``Nowhere``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from runner.requests import Request, TokenEvent


class Nowhere:
    """The sink of a follower process's requests (process 0 answers the clients)."""

    def put(self, event: TokenEvent) -> None:
        pass


def broadcast(commands: list) -> list:
    """Process 0's ``commands``, on every process (a collective: every process calls it once a
    round; the others pass their own, ignored). A follower's submissions come with a ``Nowhere``."""
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        wire = [["submit", dataclasses.asdict(c[1]), c[2]] if c[0] == "submit" else list(c) for c in commands]
        data = np.frombuffer(json.dumps(wire).encode(), np.uint8)
    else:
        data = np.zeros((0,), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    # padded to a power of two (at least 4 KiB): each buffer size is one more compiled collective
    buffer = np.zeros((max(4096, 1 << (size - 1).bit_length()),), np.uint8)
    buffer[: data.size] = data
    data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size]
    if jax.process_index() == 0:
        return commands
    return [("submit", Request(**c[1]), c[2], Nowhere()) if c[0] == "submit" else tuple(c)
            for c in json.loads(data.tobytes().decode())]
