"""Read a GGUF file's header: metadata as plain Python values and the tensor
index with each tensor's bytes as a numpy view of the memory-mapped file.

gguf-py's `GGUFReader` gives the same information but builds several numpy
objects per array element, so a 262k-token vocabulary (tokens, scores, token
types) costs it some 20 s of CPU before the first weight is touched. Here
numeric arrays are one `np.frombuffer` each and string arrays one tight loop,
which reads the Gemma 3 270M header in a fraction of a second. gguf-py stays
the source of the type constants and of dequantization.

The layout (GGUF versions 2 and 3, as gguf-py's reader and writer define it):
magic "GGUF", u32 version, u64 tensor count, u64 key/value count; then each
key/value as (string key, u32 value type, value); then each tensor as (string
name, u32 dimension count, u64 per dimension fastest first, u32 ggml type, u64
offset into the data section); then padding to `general.alignment` (32 unless
the file says) and the data section. A string is a u64 byte count and UTF-8
bytes; an array is a u32 element type, a u64 count and the elements (arrays of
arrays nest). Files written big-endian (detected, as llama.cpp does, by a
version whose low 16 bits are zero) are read with every number swapped; their
quantized blocks are left as stored.

Values come back as `GGUFReader`'s `ReaderField.contents()` gives them, with
one exception: an array of arrays is a list of lists here, where `GGUFReader`
flattens it into one list.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)

# value type -> (numpy type without byte order, struct code of the same size)
_NUMBERS = {
    GGUFValueType.UINT8: ("u1", "B"), GGUFValueType.INT8: ("i1", "b"), GGUFValueType.UINT16: ("u2", "H"),
    GGUFValueType.INT16: ("i2", "h"), GGUFValueType.UINT32: ("u4", "I"), GGUFValueType.INT32: ("i4", "i"),
    GGUFValueType.UINT64: ("u8", "Q"), GGUFValueType.INT64: ("i8", "q"), GGUFValueType.FLOAT32: ("f4", "f"),
    GGUFValueType.FLOAT64: ("f8", "d"), GGUFValueType.BOOL: ("?", "?"),
}
# Tensor types whose bytes are plain numbers (viewed as such); every other type is blocks of bytes.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}
_TENSOR_TYPES = {int(t): t for t in GGMLQuantizationType}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (foreign, truncated or corrupt)."""


