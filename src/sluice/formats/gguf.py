"""GGUF files through the `gguf` package: lazy and memory-mapped; tensors become QuantizedTensor or dense."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from sluice.errors import ModelFileError
from sluice.formats.validate import untrusted

GGUF_MAGIC = b"GGUF"
_MISSING = object()
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class _Corrupt(Exception):
    """Raised inside the header scan; GGUFFile turns it into a ModelFileError naming the file."""


class _Cursor:
    """Bounded little-endian reads over the file's bytes: every count and length is checked against the bytes left
    before anything is read or iterated, so scanning a header is linear in the file size."""

    def __init__(self, buf):
        self.buf, self.pos = memoryview(buf), 0

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > len(self.buf) - self.pos:
            raise _Corrupt(f"{what} ({n} bytes at offset {self.pos}) runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        return bytes(self.buf[start:start + n])

    def value(self, vtype: int, what: str, depth: int = 0):
        """Skip (or, for scalars, return) one value of GGUF type `vtype`."""
        if vtype in _SCALARS:
            start = self.take(_SCALARS[vtype], what)
            return bytes(self.buf[start:start + _SCALARS[vtype]])
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < 2:
            itype, count = self.u32(f"the item type of {what}"), self.u64(f"the count of {what}")
            least = _SCALARS.get(itype, 8 if itype == _STRING else 12)  # a string or a nested array: >= 8 / 12 bytes
            if itype not in _SCALARS and itype not in (_STRING, _ARRAY):
                raise _Corrupt(f"{what} has items of unknown value type {itype}")
            if count * least > len(self.buf) - self.pos:
                raise _Corrupt(f"{what} claims {count} items, more than the {len(self.buf) - self.pos} bytes left "
                               "can hold")
            if itype in _SCALARS:
                self.take(count * least, what)
            elif itype == _STRING:  # the vocabulary: ~10^5 strings, so a tight loop
                buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.unpack_from
                try:
                    for _ in range(count):
                        pos += 8 + unpack("<Q", buf, pos)[0]
                        if pos > end:
                            raise struct.error
                except struct.error:  # a length field or a string past the end of the file
                    raise _Corrupt(f"a string of {what} runs past the end of the file") from None
                self.pos = pos
            else:
                for _ in range(count):
                    self.value(itype, what, depth + 1)
            return None
        raise _Corrupt(f"{what} has unknown (or too deeply nested) value type {vtype}")


def scan_header(buf) -> None:
    """Walk a GGUF file's header with bounded reads (so the `gguf` package never loops on a count that runs past
    the end of the file) and check its tensor table: known types, at most 4 dims, byte sizes and offsets that fit
    the file without wrapping, offsets aligned and not overlapping. Raises _Corrupt."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    c = _Cursor(buf)
    c.take(4, "the magic")
    version = c.u32("the version")
    if version not in (2, 3):
        raise _Corrupt(f"GGUF version {version} (sluice reads versions 2 and 3, little-endian)")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
    if n_tensors * 24 + n_kv * 12 > len(buf):
        raise _Corrupt(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in {len(buf)} bytes")
    alignment = 32
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}").decode("utf-8", "replace")
        vtype = c.u32(f"the type of '{key}'")
        raw = c.value(vtype, f"metadata '{key}'")
        if key == "general.alignment":
            if vtype != 4:
                raise _Corrupt("general.alignment must be a uint32")
            alignment = struct.unpack("<I", raw)[0]
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise _Corrupt(f"general.alignment = {alignment} is not a power of two up to 2^20")
    infos = []
    for i in range(n_tensors):
        name = c.string(f"the name of tensor #{i}").decode("utf-8", "replace")
        n_dims = c.u32(f"the dims of tensor '{name}'")
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor '{name}' has {n_dims} dims (at most {MAX_DIMS})")
        dims = [c.u64(f"the shape of tensor '{name}'") for _ in range(n_dims)]
        ttype = c.u32(f"the type of tensor '{name}'")
        offset = c.u64(f"the offset of tensor '{name}'")
        if ttype not in GGML_QUANT_SIZES:
            raise _Corrupt(f"tensor '{name}' has unknown ggml type {ttype}")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        numel = 1
        for d in dims:
            numel *= d
        if 0 in dims:
            raise _Corrupt(f"tensor '{name}' has a zero dim (shape {dims})")
        if dims and dims[0] % block:
            raise _Corrupt(f"tensor '{name}': its first dim {dims[0]} is not a multiple of the {block}-value block "
                           f"of its type")
        infos.append((offset, numel // block * size, name))
    data_start = -(-c.pos // alignment) * alignment
    end_of_previous, previous = 0, None
    for offset, nbytes, name in sorted(infos):
        if offset % alignment:
            raise _Corrupt(f"tensor '{name}' starts at offset {offset}, not a multiple of the alignment {alignment}")
        if offset < end_of_previous:
            raise _Corrupt(f"tensors '{previous}' and '{name}' overlap")
        if data_start + offset + nbytes > len(buf):
            raise _Corrupt(f"tensor '{name}' ends past the end of the file (truncated?)")
        end_of_previous, previous = offset + nbytes, name


def _reader_class():
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader over a plain ndarray view of the same memory map: numpy's memmap subclass costs
        bookkeeping per view, and parsing a 49k-token vocabulary makes about a million views."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mm):
            self._mmap, self._plain = mm, np.asarray(mm)

    return Reader


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GGUFFile:
    format = "gguf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such file. Pass the path of a .gguf file or a model directory.")
        if not is_gguf(self.path):
            again = " or download the file again" if self.path.suffix.lower() == ".gguf" else ""
            raise ModelFileError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic bytes). "
                                 f"Pass a .gguf file or a model directory (check the path{again}).")
        try:
            scan_header(np.memmap(self.path, dtype=np.uint8, mode="r"))
        except _Corrupt as e:
            raise ModelFileError(f"{self.path}: the GGUF file is truncated or corrupt: {e}. Download it again.") from e
        try:
            self.reader = _reader_class()(self.path, "r")
        except Exception as e:  # the gguf package raises assorted errors on damaged headers
            raise ModelFileError(f"{self.path}: the GGUF file is truncated or corrupt ({type(e).__name__}: {e}). "
                                 "Download it again.") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelFileError(f"{self.path}: the GGUF file is truncated (tensor '{t.name}' ends past the end "
                                     "of the file). Download it again.")

    @property
    def total_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.tensors.values())

    def tensor_nbytes(self) -> dict[str, int]:
        """Every tensor's name and size in bytes (as `HFDirectory` says it)."""
        return {name: int(t.n_bytes) for name, t in self.tensors.items()}

    @property
    def fields(self):
        return self.reader.fields

    def meta(self, key: str, default=_MISSING):
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelFileError(f"{self.path}: GGUF metadata key '{key}' is missing; the file is incomplete "
                                     "or was written for another architecture.")
            return default
        with untrusted(f"{self.path}: GGUF metadata '{key}'"):  # e.g. a string that is not UTF-8
            value = field.contents()
        if isinstance(value, (np.generic,)):
            value = value.item()
        return value

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str):
        """A QuantizedTensor (Q4_0/Q4_1/Q8_0) or a dense torch tensor, in torch dim order ([out, in])."""
        from sluice.quant.gguf_blocks import from_gguf

        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing from the GGUF file.")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out = from_gguf(t.data, t.tensor_type, shape, name=name)
        return out if not isinstance(out, torch.Tensor) else out.reshape(shape)
