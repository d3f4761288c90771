"""A GGUF file's metadata and tensor table, read in one pass over the memory-mapped file.

``gguf.GGUFReader`` keeps a numpy view per metadata element: for SmolLM2's 49,152 tokens and
48,900 merges that is ~500,000 views, 5-10 s on a 2-core machine before any weight is read.
Here every value is decoded straight to Python (``fields``: key -> int, float, bool, str or
list), and each tensor's bytes are a view of the mapped file, shaped as ``GGUFReader`` shapes
them (``tensors``; the quantized bytes are paged in as they are read). Format: the GGUF
specification of ggml (versions 2 and 3, little-endian): header, key/value metadata, tensor
infos (name, dimensions innermost first, type, offset), then the data at the file's
alignment.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = 0x46554747  # b"GGUF", little-endian
_SUPPORTED_VERSIONS = (2, 3)
# GGUF value types -> struct format of a scalar; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFTensor(NamedTuple):
    """One tensor of the file. ``shape``: its dimensions as the file lists them, innermost
    first; ``data``: a read-only view of its bytes, outermost dimension first, typed for the
    plain types (F32, F16, I8 ... I64) and uint8 with the innermost dimension in bytes for
    the others, as ``GGUFReader`` gives it."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The parsed header of a GGUF file: ``version``, ``fields`` (metadata key -> value),
    ``tensors`` (in the file's order), ``alignment`` and ``data_offset``.

    Raises ValueError naming the file for anything that is not a GGUF file this reads: a bad
    magic number, another version or byte order, a value type the specification lacks, a
    string that is not UTF-8, a table or tensor running past the end of the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._map = np.memmap(self.path, mode="r")
        self._view = memoryview(self._map)
        self._size = len(self._view)
        self._pos = 0
        magic, version = self._unpack("<I"), self._unpack("<I")
        if magic != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {magic:#010x})")
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path} is a big-endian GGUF file; only little-endian "
                             "files are supported")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported; "
                             f"supported: {', '.join(map(str, _SUPPORTED_VERSIONS))}")
        self.version = version
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.alignment = int(self.fields.get("general.alignment", 32))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{self.path}: general.alignment={self.alignment} is not a "
                             "power of two")
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]

    def _need(self, count: int) -> None:
        if self._pos + count > self._size:
            raise ValueError(f"{self.path} is truncated: {count} bytes needed at offset "
                             f"{self._pos}, the file has {self._size}")

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        self._need(length)
        start, self._pos = self._pos, self._pos + length
        try:
            return str(self._view[start:self._pos], "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: the string at offset {start} is not UTF-8 "
                             f"({exc.reason})") from None

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])
        if value_type != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type} at offset "
                             f"{self._pos}")
        item_type, count = self._unpack("<I"), self._unpack("<Q")
        if item_type in _NUMPY:  # a numeric array in one read
            dtype = np.dtype(_NUMPY[item_type])
            self._need(count * dtype.itemsize)
            values = np.frombuffer(self._view, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        return [self._value(item_type) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type {raw_type}"
                             ) from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims, dtype=np.int64))
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        if start + n_bytes > self._size:
            raise ValueError(f"{self.path}: tensor {name!r} ({n_bytes} bytes at offset {start}) "
                             f"runs past the end of the file ({self._size} bytes)")
        shape = list(reversed(dims))  # outermost first
        plain = _PLAIN_TYPES.get(tensor_type.name)
        if plain is None:  # bytes of whole blocks per innermost row
            dtype, shape[-1] = np.dtype(np.uint8), shape[-1] // block_size * type_size
        else:
            dtype = np.dtype(plain)
        data = self._map[start:start + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name, tensor_type, np.array(dims, dtype=np.uint64), n_elements,
                          n_bytes, start, data)


_PLAIN_TYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2",
                "I32": "<i4", "I64": "<i8"}
