"""Count XLA compilations in this process (for run.py's summary and the no-recompile tests), and
the runner's own steps compiled (the test suite's budget of them a file: tests/conftest.py).

It registers one listener on JAX's monitoring events the first time it is used; nothing else
about JAX's behaviour changes.
"""

from __future__ import annotations

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"  # also fires for a persistent-cache hit
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_count = 0
_hits = 0
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        _count += 1


def _hit_listener(event: str, **kwargs) -> None:
    global _hits
    if event == _CACHE_HIT:
        _hits += 1


def compilations() -> int:
    """Executables built since the first call of this function: compiled, or loaded from JAX's
    persistent compilation cache (``cache_hits`` says how many of them were)."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        jax.monitoring.register_event_listener(_hit_listener)
        _registered = True
    return _count


def cache_hits() -> int:
    """Of ``compilations()``, those loaded from the persistent compilation cache."""
    compilations()
    return _hits


_steps = 0


def step_compiled() -> None:
    """The executor compiled one of its steps (a prefill or decode variant), not loaded it."""
    global _steps
    _steps += 1


def steps_compiled() -> int:
    """The runner's steps compiled in this process (``runner.executor``: at start or on demand);
    those loaded from a store of compiled steps are not counted."""
    return _steps
