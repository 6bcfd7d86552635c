"""Count XLA compilations in this process (for run.py's summary and the no-recompile tests).

It registers one listener on JAX's monitoring events the first time it is used; nothing else
about JAX's behaviour changes.
"""

from __future__ import annotations

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        _count += 1


def compilations() -> int:
    """Backend compilations since the first call of this function."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True
    return _count
