"""What a start is doing and how long each part took: the phases of ``InferenceRunner.initialize``.

A ``Startup`` is handed to ``initialize``; the executor and the engine mark their phases on it
(``with startup.phase("restore"):``) and count the compiled variants through it (a progress bar:
i of N, elapsed, ETA). The server reads ``status()`` for ``/health`` while it starts, and
``summary()`` is the line a start ends with: how long each phase took. Without one nothing is
shown (``Startup.quiet()``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Optional, TextIO


class Startup:
    """The phases of one start, in order, with their durations (seconds). Thread-safe to read."""

    def __init__(self, stream: Optional[TextIO] = None, began: Optional[float] = None):
        self.stream = stream  # None: record only, show nothing
        self.began = time.perf_counter() if began is None else began  # the process's start, if known
        self.durations: dict[str, float] = {}
        self.current: Optional[str] = None
        self.done, self.total = 0, 0  # the counted phase's progress (compilations)
        self.notes: dict[str, str] = {}  # a phase's detail for the summary ("78 variants: 78 loaded")
        self._lock = threading.Lock()
        self._bar = None

    @classmethod
    def quiet(cls) -> "Startup":
        return cls(stream=None)

    def mark(self, name: str, since: float) -> None:
        """A phase that ran before this object existed (the imports): from ``since`` to now."""
        with self._lock:
            self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - since

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` (phases of the same name add up)."""
        with self._lock:
            outer, self.current = self.current, name
        began = time.perf_counter()
        if self.stream is not None:
            print(f"start: {name}", file=self.stream, flush=True)
        try:
            yield self
        finally:
            with self._lock:
                self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - began
                self.current = outer

    def count(self, total: int, what: str) -> None:
        """The current phase does ``total`` items (``what``); ``step()`` after each."""
        with self._lock:
            self.done, self.total = 0, total
        if self.stream is not None and total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit="", file=self.stream, dynamic_ncols=True,
                             bar_format="{desc}: {n}/{total} |{bar}| {elapsed} elapsed, ETA {remaining}")

    def step(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            finished = self.done >= self.total
        if self._bar is not None:
            self._bar.update(n)
            if finished:
                self._bar.close()
                self._bar = None

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def status(self) -> dict:
        """Where the start is now, for ``/health`` while starting."""
        with self._lock:
            status = {"status": "starting", "phase": self.current or "starting",
                      "elapsed_s": round(time.perf_counter() - self.began, 1)}
            if self.total:
                status["progress"] = {"done": self.done, "total": self.total}
        return status

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def summary(self) -> str:
        """One line: the whole start, then each phase (with its note)."""
        parts = [f"{name} {seconds:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                 for name, seconds in self.durations.items()]
        return f"started in {self.elapsed():.2f} s: " + ", ".join(parts)


def stderr_startup(began: Optional[float] = None) -> Startup:
    """A ``Startup`` that shows its phases and progress on stderr."""
    return Startup(stream=sys.stderr, began=began)
