"""Building the C++ kernels: the machine's compiler, a cache keyed by the CPU, and registration
with XLA's FFI. The one place in the project that runs a compiler or writes a cache.

The kernels are C++ (``panel_matmul.cc``, ``attention.cc``, ``sampling.cc`` beside this file),
built on first use with the machine's C++ compiler (``$CXX``, else ``c++`` or ``g++``; ``-O3
-march=native``, the sources side by side, about 4 s on 2 cores). They are written for the vector
registers the target has: 16 floats and 32 registers with AVX-512, 8 floats and 16 registers with
AVX2 (``kernels.h``; vectors wider than the registers made the AVX2 build 4-50x slower).
``GROK_RUNNER_KERNEL_MARCH`` builds for another ``-march`` (``x86-64-v3``: the AVX2 variants on an
AVX-512 machine). The library is cached under ``~/.cache/grok-runner/kernels``
(``GROK_RUNNER_KERNEL_CACHE`` overrides it), keyed by the sources, jax's version, the CPU, the
compiler and the target (``library_path()``). Without a compiler, or when the build fails,
``available()`` is False and ``unavailable_reason()`` says why; the runner then says so (a
``ValueError`` where the CPU backend was asked for, a logged line where it was only preferred).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("panel_matmul.cc", "attention.cc", "sampling.cc"))
HEADERS = (HERE / "kernels.h",)
MATMUL = "grok_runner_panel_matmul"
GROUPED = "grok_runner_grouped_panel_matmul"
INT8_MATMUL = "grok_runner_int8_panel_matmul"
INT8_GROUPED = "grok_runner_grouped_int8_panel_matmul"
W8A8_GROUPED = "grok_runner_grouped_w8a8_panel_matmul"
BF16_MATMUL = "grok_runner_bf16_panel_matmul"
BF16_GROUPED = "grok_runner_grouped_bf16_panel_matmul"
ATTENTION = "grok_runner_decode_attention"
ATTENTION_INT8 = "grok_runner_decode_attention_int8"
ATTENTION_BF16 = "grok_runner_decode_attention_bf16"
KV_WRITE = "grok_runner_kv_write"
KV_READ = "grok_runner_kv_read"
KV_COPY_BLOCKS = "grok_runner_kv_copy_blocks"
FILTER = "grok_runner_sampling_threshold"
SUMMARY = "grok_runner_logits_summary"


def march() -> str:
    """The ``-march`` the kernels are built for: the CPU at hand unless ``GROK_RUNNER_KERNEL_MARCH``
    names another (``x86-64-v3`` builds the AVX2 variants on an AVX-512 machine, to measure them)."""
    return os.environ.get("GROK_RUNNER_KERNEL_MARCH") or "native"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path() -> Path | None:
    """Where the kernel library for this CPU, compiler and source lives (built or not); None
    without a compiler. Its calibration (``runner/calibration.py``) is cached beside it."""
    cxx = _compiler()
    if not cxx:
        return None
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + jax.__version__.encode() + _cpu_id().encode() + cxx.encode()
                         + march().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GROK_RUNNER_KERNEL_CACHE", "~/.cache/grok-runner/kernels")).expanduser()
    return cache / f"kernels-{key}.so"


_BUILD_LOCK = threading.Lock()


def prebuild() -> None:
    """Start building the kernels in a background thread, if they are not built yet: the
    compiler runs while the caller restores a checkpoint. ``available()`` then waits for it."""
    if _build_once.cache_info().currsize == 0:
        threading.Thread(target=available, name="kernel-build", daemon=True).start()


def _build() -> str | None:
    """Compile and register the kernel once per process; None when it works, else why not."""
    with _BUILD_LOCK:  # one build, however many threads ask
        return _build_once()


@functools.lru_cache(maxsize=None)
def _build_once() -> str | None:
    cxx, lib = _compiler(), library_path()
    if lib is None:
        return "no C++ compiler found (set $CXX)"
    cache = lib.parent
    try:
        if not lib.exists():
            cache.mkdir(parents=True, exist_ok=True)
            why_not = _compile(cxx, lib)
            if why_not:
                return why_not
        library = ctypes.cdll.LoadLibrary(str(lib))
        handlers = {MATMUL: library.panel_matmul, GROUPED: library.grouped_panel_matmul,
                    INT8_MATMUL: library.int8_panel_matmul, INT8_GROUPED: library.grouped_int8_panel_matmul,
                    W8A8_GROUPED: library.grouped_w8a8_panel_matmul,
                    BF16_MATMUL: library.bf16_panel_matmul, BF16_GROUPED: library.grouped_bf16_panel_matmul,
                    ATTENTION: library.decode_attention, ATTENTION_INT8: library.decode_attention_int8,
                    ATTENTION_BF16: library.decode_attention_bf16, KV_WRITE: library.kv_write, KV_READ: library.kv_read,
                    KV_COPY_BLOCKS: library.kv_copy_blocks,
                    FILTER: library.sampling_threshold, SUMMARY: library.logits_summary}
    except (OSError, AttributeError, subprocess.SubprocessError) as e:  # unwritable cache, compiler crash, bad library
        return f"building or loading {lib} failed: {e}"
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    global _bf16_dot, _int8_dot
    _bf16_dot = bool(library.grok_runner_bf16_dot())
    _int8_dot = INT8_DOTS[library.grok_runner_int8_dot()]
    return None


_bf16_dot = False
INT8_DOTS = ("emulated", "AVX-VNNI", "AVX512-VNNI")  # grok_runner_int8_dot(): the w8a8 kernels' instruction
_int8_dot = INT8_DOTS[0]


def int8_dot() -> str:
    """What the w8a8 kernels sum int8 products on: "AVX512-VNNI" or "AVX-VNNI" (vpdpbusd), else
    "emulated" (the same sums from shifts and multiplies, exact and slower; also where the
    kernels cannot be built)."""
    return _int8_dot if available() else INT8_DOTS[0]


def bf16_dot() -> bool:
    """Whether the bf16 kernels multiply on AVX512-BF16's dot instruction (vdpbf16ps: the target
    has it) rather than widening bf16 to float32 in registers (building the kernels on the first
    call; False where they cannot be built)."""
    return available() and _bf16_dot


def _compile(cxx: str, lib: Path) -> str | None:
    """Build the library at ``lib``: the sources compile side by side (each takes about 2.5 s,
    mostly XLA's FFI headers), then link. None when it works, else why not."""
    flags = [cxx, "-O3", f"-march={march()}", "-std=c++17", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objects = [Path(tmp) / f"{path.stem}.o" for path in SOURCES]
        jobs = [subprocess.Popen([*flags, "-c", str(path), "-o", str(obj)], stderr=subprocess.PIPE, text=True)
                for path, obj in zip(SOURCES, objects)]
        errors = [(path, job.communicate(timeout=300)[1]) for path, job in zip(SOURCES, jobs)]
        failed = [f"{path.name}: {err.strip()[-500:] or f'exit status {job.returncode}'}"
                  for (path, err), job in zip(errors, jobs) if job.returncode]
        if not failed:
            linked = subprocess.run([cxx, "-shared", *map(str, objects), "-o", f"{tmp}/lib.so"], stderr=subprocess.PIPE,
                                    text=True, timeout=300)
            if linked.returncode == 0:
                os.replace(f"{tmp}/lib.so", lib)  # atomic: a concurrent build never sees half a library
                return None
            failed = [f"linking: {linked.stderr.strip()[-500:]}"]
    return f"building {', '.join(path.name for path in SOURCES)} failed: " + "; ".join(failed)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _build() is None


def unavailable_reason() -> str | None:
    return _build()


def require() -> None:
    """Raise ``RuntimeError`` saying why, unless the kernels are built and registered."""
    reason = _build()
    if reason is not None:
        raise RuntimeError(f"the CPU kernels are unavailable: {reason}")
