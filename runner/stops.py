"""Stop strings (``Request.stop``) matched on a request's generated text across token boundaries.

Text is released as soon as no stop string can still start in it: a tail that is a prefix of a
stop string is held back only until the next piece shows whether the match completes. The stop
string itself and everything after it are never released.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched (the earliest in the text)

    def feed(self, text: str) -> str:
        """The part of ``held + text`` that is safe to release; sets ``stopped`` at a match."""
        if self.stopped:
            return ""
        buffer = self.held + text
        hits = [(i, s) for i, s in ((buffer.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            self.stopped, self.held = True, ""
            return buffer[:at]
        keep = 0  # the longest tail of the buffer that begins some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buffer)), keep, -1):
                if buffer.endswith(s[:n]):
                    keep = n
                    break
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation without a match: what is still held back."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
