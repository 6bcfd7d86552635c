"""Reading files this program did not write (checkpoints, their configs, tokenizers): the one
place for the checks every reader makes and the limits it keeps.

A file may be hostile: anything it says is data, never code (``safe_pickle``, ``torch_zip``), and
a failure is one ``CheckpointError`` naming the file, never another exception, a hang or an
unbounded allocation. What a reader needs from here:

- ``regular_file``: the path is a regular file (a FIFO would block a reader forever, a device
  would never end), followed through symlinks as the user's own path is;
- ``read_bounded``: its bytes, at most a named limit of them, checked before anything is read
  (``read_json``: parsed);
- ``shown``: anything taken from a file, put into an error message: control characters escaped
  (a newline in a pickled name would forge a log line, an escape sequence drive the terminal)
  and cut to ``SHOWN_CHARS``.
"""

from __future__ import annotations

import json
import os
import stat


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be loaded safely and exactly."""


# Characters of a file's text an error message shows (a name, a key, a list of names): enough to
# recognise it, never a 31 MB line.
SHOWN_CHARS = 200

# A JSON file of a checkpoint's metadata (config.json, a safetensors index): Grok-1's and Grok-2's
# configs are 1 to 3 kB, an index of 10,000 tensors about 1 MB; 16 MB is far past any and still
# parses in a moment (a 1.5 GB config.json was read whole before).
JSON_BYTES = 16 << 20

# A tokenizer file (tokenizer.model, tokenizer.json, tokenizer.tok.json): Grok-1's SentencePiece
# model is 2 MB, Grok-2's tiktoken JSON and the largest Hugging Face tokenizer.json we know
# (Gemma 3's, 262,144 tokens) under 35 MB; at 64 MB a parse still takes a second or two (a 200 MB
# one, parsed three times, ended the process before).
TOKENIZER_BYTES = 64 << 20

# A safetensors header (the JSON index of one file's tensors): a file of 5,000 tensors has one
# under 1 MB; 64 MB a file, and 128 MB for all the files of one checkpoint together (nine files
# of 100 MB headers each were all parsed and kept before).
HEADER_BYTES = 64 << 20
HEADERS_BYTES = 128 << 20

# Objects a pickle may memoise: a numpy array's pickle memoises under 20, a PyTorch state dict a
# few a tensor; 262,144 holds 50,000 tensors a file (36 MB of MEMOIZE opcodes grew the table
# without end before).
MAX_MEMO = 1 << 18

# Tokens a tiktoken file may list: eight times the largest published vocabulary (262,144).
MAX_VOCAB = 1 << 21

# The largest size of any one dimension a config may give (hidden size, heads, layers, experts,
# vocabulary, positions): Grok-1's largest is its 131,072-token vocabulary, Grok-2's its 131,072
# positions; 2^24 leaves room for any model this runner could hold, and keeps every product of
# a few of them an exact integer that no shape computation overflows.
MAX_DIMENSION = 1 << 24


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """``value`` (text or anything printable) as one line for an error message: control and
    non-printable characters escaped as ``repr`` escapes them, cut to ``limit`` characters with
    how many more there were."""
    text = value if isinstance(value, str) else str(value)
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return escaped if len(text) <= limit else f"{escaped}... ({len(text) - limit:,} more characters)"


def regular_file(path: str, what: str) -> None:
    """``CheckpointError`` unless ``path`` is a regular file (a FIFO would block the reader forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise CheckpointError(f"{path}: {what} is {kind}, not a regular file")


def read_bounded(path: str, what: str, limit: int, why: str) -> bytes:
    """The bytes of regular file ``path`` (``what`` it is), refused unread if it holds more than
    ``limit`` (``why``: the limit's name, said in the error)."""
    regular_file(path, what)
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise CheckpointError(f"{path}: {what} of {size:,} bytes is larger than {why} ({limit:,} bytes)")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    if len(data) > limit:  # it grew meanwhile
        raise CheckpointError(f"{path}: {what} is larger than {why} ({limit:,} bytes)")
    return data


def read_json(path: str, what: str, limit: int = JSON_BYTES, why: str = "JSON_BYTES"):
    """The JSON value of file ``path`` (``what`` it is), read within ``limit`` bytes."""
    data = read_bounded(path, what, limit, why)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # bad JSON or text, or an integer of over 4,300 digits
        raise CheckpointError(f"{path}: {what} is not valid JSON ({type(e).__name__})") from None


def library_failure(error: BaseException) -> bool:
    """Whether ``error``, raised out of a native library's call, is that call failing (a Rust
    panic, ``pyo3_runtime.PanicException``, derives from BaseException) rather than the process
    being stopped: a caller turns it into an error of its own, naming the file behind it."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


class Spent:
    """Bytes of one kind read so far across the files of one checkpoint, against a limit."""

    def __init__(self, limit: int, why: str):
        self.limit, self.why, self.bytes = limit, why, 0

    def spend(self, path: str, n: int, what: str) -> None:
        self.bytes += n
        if self.bytes > self.limit:
            raise CheckpointError(f"{path}: its {what} of {n:,} bytes brings the checkpoint's to {self.bytes:,}, past "
                                  f"{self.why} ({self.limit:,} bytes)")
