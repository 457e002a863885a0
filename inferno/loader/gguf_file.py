"""A GGUF file read the fast way: the file memory-mapped, the header and metadata parsed in one sequential pass
with bulk numpy reads for arrays (a 152k-token vocabulary costs tens of milliseconds, not the seconds
`gguf.GGUFReader` spends building an object per field), and every tensor a zero-copy view of the map.

Format (little-endian, version 2 or 3): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry a key string (u64 length + UTF-8), a value type u32 and the value (arrays: item type u32, count u64,
items); each tensor info a name, a dimension count u32, the dimensions u64 (innermost first), a GGML type u32 and a
data offset u64; then the tensor data from the next multiple of `general.alignment` (default 32).
"""
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
SCALAR_DTYPES = {t: np.dtype(f) for t, f in SCALAR_FORMATS.items()}
# (file bytes, position, count) -> where each of `count` length-prefixed strings starts, then the end: the native
# `gguf_string_offsets` (kernels/gguf_repack.cpp), which the model loader passes in
StringOffsets = Callable[[torch.Tensor, int, int], torch.Tensor]
INVALID_UTF8 = re.compile("[\udc80-\udcfe]")  # what "surrogateescape" decodes invalid bytes (but 0xFF) to


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first (rows, columns), as numpy and torch order them
    data: np.ndarray  # the raw bytes, uint8 [*shape[:-1], bytes per row], a view of the file's memory map
    file_bytes: torch.Tensor  # the whole map as one uint8 tensor, shared by every tensor of the file

    @property
    def num_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    def rows(self) -> torch.Tensor:
        """The raw bytes as uint8 [rows, bytes per row], a torch view of `file_bytes`: tensors stored one after
        another share a storage and can be viewed as one without a copy (`SuperBlocks.cat`)."""
        start = self.data.ctypes.data - self.file_bytes.data_ptr()
        return self.file_bytes[start:start + self.data.nbytes].view(self.num_rows, -1)


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool; arrays as lists, numeric ones as numpy arrays);
    `tensors`: in file order. `string_offsets`: the native walk over a string array's lengths (the vocabulary and
    merges then decode at once); without it, one string at a time."""

    def __init__(self, path: str, string_offsets: StringOffsets | None = None):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.buffer = np.memmap(f, dtype=np.uint8, mode="c")  # copy-on-write: writable views, file untouched
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise ValueError(f"cannot read GGUF file {path}: {e}") from e
        try:
            self.fields, self.tensors = MetadataParser(self.buffer, string_offsets).parse()
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, KeyError) as e:
            raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def bulk_decode(region: np.ndarray, starts: np.ndarray) -> list[str]:
    """The strings of a string array's bytes `region` (each a u64 length, then UTF-8) starting at `starts`: each
    length becomes one 0xFF byte, which UTF-8 never holds, the whole region is decoded once (0xFF to U+DCFF under
    "surrogateescape") and split there. Invalid UTF-8 raises UnicodeDecodeError, as a one-by-one decode would."""
    lengths = (starts - 8)[:, None] + np.arange(8)
    marked = np.array(region)
    marked[lengths[:, 0]] = 0xFF
    keep = np.ones(len(region), dtype=bool)
    keep[lengths[:, 1:]] = False
    text = marked[keep].tobytes().decode("utf-8", "surrogateescape")
    pieces = text.split("\udcff")
    if len(pieces) != len(starts) + 1 or INVALID_UTF8.search(text):  # a 0xFF or another invalid byte inside
        ends = np.append(starts[1:] - 8, len(region))
        return [bytes(region[s:e]).decode("utf-8") for s, e in zip(starts, ends)]  # raises at the invalid one
    return pieces[1:]


class MetadataParser:
    def __init__(self, buffer: np.ndarray, string_offsets: StringOffsets | None = None):
        self.buffer = buffer
        self.string_offsets = string_offsets
        self.view = memoryview(buffer)
        self.file_bytes = torch.from_numpy(buffer)  # one tensor for the whole map, shared by every tensor's view
        self.pos = 0

    def parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(self.view[:4]) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (the magic number is missing)")
        self.pos = 4
        version = self.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file?)")
        num_tensors, num_fields = self.scalar("<Q"), self.scalar("<Q")
        fields = {}
        for _ in range(num_fields):
            key = self.string()
            fields[key] = self.value(GGUFValueType(self.scalar("<I")))
        infos = [self.tensor_info() for _ in range(num_tensors)]
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        data_start = -(-self.pos // alignment) * alignment
        return fields, [self.tensor(data_start, *info) for info in infos]

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.view):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = str(self.view[self.pos:end], "utf-8")
        self.pos = end
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item_kind == GGUFValueType.STRING:
                return self.strings(count)
            if item_kind in SCALAR_DTYPES:
                items = np.frombuffer(self.view, SCALAR_DTYPES[item_kind], count, self.pos)
                self.pos += items.nbytes
                return items
            return [self.value(item_kind) for _ in range(count)]
        return self.scalar(SCALAR_FORMATS[kind])

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings (a vocabulary or a merge list): where they start found by the native
        walk over their lengths where there is one, then decoded at once (`bulk_decode`); else one by one."""
        if self.string_offsets is None or count == 0:
            return self.strings_one_by_one(count)
        try:
            starts = self.string_offsets(self.file_bytes, self.pos, count).numpy()
        except RuntimeError as e:  # the native walk's bounds check
            raise ValueError(str(e).splitlines()[0]) from e
        out = bulk_decode(self.buffer[self.pos:starts[-1]], starts[:-1] - self.pos)
        self.pos = int(starts[-1])
        return out

    def strings_one_by_one(self, count: int) -> list[str]:
        view, pos, out = self.view, self.pos, []
        unpack, size = struct.Struct("<Q").unpack_from, len(view)
        for _ in range(count):
            (length,) = unpack(view, pos)
            pos += 8
            if pos + length > size:
                raise ValueError("a string array runs past the end of the file")
            out.append(str(view[pos:pos + length], "utf-8"))
            pos += length
        self.pos = pos
        return out

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string()
        num_dims = self.scalar("<I")
        dims = np.frombuffer(self.view, "<u8", num_dims, self.pos)
        self.pos += 8 * num_dims
        kind = GGMLQuantizationType(self.scalar("<I"))
        return name, tuple(int(d) for d in dims[::-1]), kind, self.scalar("<Q")

    def tensor(self, data_start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
               offset: int) -> GGUFTensor:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        if shape[-1] % block_size:
            raise ValueError(f"tensor {name!r} has rows of {shape[-1]} values, not whole {kind.name} blocks")
        row_bytes = shape[-1] // block_size * type_size
        num_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = data_start + offset
        if start + num_bytes > len(self.buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        data = self.buffer[start:start + num_bytes].reshape(*shape[:-1], row_bytes)
        return GGUFTensor(name, kind, shape, data, self.file_bytes)

