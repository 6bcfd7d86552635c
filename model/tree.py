"""Names of parameters in a pytree."""

from __future__ import annotations


def path_str(path) -> str:
    """'/'-joined names of a pytree key path (dict keys and dataclass fields)."""
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "name", key))))
    return "/".join(parts)