class GGUFTensor(NamedTuple):
    """One entry of the tensor index; the fields `gguf.ReaderTensor` has and the loader uses."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dimensions, fastest first (ggml's ne)
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # view of the memory map: numbers for plain types, [.., row bytes] uint8 for blocks


class GGUFFile:
    """A parsed GGUF header over a read-only memory map of the file.

    `fields`: key -> value (str, int, float, bool, or a list of those, nested
    for arrays of arrays), in file order; `field_types`: key -> the value's
    GGUF type (ARRAY for arrays). `tensors`: the index in file order."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFFormatError(f"{size} bytes is too short for a GGUF header")
        self._map = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._map)
        self._size = size
        magic, = struct.unpack_from("<I", self._buf, 0)
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"no GGUF magic (the file starts with {bytes(self._buf[:4])!r})")
        version, = struct.unpack_from("<I", self._buf, 4)
        self.byte_order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian machine: the version reads byte-swapped
            self.byte_order = ">"
            version, = struct.unpack_from(">I", self._buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported "
                                  f"(versions {', '.join(map(str, SUPPORTED_VERSIONS))} are)")
        self.version = version
        bo = self.byte_order
        self._u32 = struct.Struct(bo + "I").unpack_from
        self._u64 = struct.Struct(bo + "Q").unpack_from
        self._scalars = {t: struct.Struct(bo + code) for t, (_, code) in _NUMBERS.items()}
        n_tensors, n_kv = struct.unpack_from(bo + "QQ", self._buf, 8)
        offset = 24
        self.fields: dict[str, Any] = {}
        self.field_types: dict[str, GGUFValueType] = {}
        for _ in range(n_kv):
            start = offset
            key, offset = self._string(offset, "a metadata key")
            if key in self.fields:
                raise GGUFFormatError(f"metadata key {key!r} appears twice (offset {start})")
            vtype, offset = self._value_type(offset, key)
            self.fields[key], offset = self._value(offset, vtype, key)
            self.field_types[key] = vtype
        index, offset = self._tensor_index(offset, n_tensors)
        self.alignment = self._alignment()
        self.data_offset = offset + (-offset % self.alignment)
        self.tensors = [self._tensor(*entry) for entry in index]

    # -- primitives; each checks it stays inside the file ------------------------------------------
    def _need(self, offset: int, nbytes: int, what: str) -> None:
        if nbytes < 0 or offset + nbytes > self._size:
            raise GGUFFormatError(f"truncated: {what} at byte {offset} needs {nbytes} bytes, "
                                  f"the file has {self._size}")

    def _string(self, offset: int, what: str) -> tuple[str, int]:
        self._need(offset, 8, what)
        n, = self._u64(self._buf, offset)
        offset += 8
        self._need(offset, n, what)
        try:
            return str(self._buf[offset:offset + n], "utf-8"), offset + n
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} at byte {offset} is not valid UTF-8") from None

    def _value_type(self, offset: int, key: str) -> tuple[GGUFValueType, int]:
        self._need(offset, 4, f"the type of {key!r}")
        raw, = self._u32(self._buf, offset)
        vtype = _VALUE_TYPES.get(raw)
        if vtype is None:
            raise GGUFFormatError(f"metadata key {key!r} has unknown value type {raw}")
        return vtype, offset + 4

    def _value(self, offset: int, vtype: GGUFValueType, key: str) -> tuple[Any, int]:
        if vtype == GGUFValueType.STRING:
            return self._string(offset, f"the value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            return self._array(offset, key)
        scalar = self._scalars[vtype]
        self._need(offset, scalar.size, f"the value of {key!r}")
        return scalar.unpack_from(self._buf, offset)[0], offset + scalar.size

    def _array(self, offset: int, key: str) -> tuple[list[Any], int]:
        etype, offset = self._value_type(offset, key)
        self._need(offset, 8, f"the length of array {key!r}")
        n, = self._u64(self._buf, offset)
        offset += 8
        if etype in _NUMBERS:
            dtype = np.dtype(self.byte_order + _NUMBERS[etype][0])
            self._need(offset, n * dtype.itemsize, f"the {n} elements of {key!r}")
            values = np.frombuffer(self._buf, dtype=dtype, count=n, offset=offset)
            return values.tolist(), offset + n * dtype.itemsize
        # strings and arrays: each at least 8 (12) bytes, so a corrupt count fails here, not after a long loop
        self._need(offset, n * (8 if etype == GGUFValueType.STRING else 12), f"the {n} elements of {key!r}")
        if etype == GGUFValueType.STRING:
            return self._strings(offset, n, key)
        out = []
        for _ in range(n):
            item, offset = self._array(offset, key)
            out.append(item)
        return out, offset

    def _strings(self, offset: int, n: int, key: str) -> tuple[list[str], int]:
        # The hot loop of a large vocabulary: locals only, one decode per string, bounds checked once per item.
        buf, u64, size = self._buf, self._u64, self._size
        out: list[str] = [""] * n
        try:
            for i in range(n):
                length, = u64(buf, offset)
                offset += 8
                end = offset + length
                if end > size:
                    break
                out[i] = str(buf[offset:end], "utf-8")
                offset = end
            else:
                return out, offset
        except struct.error:
            pass
        except UnicodeDecodeError:
            raise GGUFFormatError(f"element {i} of {key!r} (byte {offset}) is not valid UTF-8") from None
        raise GGUFFormatError(f"truncated: element {i} of {key!r} runs past the end of the file "
                              f"({size} bytes)")

    # -- tensors ------------------------------------------------------------------------------------
    def _tensor_index(self, offset: int, count: int) -> tuple[list[tuple[str, np.ndarray, int, int]], int]:
        index = []
        names: set[str] = set()
        for i in range(count):
            name, offset = self._string(offset, f"the name of tensor {i}")
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            self._need(offset, 4, f"tensor {name!r}")
            n_dims, = self._u32(self._buf, offset)
            offset += 4
            self._need(offset, 8 * n_dims + 12, f"tensor {name!r}")
            dims = np.frombuffer(self._buf, dtype=self.byte_order + "u8", count=n_dims, offset=offset)
            offset += 8 * n_dims
            raw_type, = self._u32(self._buf, offset)
            rel, = self._u64(self._buf, offset + 4)
            offset += 12
            index.append((name, dims.astype(np.uint64), raw_type, rel))
        return index, offset

    def _alignment(self) -> int:
        if "general.alignment" not in self.fields:
            return GGUF_DEFAULT_ALIGNMENT
        if self.field_types["general.alignment"] != GGUFValueType.UINT32:
            raise GGUFFormatError(f"general.alignment must be a UINT32, not "
                                  f"{self.field_types['general.alignment'].name}")
        align = int(self.fields["general.alignment"])
        if align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment {align} is not a power of two")
        return align

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, rel: int) -> GGUFTensor:
        qtype = _TENSOR_TYPES.get(raw_type)
        if qtype is None:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {raw_type}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(dims.tolist())
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        if qtype in _PLAIN_TENSORS:
            dtype = np.dtype(self.byte_order + _PLAIN_TENSORS[qtype])
            count = n_elements
        else:
            dtype = np.dtype(np.uint8)
            try:
                shape = quant_shape_to_byte_shape(shape, qtype)
            except (ValueError, IndexError) as e:
                raise GGUFFormatError(f"tensor {name!r}: {e}") from None
            count = n_elements * type_size // block
        n_bytes = n_elements * type_size // block
        start = self.data_offset + rel
        if start + count * dtype.itemsize > self._size:
            raise GGUFFormatError(f"truncated: tensor {name!r} ends at byte {start + count * dtype.itemsize}, "
                                  f"the file has {self._size}")
        data = self._map[start:start + count * dtype.itemsize].view(dtype).reshape(shape)
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data)
