"""Read PyTorch's ``.bin`` state dicts (``torch.save``'s zip format) without unpickling them.

A ``pytorch_model-*.bin`` is a zip archive, stored uncompressed: ``<name>/data.pkl``, a pickle of
the state dict, and ``<name>/data/<key>``, each tensor storage's raw bytes (PyTorch's
torch/serialization.py, ``_save``). In the pickle each tensor is a call of
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`` whose
storage is a persistent id ``("storage", torch.<Type>Storage, key, location, numel)``; the dict is
a ``collections.OrderedDict``. Unpickling it would import and call whatever the file names. Here
the opcode stream is interpreted (``checkpoints.safe_pickle``'s interpreter) with exactly those
globals allowed and none called: each tensor becomes where its bytes lie in the archive, read
later as a memory map, slice by slice. Anything else (another global, a compressed member, a
strided tensor, a storage too short) is a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import zipfile

import ml_dtypes
import numpy as np

from checkpoints.lazy import LazyTensor
from checkpoints.safe_pickle import _Global, _Interpreter
from untrusted import CheckpointError, regular_file, shown

_STORAGES = {
    "FloatStorage": np.float32, "BFloat16Storage": ml_dtypes.bfloat16, "HalfStorage": np.float16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]


class _TorchGlobal(_Global):
    @property
    def kind(self) -> str:
        if (self.module, self.name) == ("collections", "OrderedDict"):
            return "ordered_dict"
        if (self.module, self.name) == ("torch._utils", "_rebuild_tensor_v2"):
            return "tensor"
        if (self.module, self.name) == ("torch._utils", "_rebuild_parameter"):
            return "parameter"
        if self.module == "torch" and self.name in _STORAGES:
            return "storage"
        return "forbidden"


class _TorchInterpreter(_Interpreter):
    """The pickle of a state dict, at ``[start, start + length)`` of the archive."""

    def __init__(self, path: str, start: int, length: int):
        super().__init__(path, start + length)
        self.pos = start

    def opcodes(self) -> dict:
        return {**super().opcodes(), ord("Q"): self.op_binpersid}

    def push_global(self, module: str, name: str):
        g = _TorchGlobal(module, name)
        if g.kind == "forbidden":
            raise self.error(f"refusing global {shown(module)}.{shown(name)}: a PyTorch state dict may only hold tensors "
                             "(torch._utils._rebuild_tensor_v2 over torch.*Storage) in OrderedDicts")
        self.stack.append(g)

    def op_binpersid(self):
        pid = self.pop()
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _TorchGlobal)
                and pid[1].kind == "storage" and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise self.error("malformed persistent id: expected ('storage', torch.<Type>Storage, key, location, numel)")
        self.push(_Storage(pid[2], np.dtype(_STORAGES[pid[1].name]), pid[4]))

    def op_reduce(self):
        args, func = self.pop(), self.pop()
        if not isinstance(func, _TorchGlobal) or not isinstance(args, tuple):
            raise self.error("refusing a call to something that is not an allowed global")
        if func.kind == "ordered_dict" and args == ():
            self.push(self.container({}, ()))
        elif func.kind == "tensor" and len(args) in (6, 7) and isinstance(args[0], _Storage):
            storage, offset, shape, stride = args[:4]
            if not (type(offset) is int and offset >= 0 and isinstance(shape, tuple) and isinstance(stride, tuple)
                    and all(type(n) is int and n >= 0 for n in shape + stride) and len(shape) == len(stride)):
                raise self.error("malformed tensor: offset, size and stride must be non-negative integers")
            contiguous = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            if any(n > 1 and s != c for n, s, c in zip(shape, stride, contiguous)):
                raise self.error(f"a tensor of shape {shape} with strides {stride}: only contiguous tensors are read")
            if offset + math.prod(shape) > storage.numel:
                raise self.error(f"a tensor of shape {shape} at offset {offset} runs past its storage of "
                                 f"{storage.numel} elements")
            self.push(_Tensor(storage, offset, shape))
        elif func.kind == "parameter" and len(args) >= 1 and isinstance(args[0], _Tensor):
            self.push(args[0])
        else:
            raise self.error(f"refusing a call to {shown(func.module)}.{shown(func.name)} with these arguments")

    def op_build(self):
        state, obj = self.pop(), self.top()
        if isinstance(obj, dict) and isinstance(state, dict):
            return  # a state dict's _metadata (versions of its modules): not needed
        raise self.error(f"refusing to set the state of {type(obj).__name__}")

    def finish(self, obj):
        if not isinstance(obj, dict) or not all(isinstance(v, _Tensor) for v in obj.values()):
            raise self.error("the pickle is not a dict of tensors (a state dict)")
        return obj


def _data_start(path: str, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes begin: after its local header, whose lengths may differ from
    the central directory's."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{path}: corrupted zip archive (no local header for {shown(info.filename)})")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _member_data(path: str, info: zipfile.ZipInfo, size: int) -> int:
    """Where a stored member's bytes begin, checked to end within the file's ``size`` bytes (a
    header may lie about a member's size or place)."""
    start = _data_start(path, info)
    if start + info.file_size > size:
        raise CheckpointError(f"{path}: member {shown(info.filename)} claims {info.file_size:,} bytes at offset "
                              f"{start:,}, past the end of the file ({size:,} bytes)")
    return start


def open_torch_zip(path: str) -> dict[str, LazyTensor]:
    """``{tensor name: LazyTensor}`` of a ``torch.save``d state dict; nothing is unpickled."""
    regular_file(path, "PyTorch checkpoint file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a zip archive: PyTorch's legacy (pre-1.6) .bin format is not read; "
                              "re-save it as safetensors")
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
        size = os.path.getsize(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}: corrupted zip archive ({shown(e)})") from None
    members = {info.filename: info for info in infos}
    if len(members) != len(infos):  # another reader (torch) may take the other copy: neither is trusted
        twice = next(name for name in members if sum(info.filename == name for info in infos) > 1)
        raise CheckpointError(f"{path}: member {shown(twice)} is in the archive more than once")
    pickles = [name for name in members if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"{path}: expected one <name>/data.pkl in the archive, found {len(pickles)}")
    root = pickles[0][: -len("data.pkl")]
    for info in members.values():
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: member {shown(info.filename)} is compressed; torch.save stores them as they are")
    byteorder = members.get(root + "byteorder")
    if byteorder is not None:
        if byteorder.file_size > 16:
            raise CheckpointError(f"{path}: member {shown(byteorder.filename)} of {byteorder.file_size:,} bytes: a "
                                  "byte order is a word")
        with zipfile.ZipFile(path) as archive:
            order = archive.read(byteorder).strip()
        if order != b"little":
            raise CheckpointError(f"{path}: byte order {order[:16]!r}: only little-endian archives are read")
    info = members[pickles[0]]
    tensors = _TorchInterpreter(path, _member_data(path, info, size), info.file_size).run()
    out = {}
    for name, tensor in tensors.items():
        member = members.get(f"{root}data/{tensor.storage.key}")
        if member is None:
            raise CheckpointError(f"{path}: tensor {shown(name)}: storage {shown(tensor.storage.key, 40)} is not in "
                                  "the archive")
        dtype, itemsize = tensor.storage.dtype, tensor.storage.dtype.itemsize
        if member.file_size != tensor.storage.numel * itemsize:
            raise CheckpointError(f"{path}: tensor {shown(name)}: storage {shown(tensor.storage.key, 40)} holds "
                                  f"{member.file_size} bytes, {tensor.storage.numel} elements of {dtype} need "
                                  f"{tensor.storage.numel * itemsize}")
        offset = _member_data(path, member, size) + tensor.offset * itemsize
        out[name] = _lazy(path, name, tensor.shape, dtype, offset)
    return out


def _lazy(path: str, name: str, shape: tuple, dtype: np.dtype, offset: int) -> LazyTensor:
    def mmap():
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype, "r", offset, shape)

    return LazyTensor(f"{path}:{name}", shape, dtype, lambda index: np.array(mmap()[index]), mmap)
