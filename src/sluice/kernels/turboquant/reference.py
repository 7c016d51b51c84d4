"""TurboQuant (MSE variant) for KV-cache vectors: the torch oracle.

A vector x [d] (d a power of two) is rotated, y = R x with R = H diag(s) / sqrt(d) (H the Sylvester Hadamard
matrix, s fixed pseudo-random signs: a randomised Hadamard transform, orthonormal), so that the coordinates of
y / |x| are close to N(0, 1/d) whatever x was. Each coordinate of sqrt(d) y / |x| is then replaced by the
nearest of the 16 Lloyd-Max levels c[0..15] for N(0, 1) (rounded to an int8 grid, below) and stored as a 4-bit
code, two per byte: byte i holds coordinate i (low nibble) and coordinate i + d/2 (high nibble), so a kernel meets
each half of the vector in one nibble without shuffling coordinates (a value cache interleaves four positions:
`interleave`). One fp32 scale per vector, |x| / |c[codes]|, makes the reconstruction

    y_hat = scale * c[codes]        (in the rotated domain; x_hat = R^T y_hat)

keep the norm of x exactly (an MSE quantizer alone shrinks it: E|y_hat|^2 = (1 - D) |x|^2). Attention runs in
the rotated domain: q.k = (R q).(R k), and sum p_j v_j = R^T sum p_j (R v_j). Bytes per vector: d / 2 + 4.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

BITS = 4
LEVELS = 1 << BITS
SIGN_SEED = 0x5EED  # the rotation's signs: fixed, so a cache means the same on every machine


@lru_cache(maxsize=None)
def lloyd_max_gaussian(levels: int = LEVELS, iterations: int = 2000) -> tuple[float, ...]:
    """The Lloyd-Max (MSE-optimal) reconstruction levels of N(0, 1), by Lloyd's iteration: each level the
    conditional mean of its cell, each cell boundary the midpoint of its two levels."""
    phi = lambda x: math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    c = [-3 + 6 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(iterations):
        b = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
        c = [(phi(b[i]) - phi(b[i + 1])) / (cdf(b[i + 1]) - cdf(b[i])) for i in range(levels)]
    return tuple(c)


def lloyd_max_distortion(levels: int = LEVELS) -> float:
    """E[(X - Q(X))^2] for X ~ N(0, 1) under the Lloyd-Max quantizer (Max 1960: 0.009497 at 16 levels)."""
    c = lloyd_max_gaussian(levels)
    b = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
    phi = lambda x: 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    total = 0.0
    for i in range(levels):  # E[(X - c)^2; a < X < b] = E[X^2; cell] - 2c E[X; cell] + c^2 P(cell)
        a, z = b[i], b[i + 1]
        p = cdf(z) - cdf(a)
        m1 = phi(a) - phi(z)
        m2 = p + (a * phi(a) if not math.isinf(a) else 0.0) - (z * phi(z) if not math.isinf(z) else 0.0)
        total += m2 - 2 * c[i] * m1 + c[i] ** 2 * p
    return total


# The levels used are the Lloyd-Max ones rounded to a grid of LEVEL_STEP = max level / 127: each is then an int8
# times LEVEL_STEP, which the GPU decode kernel turns into exact fp16 integers with byte permutes, no table in
# memory (`kernels/attention/triton.py`). The rounding moves a level by at most 0.011 and the distortion of N(0, 1)
# from 0.009501 to 0.009514.
LEVEL_STEP = max(lloyd_max_gaussian()) / 127


def int_levels() -> tuple[int, ...]:
    """The 16 levels in units of LEVEL_STEP: int8, symmetric, -127 .. 127."""
    return tuple(round(c / LEVEL_STEP) for c in lloyd_max_gaussian())


# The tables below are made once per device: the decode step of every layer uses them, and building them anew
# would copy them from the host each time.


@lru_cache(maxsize=None)
def _codebook(device: torch.device) -> torch.Tensor:
    return torch.tensor(int_levels(), dtype=torch.float32, device=device) * LEVEL_STEP


def codebook(device=None) -> torch.Tensor:
    """The 16 levels (int_levels() * LEVEL_STEP), fp32 (a shared tensor: do not write to it)."""
    return _codebook(torch.device(device or "cpu"))


@lru_cache(maxsize=None)
def _boundaries(device: torch.device) -> torch.Tensor:
    c = _codebook(device)
    return (c[1:] + c[:-1]) / 2


def boundaries(device=None) -> torch.Tensor:
    """The 15 cell boundaries between consecutive levels (a code is the number of boundaries below y)."""
    return _boundaries(torch.device(device or "cpu"))


def hadamard(d: int, device=None) -> torch.Tensor:
    """The Sylvester Hadamard matrix H [d, d] (entries +-1, H H^T = d I)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"TurboQuant needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def signs(d: int, device=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED + d)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.float32).to(device)


@lru_cache(maxsize=None)
def _rotation(d: int, device: torch.device) -> torch.Tensor:
    return (hadamard(d) * signs(d)[None, :] / math.sqrt(d)).to(device)


def rotation(d: int, device=None) -> torch.Tensor:
    """R = H diag(s) / sqrt(d) [d, d], orthonormal: y = x @ R^T rotates, x = y @ R rotates back (a shared
    tensor: do not write to it)."""
    return _rotation(d, torch.device(device or "cpu"))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x over the last dim (fp32)."""
    return x.float() @ rotation(x.shape[-1], x.device).T


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^T y over the last dim (fp32)."""
    return y.float() @ rotation(y.shape[-1], y.device)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., d] codes 0..15 -> [..., d/2] uint8: byte i = code i | code (i + d/2) << 4."""
    c = codes.to(torch.uint8)
    h = c.shape[-1] // 2
    return c[..., :h] | (c[..., h:] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., d/2] uint8 -> [..., d] codes (int64)."""
    return torch.cat([(packed & 0xF).long(), (packed >> 4).long()], dim=-1)


def interleave(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes of positions [..., n, d/2] (n a multiple of 4) -> [..., n/4, d/2, 4]: the value cache's layout,
    four positions of each byte column side by side (the decode kernel's P V product sums over positions, and its
    int8 tensor cores take four consecutive positions per register)."""
    *lead, n, h = packed.shape
    return packed.reshape(*lead, n // 4, 4, h).transpose(-1, -2).contiguous()


def deinterleave(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave: [..., n/4, d/2, 4] -> [..., n, d/2]."""
    *lead, g, h, four = codes.shape
    return codes.transpose(-1, -2).reshape(*lead, 4 * g, h)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (packed codes [..., d/2] uint8, scale [...] fp32)."""
    return quantize_rotated(rotate(x))


def quantize_rotated(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize for an already rotated y = R x (fp32)."""
    d = y.shape[-1]
    norm = y.norm(dim=-1)
    codes = torch.bucketize(y * (math.sqrt(d) / norm.clamp_min(1e-30))[..., None], boundaries(y.device))
    c_norm = codebook(y.device)[codes].norm(dim=-1)
    return pack(codes), norm / c_norm


def dequantize_rotated(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed, scale) -> y_hat [..., d] fp32 in the rotated domain."""
    return codebook(packed.device)[unpack(packed)] * scale[..., None]


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed, scale) -> x_hat [..., d] fp32."""
    return unrotate(dequantize_rotated(packed, scale))


def bytes_per_vector(d: int) -> int:
    return d // 2 + 4
