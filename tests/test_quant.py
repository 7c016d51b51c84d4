"""MLX affine quantization: packing layout, quantize() against a plain per-group re-statement of MLX's algorithm."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.errors import InvalidOptionError, ModelFileError, UnsupportedError
from sluice.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantizedTensor, dequantize, pack, quantize, unpack

F32 = np.float32
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Code i at stream bits [i*bits, (i+1)*bits), the stream being the little-endian bytes of the words."""
    rows = codes.reshape(-1, codes.shape[-1])
    out = []
    for row in rows:
        stream = 0
        for i, c in enumerate(row.tolist()):
            stream |= c << (i * bits)
        out.append(np.frombuffer(stream.to_bytes(len(row) * bits // 8, "little"), dtype="<u4"))
    return np.stack(out).reshape(*codes.shape[:-1], -1)


def round_half_away(x) -> float:
    return math.copysign(math.floor(abs(float(x)) + 0.5), float(x))  # exact in float64 for float32 inputs


def ref_quantize(w: np.ndarray, bits: int, group_size: int, device: str = "cpu"):
    """MLX's affine_quantize written out one group at a time with float32 scalars (backend/cpu/quantized.cpp;
    device="gpu": the Metal/CUDA kernels, max reduction starting at 0 and round half away from zero).
    Returns codes, fp32 scales, fp32 biases, q0 (per group)."""
    rnd = np.rint if device == "cpu" else round_half_away
    n_bins, eps = F32((1 << bits) - 1), F32(1e-7)
    rows = w.reshape(-1, w.shape[-1]).astype(F32)
    n_groups = rows.shape[1] // group_size
    codes = np.zeros(rows.shape, dtype=np.int64)
    scales, biases, q0s = (np.zeros((rows.shape[0], n_groups), dtype=F32) for _ in range(3))
    for r in range(rows.shape[0]):
        for g in range(n_groups):
            x = rows[r, g * group_size:(g + 1) * group_size]
            w_min, w_max = F32(x.min()), F32(x.max())
            if device == "gpu":
                w_max = max(w_max, F32(0))
            scale = max(F32(F32(w_max - w_min) / n_bins), eps)
            side = abs(w_min) > abs(w_max)
            if not side:
                scale = F32(-scale)
            edge = w_min if side else w_max
            q0 = F32(rnd(F32(edge / scale)))
            bias = F32(0)
            if q0 != 0:
                scale, bias = F32(edge / q0), edge
            for j in range(group_size):
                q = rnd(F32(F32(x[j] - bias) / scale))
                codes[r, g * group_size + j] = int(min(max(q, 0), int(n_bins)))
            scales[r, g], biases[r, g], q0s[r, g] = scale, bias, q0
    lead = w.shape[:-1]
    return (codes.reshape(w.shape), scales.reshape(*lead, n_groups), biases.reshape(*lead, n_groups),
            q0s.reshape(*lead, n_groups))


def make_group(rng: np.random.Generator, kind: str, bits: int, n: int) -> np.ndarray:
    mag = F32(2.0 ** rng.integers(-12, 8))
    if kind == "normal":
        x = rng.standard_normal(n) * mag
    elif kind == "min_dominates":  # |min| > |max|: positive scale
        x = (rng.standard_normal(n) - 3) * mag
    elif kind == "max_dominates":  # |max| > |min|: negative scale
        x = (rng.standard_normal(n) + 3) * mag
    elif kind == "same_sign":
        x = (rng.random(n) + 0.5) * mag * rng.choice([-1, 1])
    elif kind == "equal":
        x = np.full(n, rng.choice([0.0, rng.standard_normal() * mag]))
    elif kind == "zeros":
        x = rng.standard_normal(n) * mag
        x[rng.random(n) < 0.3] = 0.0
        x[rng.integers(n)] = 0.0
    elif kind == "ties":  # scale exactly +-mag, values on half steps: (x - bias)/scale hits .5 exactly
        n_bins = (1 << bits) - 1
        lo, hi = -(n_bins // 2), n_bins - n_bins // 2
        x = rng.integers(2 * lo, 2 * hi + 1, size=n) / 2
        x[:2] = lo, hi
        if rng.random() < 0.5:
            x = -x
        x = x * mag
    elif kind == "tiny":  # range below eps*n_bins: scale clamps to eps, q0 may be 0
        x = rng.standard_normal(n) * 1e-8
    else:
        raise AssertionError(kind)
    return rng.permutation(x.astype(F32))


KINDS = ["normal", "min_dominates", "max_dominates", "same_sign", "equal", "zeros", "ties", "tiny"]


def random_weight(seed: int, bits: int, group_size: int, lead: tuple, n_groups: int, dtype) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    rows = math.prod(lead)
    groups = [make_group(rng, KINDS[rng.integers(len(KINDS))], bits, group_size) for _ in range(rows * n_groups)]
    w = torch.from_numpy(np.concatenate(groups).reshape(*lead, n_groups * group_size)).to(dtype)
    return w + 0.0  # no -0.0: which zero a max() returns is not specified anywhere


shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(SUPPORTED_BITS), group_size=st.sampled_from(SUPPORTED_GROUP_SIZES),
       lead=st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple), k=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip_and_layout(bits, group_size, lead, k, seed):
    n = group_size * k
    codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 1 << bits, size=(*lead, n)))
    words = pack(codes, bits)
    assert words.dtype == torch.uint32 and words.shape == (*lead, n * bits // 32)
    assert np.array_equal(words.numpy(), ref_pack(codes.numpy(), bits))
    back = unpack(words, bits, n)
    assert back.shape == codes.shape and torch.equal(back.long(), codes)


def test_pack_layout_examples():
    # 4-bit: element j of a word at bits [4j, 4j+4); byte b = elements 2b (low nibble), 2b+1 (high nibble).
    assert pack(torch.arange(8).reshape(1, 8), 4).item() == 0x76543210
    assert pack(torch.tensor([[1, 2, 3, 0] * 4]), 2).item() == int("".join(["00", "11", "10", "01"] * 4), 2)
    # 3-bit: 32 codes in 3 words, code 10 straddles words 0 and 1 (bits 30..32).
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 10] = 0b111
    assert pack(codes, 3).tolist() == [[0xC0000000, 0x1, 0x0]]


def test_pack_rejects_bad_input():
    with pytest.raises(InvalidOptionError):
        pack(torch.zeros(1, 12, dtype=torch.int64), 4)  # 48 bits: not whole words
    with pytest.raises(InvalidOptionError):
        pack(torch.full((1, 8), 16), 4)
    with pytest.raises(InvalidOptionError):
        unpack(torch.zeros(1, 3, dtype=torch.uint32), 4, 25)
    with pytest.raises(UnsupportedError):
        pack(torch.zeros(1, 32, dtype=torch.int64), 7)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from(SUPPORTED_BITS), group_size=st.sampled_from(SUPPORTED_GROUP_SIZES),
       lead=shapes, n_groups=st.integers(1, 3), dtype=st.sampled_from(DTYPES),
       device=st.sampled_from(["cpu", "gpu"]), seed=st.integers(0, 2**32 - 1))
