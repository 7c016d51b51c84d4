"""HF-style model directories: config.json + *.safetensors (dense, or MLX-quantized weight/scales/biases).

Headers are parsed and checked up front; tensor data is read only when asked for, one tensor at a time:

* on the CPU a tensor is a zero-copy view of the file, memory-mapped copy-on-write (`torch.frombuffer` over an
  `mmap.ACCESS_COPY` mapping): its pages are the page cache's, never copied into the process's anonymous memory,
  and a write to it (nothing in sluice writes to weights) would change the process's copy only, never the file;
* on a GPU the tensor's byte range is read with `pread` in chunks of `CHUNK` bytes into two reused pinned host
  buffers (one is filled while the other is copied to the GPU), so host memory stays at those two buffers however
  large the tensor or the checkpoint; nothing is memory-mapped, so no file pages are counted in the process's RSS.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.errors import ModelFileError, UnsupportedError

CHUNK = 64 << 20  # bytes of each of the two pinned staging buffers of reads to a GPU

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse and sanity-check a safetensors header so a damaged file fails here with a clear message.
    Returns the header and the file offset where the tensor data begins."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFileError(f"{path}: truncated safetensors file (no header). Download it again.")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise ModelFileError(f"{path}: corrupt safetensors header length. Download it again.")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelFileError(f"{path}: corrupt safetensors header ({e}). Download it again.") from e
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt safetensors header (a JSON object was expected). Download it again.")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not isinstance(info, dict):
                raise ModelFileError(f"{path}: corrupt safetensors header (__metadata__ is not an object).")
            continue
        problem = _entry_problem(info, data_len)
        if problem:
            raise ModelFileError(f"{path}: corrupt safetensors header: tensor '{name}' {problem}. "
                                 "Download the file again.")
    _check_coverage(path, header, data_len)
    return header, 8 + n


def _check_coverage(path: Path, header: dict, data_len: int) -> None:
    """The tensors must tile the data section exactly, in offset order, as `safetensors.safe_open` requires: a gap,
    an overlap or bytes past the last tensor mean offsets that point at the wrong bytes."""
    end = 0
    for begin, stop, name in sorted((*info["data_offsets"], name) for name, info in header.items()
                                    if name != "__metadata__"):
        if begin != end:
            where = "overlaps the tensor before it" if begin < end else f"leaves bytes {end}-{begin} uncovered"
            raise ModelFileError(f"{path}: corrupt safetensors header: tensor '{name}' starts at data byte {begin} "
                                 f"and {where} (invalid offset). Download the file again.")
        end = stop
    if end != data_len:
        raise ModelFileError(f"{path}: corrupt safetensors file: the tensors cover {end} of its {data_len} data bytes "
                             "(not fully covered). Download the file again.")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_problem(info, data_len: int) -> str | None:
    """What is wrong with one tensor's header entry ({"dtype", "shape", "data_offsets"}), or None."""
    if not isinstance(info, dict):
        return "has an entry that is not a JSON object"
    if not isinstance(info.get("dtype"), str):
        return "has no dtype string"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
        return f"has shape {shape!r}; a list of at most 8 non-negative integers is needed"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}; [begin, end] with 0 <= begin <= end is needed"
    if offsets[1] > data_len:
        return "ends past the end of the file (truncated?)"
    return None


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies: its file, dtype, shape, and byte range [start, start + nbytes) in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _entry(path: Path, name: str, info: dict, data_start: int) -> _Entry:
    dtype = _DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise UnsupportedError(f"{path}: tensor '{name}' has dtype {info.get('dtype')!r}, which sluice cannot "
                               f"read; supported: {', '.join(_DTYPES)}.")
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (int(o) for o in info["data_offsets"])
    numel = math.prod(shape)
    if end - begin != numel * dtype.itemsize:
        raise ModelFileError(f"{path}: tensor '{name}' spans {end - begin} bytes, but its shape {list(shape)} and "
                             f"dtype {info['dtype']} need {numel * dtype.itemsize}. The file is corrupt; download "
                             "it again.")
    return _Entry(path, dtype, shape, data_start + begin, end - begin)


