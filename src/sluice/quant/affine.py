"""MLX "affine" group quantization: the in-memory layout every quantized weight in sluice uses.

A weight ``[..., out, in]`` is cut along ``in`` into groups of ``group_size`` contiguous elements; each group has one
scale and one bias and the element is ``w = scale * q + bias`` with an unsigned code ``q`` in ``[0, 2**bits)``.
Codes are packed into uint32 words exactly as MLX stores them (``mlx/ops.cpp``, ``backend/cpu/quantized.cpp``):

* bits 2, 4, 8: ``32 / bits`` codes per word, code j of a word at bits ``[j*bits, (j+1)*bits)`` (LSB first);
* bits 3, 5, 6: one continuous LSB-first bit stream over the little-endian bytes of the words
  (3 bits: 8 codes per 3 bytes; 5 bits: 8 per 5 bytes; 6 bits: 4 per 3 bytes).

Both rules are the same statement, "code i occupies stream bits ``[i*bits, (i+1)*bits)``", which is what lets
``pack``/``unpack`` treat the words as a byte stream (this assumes a little-endian host, as torch's dtype views do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.errors import InvalidOptionError, ModelFileError, UnsupportedError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# bits -> (codes per unit, bytes per unit): the smallest run of codes that fills whole bytes.
_UNITS = {2: (4, 1), 4: (2, 1), 8: (1, 1), 3: (8, 3), 5: (8, 5), 6: (4, 3)}


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise UnsupportedError(f"{bits}-bit affine quantization is not supported; supported bits: "
                               f"{', '.join(map(str, SUPPORTED_BITS))}.")


def _check_group_size(group_size: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedError(f"affine quantization group size {group_size} is not supported; supported: "
                               f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}.")


@dataclass
class QuantizedTensor:
    """A packed MLX-affine weight. ``weight`` uint32 ``[..., out, in*bits/32]``; ``scales``/``biases``
    ``[..., out, in/group_size]`` in fp16, bf16 or fp32 (kept as loaded: converting them could lose bits)."""

    weight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape ``(..., out, in)``."""
        return (*self.weight.shape[:-1], self.in_features)

    def to(self, device) -> "QuantizedTensor":
        """The same packed weight on `device` (as `torch.Tensor.to`: the same tensors when already there)."""
        return QuantizedTensor(self.weight.to(device), self.scales.to(device), self.biases.to(device), self.bits,
                               self.group_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.biases))

    def validate(self, name: str | None = None) -> None:
        """Raise ModelFileError (inconsistent shapes, wrong packed dtype) or UnsupportedError (scale dtype)."""
        what = f"quantized tensor {name!r}" if name else "quantized tensor"
        w, s, b = self.weight, self.scales, self.biases
        if w.dtype != torch.uint32:
            raise ModelFileError(f"{what}: packed weight should be uint32, found {w.dtype}.")
        if w.dim() < 2:
            raise ModelFileError(f"{what}: packed weight should be at least 2-D [out, in*bits/32], "
                                 f"found shape {tuple(w.shape)}.")
        for part, t in (("scales", s), ("biases", b)):
            if t.dtype not in SCALE_DTYPES:
                raise UnsupportedError(f"{what}: {part} have dtype {t.dtype}; supported: float16, bfloat16, float32.")
        if s.dtype != b.dtype:
            raise ModelFileError(f"{what}: scales ({s.dtype}) and biases ({b.dtype}) have different dtypes.")
        if s.shape != b.shape:
            raise ModelFileError(f"{what}: scales {tuple(s.shape)} and biases {tuple(b.shape)} differ in shape.")
        if (w.shape[-1] * 32) % self.bits:
            raise ModelFileError(f"{what}: {w.shape[-1]} words per row do not hold a whole number of "
                                 f"{self.bits}-bit codes.")
        expected = (*w.shape[:-1], self.in_features // self.group_size)
        if self.in_features % self.group_size or tuple(s.shape) != expected:
            raise ModelFileError(f"{what}: packed weight {tuple(w.shape)} ({self.bits}-bit, i.e. {self.in_features} "
                                 f"inputs) needs scales/biases of shape {expected} for group size "
                                 f"{self.group_size}, found {tuple(s.shape)}.")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` with values in ``[0, 2**bits)`` -> uint32 words ``[..., n*bits/32]`` (MLX layout)."""
    _check_bits(bits)
    n = q.shape[-1]
    if (n * bits) % 32:
        raise InvalidOptionError(f"cannot pack {n} {bits}-bit codes into whole uint32 words "
                                 f"(n*bits must be a multiple of 32).")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise InvalidOptionError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing.")
    lead = q.shape[:-1]
    per, nbytes = _UNITS[bits]
    if nbytes == 1:  # power-of-two bits: whole codes per byte, cheap uint8 arithmetic
        q8 = q.to(torch.uint8).reshape(*lead, n // per, per)
        byte = q8[..., 0].clone()
        for j in range(1, per):
            byte |= q8[..., j] << (bits * j)
    else:  # 3/5/6 bits: gather `per` codes into one int64, then split it into `nbytes` bytes
        ar = torch.arange(max(per, nbytes), dtype=torch.int64, device=q.device)
        unit = (q.to(torch.int64).reshape(*lead, n // per, per) << (ar[:per] * bits)).sum(-1)
        byte = ((unit.unsqueeze(-1) >> (ar[:nbytes] * 8)) & 0xFF).to(torch.uint8)
    return byte.reshape(*lead, n * bits // 8).view(torch.uint32)


def unpack(words: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """uint32 words ``[..., W]`` -> uint8 codes ``[..., n]`` with ``n = W*32/bits`` (the inverse of ``pack``)."""
    _check_bits(bits)
    if words.dtype not in (torch.uint32, torch.int32):
        raise InvalidOptionError(f"packed words must be uint32 (or int32), found {words.dtype}.")
    lead, n_words = words.shape[:-1], words.shape[-1]
    if n is None:
        n = n_words * 32 // bits
    if n * bits != n_words * 32:
        raise InvalidOptionError(f"{n_words} words hold {n_words * 32 / bits:g} {bits}-bit codes, not {n}.")
    byte = words.contiguous().view(torch.uint8)
    per, nbytes = _UNITS[bits]
    mask = (1 << bits) - 1
    if nbytes == 1:
        codes = torch.stack([(byte >> (bits * j)) & mask for j in range(per)], dim=-1)
    else:
        b64 = byte.reshape(*lead, n // per, nbytes).to(torch.int64)
        ar = torch.arange(max(per, nbytes), dtype=torch.int64, device=words.device)
        unit = (b64 << (ar[:nbytes] * 8)).sum(-1)
        codes = ((unit.unsqueeze(-1) >> (ar[:per] * bits)) & mask).to(torch.uint8)
    return codes.reshape(*lead, n)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # Metal/CUDA round(); written with trunc (x - trunc(x) is exact) to avoid floor(x + 0.5)'s 0.49999997 -> 1 bug.
    t = torch.trunc(x)
    return t + torch.where((x - t).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64, *, mlx_device: str = "cpu") -> QuantizedTensor:
    """MLX's ``mx.quantize(w, group_size, bits)`` (mode "affine"), bit for bit: codes, scales and biases.

    ``mlx_device="cpu"`` reproduces MLX's CPU kernel (``backend/cpu/quantized.cpp``) and the ``ops.cpp`` fallback:
    round half to even (``std::rint`` / ``mx.round``), true group min/max. ``mlx_device="gpu"`` follows the Metal
    and CUDA kernels, which differ in two ways: ``round`` is half away from zero, and the max reduction starts at 0
    (``w_max = max(0, max(group))``). MLX on Apple silicon quantizes on the GPU by default.

    All arithmetic is fp32. The codes are computed with the fp32 scale and bias, *before* those are cast to
    ``w.dtype`` for storage -- both MLX kernels and the fallback do it in this order.
    """
    _check_bits(bits)
    _check_group_size(group_size)
    if mlx_device not in ("cpu", "gpu"):
        raise InvalidOptionError(f"mlx_device must be 'cpu' or 'gpu', not {mlx_device!r}.")
    if w.dtype not in SCALE_DTYPES:
        raise InvalidOptionError(f"can only quantize float16/bfloat16/float32 weights, not {w.dtype}.")
    if w.dim() < 2:
        raise InvalidOptionError(f"quantize needs a weight of at least 2 dims [..., out, in], got {tuple(w.shape)}.")
    n = w.shape[-1]
    if n % group_size:
        raise InvalidOptionError(f"the last dim ({n}) is not a multiple of the group size ({group_size}).")
    lead = w.shape[:-1]
    g = w.to(torch.float32).reshape(*lead, n // group_size, group_size)
    w_max = g.amax(dim=-1, keepdim=True)
    w_min = g.amin(dim=-1, keepdim=True)
    if mlx_device == "gpu":
        w_max = w_max.clamp_min(0.0)
    rnd = torch.round if mlx_device == "cpu" else _round_half_away  # torch.round: half to even
    n_bins = torch.full_like(w_max, float((1 << bits) - 1))  # a tensor, so the division is a true fp32 division
    eps = torch.full_like(w_max, 1e-7)
    scale = torch.maximum((w_max - w_min) / n_bins, eps)
    side = w_min.abs() > w_max.abs()
    scale = torch.where(side, scale, -scale)  # negative when the max dominates: the edge always gets code 0
    edge = torch.where(side, w_min, w_max)
    q0 = rnd(edge / scale)
    nonzero = q0 != 0
    # Re-derive the scale from the edge so the edge (and, when the group spans 0, zero) lands on a code.
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = rnd((g - bias) / scale).clamp_(0, (1 << bits) - 1)
    codes = q.to(torch.uint8).reshape(*lead, n)
    return QuantizedTensor(pack(codes, bits), scale.squeeze(-1).to(w.dtype), bias.squeeze(-1).to(w.dtype),
                           bits, group_size)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * q + bias`` in fp32 (one multiply, one add, each rounded), then cast to ``dtype``."""
    shape = qt.shape
    groups = shape[-1] // qt.group_size
    q = unpack(qt.weight, qt.bits, shape[-1]).to(torch.float32).reshape(*shape[:-1], groups, qt.group_size)
    w = q * qt.scales.to(torch.float32).unsqueeze(-1) + qt.biases.to(torch.float32).unsqueeze(-1)
    return w.reshape(shape).to(dtype)