def test_quantize_matches_mlx_algorithm(bits, group_size, lead, n_groups, dtype, device, seed):
    w = random_weight(seed, bits, group_size, lead, n_groups, dtype)
    qt = quantize(w, bits=bits, group_size=group_size, mlx_device=device)
    qt.validate()
    codes, scales, biases, q0 = ref_quantize(w.float().numpy(), bits, group_size, device)

    assert qt.shape == tuple(w.shape) and qt.scales.dtype == dtype and qt.biases.dtype == dtype
    assert torch.equal(unpack(qt.weight, bits).long(), torch.from_numpy(codes))
    assert torch.equal(qt.scales, torch.from_numpy(scales).to(dtype))  # MLX casts after computing the codes
    assert torch.equal(qt.biases, torch.from_numpy(biases).to(dtype))

    # dequantize is scale*q + bias in fp32 with the stored (cast) parameters
    expect = (codes.astype(F32).reshape(*lead, n_groups, group_size) * qt.scales.float().numpy()[..., None]
              + qt.biases.float().numpy()[..., None]).astype(F32)
    assert np.array_equal(qt.dequantize().numpy(), expect.reshape(w.shape))

    if dtype != torch.float32:
        return
    # Error bound (fp32 parameters, nothing lost to a cast): half a step where the exact code is in range. The
    # edge is pinned to a code and scale re-derived as edge/q0, so the far end can overshoot by up to one step
    # and get clipped: there the bound is one step.
    x = w.double().numpy().reshape(*lead, n_groups, group_size)
    s, b = scales.astype(np.float64)[..., None], biases.astype(np.float64)[..., None]
    err = np.abs(qt.dequantize().double().numpy().reshape(x.shape) - x)
    slack = 2.0**-21 * (np.abs(s) * ((1 << bits) - 1) + np.abs(b) + np.abs(x))
    exact_code = (x - b) / s
    in_range = (exact_code >= -0.5) & (exact_code <= (1 << bits) - 0.5)
    assert np.all(err <= np.where(in_range, np.abs(s) / 2, np.abs(s)) + slack)

    # Zero lands on code -q0 when the group spans it. It dequantizes to 0 only up to rounding: fp32
    # (edge/q0)*(-q0) need not be exactly -edge.
    zero = (x == 0) & (q0[..., None] != 0)
    code = codes.reshape(x.shape)
    assert np.all(code[zero] == np.broadcast_to(-q0[..., None], x.shape)[zero])
    assert np.all(err[zero] <= np.broadcast_to(np.abs(b) * 2.0**-22, x.shape)[zero])


