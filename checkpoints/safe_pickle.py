"""Read Grok-1's pickled tensors without unpickling: a tiny interpreter of the pickle opcodes.

A released Grok-1 checkpoint file is a protocol-4 pickle of a numpy array or of a
``QuantizedWeight8bit`` holding two arrays. Unpickling it would import and call whatever the
file names, so any checkpoint could run code on the machine. Here the opcode stream is interpreted
symbolically: the only globals a file may name are numpy's array reconstructor, ``numpy.ndarray``,
``numpy.dtype``, ``ml_dtypes.bfloat16`` and ``QuantizedWeight8bit``, and nothing is ever called;
the interpreter only records what each array's dtype, shape and raw-bytes offset are. The payload
is then read (or memory-mapped, for lazily sliced reads of large tensors) straight from the file.
Anything else (another global, an opcode outside the small set numpy's pickles use, an object
dtype, a truncated file) is a ``CheckpointError`` naming the file and what it asked for.

A malformed or hostile stream is one too, never another exception and never a crash: every pop
checks the stack, containers nest at most ``MAX_DEPTH`` deep and the stack holds at most
``MAX_STACK`` items, dictionary keys must be strings (nothing the file built is ever hashed or
printed), a declared length is checked against the bytes left before anything is read or
allocated, text is decoded with its errors caught, and sizes are Python integers checked against
the bytes the file actually holds.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import ml_dtypes
import numpy as np

# CheckpointError and regular_file: read from here by other modules too
from untrusted import MAX_MEMO, CheckpointError, regular_file, shown  # noqa: F401


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
    """Where a pickled numpy array's bytes lie in its file."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    fortran_order: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python integers: never overflows

    def memmap(self) -> np.ndarray:
        """A read-only view of the array on disk (no bytes read until sliced)."""
        if self.nbytes == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, "r", self.offset, self.shape,
                         order="F" if self.fortran_order else "C")

    def read(self) -> np.ndarray:
        return np.array(self.memmap())


@dataclasses.dataclass(frozen=True)
class QuantizedRecord:
    """A pickled ``QuantizedWeight8bit``: an int8 weight and its scales."""

    weight: ArrayRecord
    scales: ArrayRecord


_RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}
_ALLOWED_DTYPE_NAMES = {"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8"}


class _Global:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @property
    def kind(self) -> str:
        key = (self.module, self.name)
        if key in _RECONSTRUCT:
            return "reconstruct"
        if key == ("numpy", "ndarray"):
            return "ndarray"
        if key == ("numpy", "dtype"):
            return "dtype"
        if key == ("ml_dtypes", "bfloat16"):
            return "bfloat16"
        if self.name == "QuantizedWeight8bit":
            return "quantized"
        return "forbidden"


class _PendingArray:
    """An array between ``_reconstruct(...)`` and its ``BUILD``."""


@dataclasses.dataclass(frozen=True)
class _Payload:
    offset: int
    length: int


class _Quantized:
    def __init__(self):
        self.fields = {}


_MARK = object()
MAX_DEPTH = 32  # containers within containers: a numpy pickle nests 3 deep
MAX_STACK = 100_000  # items on the stack (marks included)


def read_pickled_tensor(path: str) -> ArrayRecord | QuantizedRecord:
    """Interpret the pickle at ``path``; return where its array(s) lie. Never executes code."""
    regular_file(path, "checkpoint file")
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint file ({e.strerror})") from None
    return _Interpreter(path, size).run()