def mlx_quantization(config: dict, module: str) -> tuple[int | None, int | None] | None:
    """(bits, group_size) for `module` from config.json's MLX `quantization` block (its per-module entry, else the
    block's defaults; (None, None) without a block); None when the module's entry is `false` (not quantized)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    spec = q.get(module, q) if isinstance(q, dict) else q
    if spec is False:
        return None
    if not isinstance(spec, dict):
        raise ModelFileError(f"config.json: quantization entry for '{module}' is {spec!r}; an object with bits and "
                             "group_size (or false) is needed.")
    bits, gs = spec.get("bits"), spec.get("group_size")
    if (bits is not None and bits not in (2, 3, 4, 5, 6, 8)) or \
            (gs is not None and not (_is_int(gs) and 1 <= gs <= 1 << 16)):
        raise ModelFileError(f"config.json: quantization of '{module}' has bits={bits!r}, group_size={gs!r}; "
                             "bits must be 2, 3, 4, 5, 6 or 8 and group_size a positive integer.")
    return bits, gs


class _Staging:
    """Two host buffers of CHUNK bytes (pinned for a GPU): file bytes are read into one while the other is copied
    to the device; an event per buffer says when its copy is done and it may be refilled."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.events = [None, None]
        self.next = 0

    def copy(self, fd: int, start: int, out: torch.Tensor, path: Path) -> None:
        """Fill the flat uint8 tensor `out` (on the device) with the file's bytes [start, start + out.numel())."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        done, n = 0, out.numel()
        while done < n:
            k = min(len(self.views[0]), n - done)
            i, self.next = self.next, self.next ^ 1
            if self.events[i] is not None:
                self.events[i].synchronize()
            _pread_exact(fd, self.views[i][:k], start + done, path)
            out[done:done + k].copy_(self.buffers[i][:k], non_blocking=self.cuda)
            if self.cuda:
                self.events[i] = torch.cuda.Event()
                self.events[i].record(stream)
            done += k


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Read len(view) bytes at `offset` into `view` (a short read is retried; end of file is an error)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ModelFileError(f"{path}: the file ended early (was it truncated after sluice opened it?). "
                                 "Download it again.")
        got += n


class HFDirectory:
    """A checkpoint directory. `tensor(name, device)` reads one tensor onto `device` (see the module docstring);
    `names()`, `has(name)`, `config`, `quantization(module)`, `is_mlx`, `total_bytes` describe the checkpoint."""

    reads_to_device = True  # tensor() takes the target device: the loader need not move what it returns

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ModelFileError(f"{self.path}: no config.json. A model directory needs config.json, "
                                 "*.safetensors and tokenizer.json (as on the HF hub); or pass a .gguf file.")
        try:
            self.config = json.loads(cfg.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ModelFileError(f"{cfg}: not valid UTF-8 JSON ({e}).") from e
        if not isinstance(self.config, dict):
            raise ModelFileError(f"{cfg}: a JSON object (the model's settings) is needed, found "
                                 f"{type(self.config).__name__}.")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{self.path}: no *.safetensors files. sluice reads safetensors only "
                                 "(never pickled .bin checkpoints); convert the weights to safetensors.")
        self._entries: dict[str, _Entry] = {}
        formats = set()
        for f in files:
            header, data_start = _read_header(f)
            fmt = (header.get("__metadata__") or {}).get("format")
            formats.add(fmt if isinstance(fmt, str) else None)
            for name, info in header.items():
                if name != "__metadata__":
                    self._entries[name] = _entry(f, name, info, data_start)
        # mlx-lm writes {"format": "mlx"}; its checkpoints hold post-sanitize parameters (e.g. norms with +1 baked)
        self.is_mlx = "mlx" in formats or "quantization" in self.config
        self.format = "mlx" if self.is_mlx else "hf"
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}
        self._staging: _Staging | None = None

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self):
        return self._entries.keys()

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def tensor_nbytes(self) -> dict[str, int]:
        """Every stored tensor's name and size in bytes."""
        return {name: e.nbytes for name, e in self._entries.items()}

    def location(self, name: str) -> tuple[Path, int, int, tuple[int, ...], torch.dtype]:
        """(file, first byte, bytes, shape, dtype) of a stored tensor, for readers of their own (streamed experts)."""
        e = self._entries.get(name)
        if e is None:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing from the checkpoint.")
        return e.file, e.start, e.nbytes, tuple(e.shape), e.dtype

    def close(self) -> None:
        """Close the files read through `pread` and free the pinned staging buffers. Tensors already returned stay
        valid (a memory-mapped one keeps its mapping alive)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()
        self._staging = None

    def _raw(self, name: str, device: torch.device) -> torch.Tensor:
        e = self._entries.get(name)
        if e is None:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing from the checkpoint.")
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype, device=device)
        return self._mapped(e) if device.type == "cpu" else self._read(e, device)

    def _read(self, e: _Entry, device: torch.device) -> torch.Tensor:
        """The tensor read into memory allocated on `device`, through the staging buffers."""
        out = torch.empty(e.nbytes, dtype=torch.uint8, device=device)
        if self._staging is None or self._staging.device != device:
            self._staging = _Staging(device)
        self._staging.copy(self._fd(e.file), e.start, out, e.file)
        return out.view(e.dtype).view(e.shape)

    def _mapped(self, e: _Entry) -> torch.Tensor:
        """A zero-copy view of the tensor in its file's copy-on-write mapping (a copy when the data is not
        aligned to its element size, which safetensors writers avoid)."""
        m = self._maps.get(e.file)
        if m is None:
            with open(e.file, "rb") as f:
                m = self._maps[e.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if e.start % e.dtype.itemsize:
            return torch.frombuffer(m, dtype=torch.uint8, count=e.nbytes, offset=e.start).clone().view(
                e.dtype).view(e.shape)
        return torch.frombuffer(m, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize, offset=e.start).view(e.shape)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def quantization(self, module: str):
        """(bits, group_size) for an MLX-quantized module, from config.json's `quantization` block."""
        return mlx_quantization(self.config, module)

    def tensor(self, name: str, device: str | torch.device = "cpu"):
        """Dense tensor, or a QuantizedTensor when `name` is an MLX-quantized `<module>.weight`, on `device`."""
        from sluice.quant.affine import QuantizedTensor

        device = torch.device(device)
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and self.has(module + ".scales")):
            return self._raw(name, device)
        w_entry, s_shape = self._entries.get(name), self._entries[module + ".scales"].shape
        if w_entry is None:
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing from the checkpoint.")
        if w_entry.dtype != torch.uint32:
            raise ModelFileError(f"{self.path}: quantized tensor '{name}' should be uint32, found {w_entry.dtype}.")
        w_shape = w_entry.shape
        if not w_shape or not s_shape or w_shape[:-1] != s_shape[:-1]:
            raise ModelFileError(f"{self.path}: quantized tensor '{name}' has shape {w_shape} and scales {s_shape}; "
                                 "they must agree in every dim but the last.")
        bits, gs = self.quantization(module) or (None, None)
        # The shapes decide; config.json must agree with them.
        gs_shape = None
        for bits_try in (bits,) if bits else (4, 8, 2, 3, 6):
            in_features = w_shape[-1] * 32 // bits_try
            groups = s_shape[-1] if s_shape else 0
            if groups and in_features % groups == 0 and (gs is None or in_features // groups == gs):
                bits, gs_shape = bits_try, in_features // groups
                break
        if gs_shape is None:
            raise ModelFileError(f"{self.path}: '{name}' has shape {w_shape} and scales {s_shape}, which disagree "
                                 f"with config.json's quantization (bits={bits}, group_size={gs}).")
        w, s, b = (self._raw(n, device) for n in (name, module + ".scales", module + ".biases"))
        qt = QuantizedTensor(w, s, b, bits, gs_shape)
        qt.validate(name)
        return qt