def test_quantize_rounding_half_even_on_cpu_half_away_on_gpu():
    # min -7, max 8: scale -1, bias 8, codes 8 - x. x = 2.5 -> 5.5 -> 6 either way; x = 1.5 -> 6.5 -> 6 (half
    # to even, CPU) or 7 (half away from zero, GPU).
    w = torch.tensor([[-7.0, 8.0, 1.5, 2.5] + [0.0] * 28])
    cpu = unpack(quantize(w, 4, 32).weight, 4)[0, :4].tolist()
    gpu = unpack(quantize(w, 4, 32, mlx_device="gpu").weight, 4)[0, :4].tolist()
    assert cpu == [15, 0, 6, 6] and gpu == [15, 0, 7, 6]
    # The GPU kernels start the max at 0. All-negative group in [-20, -10]: edge -20 either way, but
    # q0 = round(-20 / (10/15)) = -30 on the CPU and round(-20 / (20/15)) = -15 on the GPU.
    neg = -torch.linspace(10.0, 20.0, 32).reshape(1, 32)
    edge = torch.tensor(-20.0)
    assert quantize(neg, 4, 32).scales.item() == (edge / -30).item()
    assert quantize(neg, 4, 32, mlx_device="gpu").scales.item() == (edge / -15).item()


def test_negative_scale_when_max_dominates():
    w = torch.linspace(-1.0, 3.0, 64).reshape(1, 64)
    qt = quantize(w, 4, 64)
    assert qt.scales.item() < 0 and qt.biases.item() == 3.0  # bias is the dominant edge, not the min


def test_quantized_tensor_properties_and_validation():
    qt = quantize(torch.randn(2, 3, 256, dtype=torch.bfloat16), bits=3, group_size=128)
    assert qt.shape == (2, 3, 256) and qt.in_features == 256 and qt.out_features == 3
    assert qt.weight.shape == (2, 3, 24) and qt.scales.shape == (2, 3, 2)
    assert qt.nbytes == 2 * 3 * 24 * 4 + 2 * (2 * 3 * 2 * 2)
    assert torch.equal(dequantize(qt, torch.bfloat16), qt.dequantize().bfloat16())

    with pytest.raises(ModelFileError, match="uint32"):
        QuantizedTensor(qt.weight.view(torch.int32), qt.scales, qt.biases, 3, 128).validate()
    with pytest.raises(ModelFileError, match="scales"):
        QuantizedTensor(qt.weight, qt.scales[..., :1], qt.biases[..., :1], 3, 128).validate("w")
    with pytest.raises(ModelFileError):
        QuantizedTensor(qt.weight, qt.scales, qt.biases.float(), 3, 128).validate()
    with pytest.raises(ModelFileError):
        QuantizedTensor(qt.weight, qt.scales, qt.biases, 3, 64).validate()
    with pytest.raises(UnsupportedError):
        QuantizedTensor(qt.weight, qt.scales.to(torch.int16), qt.biases.to(torch.int16), 3, 128).validate()


@pytest.mark.parametrize("bits,group_size", [(7, 64), (1, 64), (16, 64), (4, 16), (4, 256), (4, 0)])
def test_unsupported_parameters(bits, group_size):
    w = torch.randn(4, 512)
    with pytest.raises(UnsupportedError):
        quantize(w, bits=bits, group_size=group_size)
    with pytest.raises(UnsupportedError):
        QuantizedTensor(torch.zeros(4, 64, dtype=torch.uint32), torch.ones(4, 8), torch.zeros(4, 8), bits, group_size)


def test_quantize_rejects_bad_weights():
    with pytest.raises(InvalidOptionError):
        quantize(torch.randn(4, 96), bits=4, group_size=64)
    with pytest.raises(InvalidOptionError):
        quantize(torch.randn(64), bits=4, group_size=64)
    with pytest.raises(InvalidOptionError):
        quantize(torch.randn(4, 64).double(), bits=4, group_size=64)
    with pytest.raises(InvalidOptionError):
        quantize(torch.randn(4, 64), bits=4, group_size=64, mlx_device="metal")