class _Interpreter:
    """The subset of pickle protocol 2-5 that numpy arrays and simple records use."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self.file = open(path, "rb")
        self.pos = 0
        self.op_start = 0  # the offset of the opcode being interpreted, for errors
        self.stack: list = []
        self.memo: dict[int, object] = {}
        self.depths: dict[int, int] = {}  # id -> nesting depth of the containers built here
        self.keep: list = []  # those containers, alive while interpreting so that no id is reused

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message} (opcode at byte offset {self.op_start})")

    def read(self, n: int) -> bytes:
        if n > self.size - self.pos:  # checked before anything is allocated
            raise self.error(f"truncated file (wanted {n} bytes at offset {self.pos}, file has {self.size})")
        self.file.seek(self.pos)
        data = self.file.read(n)
        if len(data) != n:
            raise self.error(f"truncated file (wanted {n} bytes at offset {self.pos}, file has {self.size})")
        self.pos += n
        return data

    def text(self, n: int) -> str:
        try:
            return self.read(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"malformed pickle: a string that is not UTF-8 ({e.reason})") from None

    def push(self, obj) -> None:
        if len(self.stack) >= MAX_STACK:
            raise self.error(f"malformed pickle: more than {MAX_STACK} items on the stack")
        self.stack.append(obj)

    def pop(self):
        if not self.stack or self.stack[-1] is _MARK:
            raise self.error("malformed pickle: an opcode needs an item the stack does not hold")
        return self.stack.pop()

    def top(self):
        if not self.stack:
            raise self.error("malformed pickle: an opcode needs an item the stack does not hold")
        return self.stack[-1]

    def depth(self, obj) -> int:
        return self.depths.get(id(obj), 0)

    def container(self, obj, items):
        """``obj`` (a tuple, list or dict just built from ``items``), its depth checked and kept."""
        depth = 1 + max((self.depth(item) for item in items), default=0)
        if depth > MAX_DEPTH:
            raise self.error(f"malformed pickle: containers nested more than {MAX_DEPTH} deep")
        self.depths[id(obj)] = max(depth, self.depth(obj))
        self.keep.append(obj)
        return obj

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def pop_mark(self) -> list:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1:]
                del self.stack[i:]
                return items
        raise self.error("malformed pickle: MARK expected")

    def bytes_payload(self, n: int) -> "_Payload":
        """Where a bytes payload lies; it is not read here (tensors can be gigabytes)."""
        offset = self.pos
        if offset + n > self.size:
            raise self.error(f"truncated file: a {n}-byte payload at offset {offset} runs past its end "
                             f"({self.size} bytes)")
        self.pos += n
        return _Payload(offset, n)

    def run(self):
        try:
            return self._run()
        except CheckpointError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, OverflowError, MemoryError, RecursionError,
                struct.error) as e:  # defence in depth: each case above is checked where it arises
            raise self.error(f"malformed pickle ({type(e).__name__})") from None
        finally:
            self.file.close()

    def opcodes(self) -> dict:
        """The opcodes this interpreter runs, by code."""
        return {
            0x80: lambda: self.read(1),  # PROTO
            0x95: lambda: self.read(8),  # FRAME (frames are transparent here)
            ord("("): lambda: self.push(_MARK),
            ord("N"): lambda: self.push(None),
            0x88: lambda: self.push(True),
            0x89: lambda: self.push(False),
            ord("K"): lambda: self.push(self.unpack("<B")),
            ord("M"): lambda: self.push(self.unpack("<H")),
            ord("J"): lambda: self.push(self.unpack("<i")),
            ord("G"): lambda: self.push(self.unpack(">d")),
            0x8A: self.op_long1,
            0x8C: lambda: self.push(self.text(self.unpack("<B"))),
            ord("X"): lambda: self.push(self.text(self.unpack("<I"))),
            0x8D: lambda: self.push(self.text(self.unpack("<Q"))),
            ord("C"): lambda: self.push(self.bytes_payload(self.unpack("<B"))),
            ord("B"): lambda: self.push(self.bytes_payload(self.unpack("<I"))),
            0x8E: lambda: self.push(self.bytes_payload(self.unpack("<Q"))),
            ord(")"): lambda: self.push(self.container((), ())),
            ord("t"): self.op_tuple_mark,
            0x85: lambda: self.op_tuple(1),
            0x86: lambda: self.op_tuple(2),
            0x87: lambda: self.op_tuple(3),
            ord("}"): lambda: self.push(self.container({}, ())),
            ord("]"): lambda: self.push(self.container([], ())),
            ord("s"): self.op_setitem,
            ord("u"): self.op_setitems,
            ord("a"): self.op_append,
            ord("e"): self.op_appends,
            0x94: lambda: self.memoize(len(self.memo)),  # MEMOIZE
            ord("q"): lambda: self.memoize(self.unpack("<B")),
            ord("r"): lambda: self.memoize(self.unpack("<I")),
            ord("h"): lambda: self.push(self.get_memo(self.unpack("<B"))),
            ord("j"): lambda: self.push(self.get_memo(self.unpack("<I"))),
            0x93: self.op_stack_global,
            ord("c"): self.op_global,
            ord("R"): self.op_reduce,
            0x81: self.op_newobj,
            ord("b"): self.op_build,
        }

    def _run(self):
        ops = self.opcodes()
        while True:
            self.op_start = self.pos
            code = self.read(1)[0]
            if code == ord("."):  # STOP
                if len(self.stack) != 1:
                    raise self.error("malformed pickle: stack does not hold one object at STOP")
                return self.finish(self.stack[0])
            op = ops.get(code)
            if op is None:
                raise self.error(f"pickle opcode 0x{code:02x} is not allowed in a checkpoint tensor")
            op()

    # ---- opcodes ---------------------------------------------------------------------------
    def get_memo(self, key: int):
        if key not in self.memo:
            raise self.error(f"malformed pickle: memo key {key} unset")
        return self.memo[key]

    def memoize(self, key: int) -> None:
        obj = self.top()
        if obj is _MARK:
            raise self.error("malformed pickle: a MARK cannot be memoised")
        if key not in self.memo and len(self.memo) >= MAX_MEMO:
            raise self.error(f"a pickle memoising more than MAX_MEMO ({MAX_MEMO:,}) objects")
        self.memo[key] = obj

    def op_long1(self):
        n = self.unpack("<B")
        self.push(int.from_bytes(self.read(n), "little", signed=True))

    def op_tuple(self, n):
        items = tuple(reversed([self.pop() for _ in range(n)]))
        self.push(self.container(items, items))

    def op_tuple_mark(self):
        items = tuple(self.pop_mark())
        self.push(self.container(items, items))

    def op_setitem(self):
        value, key = self.pop(), self.pop()
        self.set_items(self.dict_target(), [key, value])

    def op_setitems(self):
        items = self.pop_mark()
        if len(items) % 2:
            raise self.error("malformed pickle: SETITEMS with a key but no value")
        self.set_items(self.dict_target(), items)

    def set_items(self, target: dict, items: list) -> None:
        for key, value in zip(items[::2], items[1::2]):
            if not isinstance(key, str):  # never hash what the file built (a deep tuple crashes CPython)
                raise self.error(f"malformed pickle: a dictionary key that is a {type(key).__name__}, not a string")
            target[key] = value
        self.container(target, items[1::2])

    def dict_target(self) -> dict:
        if not self.stack or not isinstance(self.stack[-1], dict):
            raise self.error("malformed pickle: SETITEM on a non-dict")
        return self.stack[-1]

    def op_append(self):
        value = self.pop()
        target = self.list_target()
        target.append(value)
        self.container(target, [value])

    def op_appends(self):
        items = self.pop_mark()
        target = self.list_target()
        target.extend(items)
        self.container(target, items)

    def list_target(self) -> list:
        if not self.stack or not isinstance(self.stack[-1], list):
            raise self.error("malformed pickle: APPEND on a non-list")
        return self.stack[-1]

    def push_global(self, module: str, name: str):
        g = _Global(module, name)
        if g.kind == "forbidden":
            raise self.error(f"refusing global {shown(module)}.{shown(name)}: a checkpoint tensor may only hold "
                             "numpy arrays (bfloat16 included) and QuantizedWeight8bit records")
        self.stack.append(g)

    def op_stack_global(self):
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.error("malformed pickle: STACK_GLOBAL needs two strings")
        self.push_global(module, name)

    def op_global(self):
        module = self.readline()
        name = self.readline()
        self.push_global(module, name)

    def readline(self) -> str:
        chars = bytearray()
        while (c := self.read(1)) != b"\n":
            chars += c
            if len(chars) > 256:
                raise self.error("malformed pickle: GLOBAL name too long")
        try:
            return chars.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("malformed pickle: a GLOBAL name that is not UTF-8") from None

    def op_reduce(self):
        args, func = self.pop(), self.pop()
        if not isinstance(func, _Global) or not isinstance(args, tuple):
            raise self.error("refusing a call to something that is not an allowed global")
        if func.kind == "reconstruct":
            if not (len(args) >= 1 and isinstance(args[0], _Global) and args[0].kind == "ndarray"):
                raise self.error("array reconstructor called with unexpected arguments")
            self.stack.append(_PendingArray())
        elif func.kind == "dtype":
            self.stack.append(self.make_dtype(args))
        else:
            raise self.error(f"refusing a call to {func.module}.{func.name}")

    def make_dtype(self, args) -> np.dtype:
        spec = args[0] if args else None
        if isinstance(spec, _Global) and spec.kind == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
        if isinstance(spec, str) and spec in _ALLOWED_DTYPE_NAMES:
            return np.dtype(spec)
        told = spec if isinstance(spec, str) and len(spec) <= 32 else f"a {type(spec).__name__}"
        raise self.error(f"refusing array dtype {shown(repr(told))}: only numeric dtypes and bfloat16 are allowed")

    def op_newobj(self):
        args, cls = self.pop(), self.pop()
        if not isinstance(cls, _Global) or cls.kind != "quantized" or not (isinstance(args, tuple) and args == ()):
            name = f"{cls.module}.{cls.name}" if isinstance(cls, _Global) else f"a {type(cls).__name__}"
            raise self.error(f"refusing to construct {shown(name)}")
        self.stack.append(_Quantized())

    def op_build(self):
        state, obj = self.pop(), self.top()
        if isinstance(obj, np.dtype):
            # dtype state: (version, byteorder, subarray, names, fields, elsize, alignment, flags)
            if not isinstance(state, tuple) or len(state) < 2:
                raise self.error("malformed dtype state")
            order = state[1]
            if order in ("<", ">") and obj.itemsize > 1:
                self.stack[-1] = obj.newbyteorder(order)
        elif isinstance(obj, _PendingArray):
            self.stack[-1] = self.make_array(state)
        elif isinstance(obj, _Quantized):
            if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
                state = state[1]  # (None, slots) form
            if not isinstance(state, dict):
                raise self.error("malformed QuantizedWeight8bit state")
            obj.fields.update(state)
        else:
            raise self.error(f"refusing to set the state of {type(obj).__name__}")

    def make_array(self, state) -> ArrayRecord:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise self.error("malformed ndarray state")
        _, shape, dtype, fortran, payload = state
        if not isinstance(dtype, np.dtype) or not isinstance(shape, tuple):
            raise self.error("malformed ndarray state")
        if len(shape) > MAX_DEPTH or not all(type(n) is int and n >= 0 for n in shape):
            raise self.error("malformed array shape: it must be a tuple of non-negative integers")
        if not isinstance(payload, _Payload):
            raise self.error("array data must be raw bytes")
        nbytes = math.prod(shape) * dtype.itemsize  # Python integers: a (2**32, 2**32) shape is not 0
        if payload.length != nbytes:
            raise self.error(f"array of shape {shape} and dtype {dtype} needs {nbytes} bytes, "
                             f"the file holds {payload.length}")
        return ArrayRecord(self.path, shape, dtype, payload.offset, bool(fortran))

    def finish(self, obj):
        if isinstance(obj, ArrayRecord):
            return obj
        if isinstance(obj, _Quantized):
            weight, scales = obj.fields.get("weight"), obj.fields.get("scales")
            if not isinstance(weight, ArrayRecord) or not isinstance(scales, ArrayRecord):
                raise self.error("QuantizedWeight8bit record without weight and scales arrays")
            if weight.dtype != np.int8:
                raise self.error(f"QuantizedWeight8bit weight must be int8, got {weight.dtype}")
            return QuantizedRecord(weight, scales)
        raise self.error(f"top-level object is a {type(obj).__name__}, not an array or quantized weight")
