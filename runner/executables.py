"""Compiled steps kept on disk, so a second start loads them instead of tracing and compiling.

JAX's persistent compilation cache skips XLA's compile but not the tracing and lowering before it,
which cost as much (on a 2-core EPYC, the bench config's 78 variants: 31 s of tracing, 18 s of
lowering, 18 s of reading the cache; BENCHMARKS.md). This store keeps each executable serialised
(``jax.experimental.serialize_executable``) under a key of everything that decides the program,
known before anything is traced:

- the code: every source file of ``model/``, ``runner/`` and ``backends/``, and the CPU kernels'
  library (its name is a hash of its source, compiler, CPU and JAX);
- JAX and jaxlib's versions, the platform, the devices and mesh, ``XLA_FLAGS``, JAX's settings;
- the model: its config, the parameters' tree, shapes, dtypes and shardings as placed (the
  backend's layout included), the decode state's likewise, the backend and its kernel choices;
- the variant: its name and static arguments, and its batch's shapes.

Anything else changed is a miss: the variant is traced and compiled as on a first start, and
stored. A file that cannot be read (truncated, another version's) is a miss too, and replaced.
The directory is trusted like the Python environment: what it holds is machine code this
process runs (as JAX's own cache is); it is the user's cache directory, never a checkpoint's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Optional

import jax

log = logging.getLogger("grok_runner")

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("model", "runner", "backends")  # the packages whose code the steps trace


def _sources_digest() -> bytes:
    digest = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and path.is_file():
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.digest()


def _config_values() -> str:
    """JAX's settings that can change a program (not where caches or logs go)."""
    values = jax.config.values
    return repr(sorted((k, v) for k, v in values.items()
                       if isinstance(v, (str, int, float, bool, type(None)))
                       and not any(word in k for word in ("cache", "log", "debug", "traceback", "explain"))))


def tree_signature(tree) -> str:
    """A pytree's structure and each leaf's shape, dtype and sharding (as placed)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    described = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        described.append((getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf).__name__)),
                          repr(sharding) if sharding is not None else None))
    return repr((str(treedef), described))


def stable_repr(value) -> str:
    """``repr`` that is the same in every process: sets sorted (a set's order follows string
    hashing, which differs between processes), dataclasses by their fields."""
    import dataclasses

    def plain(v):
        if isinstance(v, (set, frozenset)):
            return ("set", sorted((plain(x) for x in v), key=repr))
        if isinstance(v, dict):
            return ("dict", sorted(((plain(k), plain(x)) for k, x in v.items()), key=repr))
        if isinstance(v, (list, tuple)):
            return type(v).__name__, [plain(x) for x in v]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return type(v).__name__, [(f.name, plain(getattr(v, f.name))) for f in dataclasses.fields(v)]
        return repr(v)

    return repr(plain(value))


def fingerprint(*parts: str) -> str:
    """The key of a set of compiled steps: the code, the platform and ``parts`` (the model's)."""
    import jaxlib

    from backends.cpu.build import library_path

    library = library_path()
    devices = [(d.id, d.platform, d.device_kind, getattr(d, "process_index", 0)) for d in jax.devices()]
    digest = hashlib.sha256(_sources_digest())
    for part in (jax.__version__, jaxlib.__version__, repr(devices), jax.devices()[0].client.platform_version,
                 os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), _config_values(),
                 library.name if library is not None else "", *parts):
        digest.update(hashlib.sha256(str(part).encode()).digest())
    return digest.hexdigest()[:24]


def trusted(file: Path) -> None:
    """A stored step is unpickled (jax's own serialisation is a pickle): only a file this user
    wrote, in a directory only this user may write, as the kernels' library beside it is trusted
    (``backends/cpu/build.py``). A checkpoint is never read this way. ``PermissionError`` otherwise."""
    for path in (file, file.parent):
        st = path.stat()
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise PermissionError(f"{path}: not owned by this user, not loaded")
        if st.st_mode & 0o022:
            raise PermissionError(f"{path}: writable by group or others, not loaded")


class ExecutableStore:
    """Serialised executables of one fingerprint in ``directory/<fingerprint>/``."""

    def __init__(self, directory: str | os.PathLike, key: str, devices=None):
        self.path = Path(directory).expanduser() / key
        self.devices = devices  # the mesh's devices, in order: where a loaded executable runs

    def _file(self, name: str) -> Path:
        return self.path / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".exe")

    def holds(self, name: str) -> bool:
        """Whether a step is stored as ``name`` (it may still prove unreadable when loaded)."""
        return self._file(name).is_file()

    def load(self, name: str):
        """The ``jax.stages.Compiled`` stored as ``name``, or None (absent or unreadable)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        file = self._file(name)
        try:
            trusted(file)
            blob = file.read_bytes()
        except FileNotFoundError:
            return None
        except PermissionError as e:
            log.warning("%s: compiling it", e)
            return None
        except OSError as e:
            log.warning("compiled step %s unreadable (%s): compiling it", file, e)
            return None
        try:
            stored_name, payload, in_tree, out_tree = pickle.loads(blob)
            if stored_name != name:
                raise ValueError(f"holds {stored_name!r}")
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=self.devices)
        except Exception as e:  # truncated, another version's: compiled again and replaced
            log.warning("compiled step %s unusable (%s: %s): compiling it", file, type(e).__name__, e)
            return None

    def compile(self, name: str, lowered):
        """``lowered.compile()``, stored as ``name`` unless JAX took it from its persistent
        compilation cache: such an executable does not survive a second serialisation (jaxlib
        0.10.2: loaded again, its calls fail with ``NOT_FOUND: Function ... not found``), so it is
        only used. A hit on another thread meanwhile only skips a store, never stores a bad one."""
        from runner.compile_count import cache_hits

        hits = cache_hits()
        compiled = lowered.compile()
        if cache_hits() == hits:
            self.save(name, compiled)
        else:
            log.debug("compiled step %s came from JAX's compilation cache: not stored", name)
        return compiled

    def save(self, name: str, compiled) -> None:
        """Store ``compiled`` as ``name`` (written to a temporary file, then renamed: a reader
        never sees half a file). A step that cannot be serialised is only logged."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            blob = pickle.dumps((name, payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._file(name))
        except Exception as e:
            log.warning("compiled step %s not stored (%s: %s)", name, type(e).__name__, e)


def open_store(directory: Optional[str], *parts: str, devices=None) -> Optional[ExecutableStore]:
    """The store for ``parts`` under ``directory`` (None: no store). One process only: on several
    hosts every process compiles (JAX's persistent cache still serves them)."""
    if directory is None or jax.process_count() > 1:
        return None
    return ExecutableStore(directory, fingerprint(*parts), devices)
