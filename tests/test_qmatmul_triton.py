"""Triton quantized matmul (GEMV for few rows, tensor-core GEMM for many) against the torch reference, on fresh
random data: under the Triton interpreter on CPU, at real shapes on a GPU (benchmarks/qmatmul_gpu.py)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.qmatmul import reference  # noqa: E402
from sluice.kernels.qmatmul import triton as tq  # noqa: E402
from sluice.quant.affine import quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(bits, group_size, rows, dtype):
    g = torch.Generator().manual_seed(bits * 7 + group_size + rows)
    w = torch.randn(48, 384, generator=g).to(dtype)
    qt = quantize(w, bits=bits, group_size=group_size)
    qt = type(qt)(qt.weight.to(DEVICE), qt.scales.to(DEVICE), qt.biases.to(DEVICE), bits, group_size)
    x = torch.randn(rows, 384, generator=g).to(dtype)
    ref = reference.qmatmul(x.float(), type(qt)(qt.weight.cpu(), qt.scales.cpu(), qt.biases.cpu(), bits, group_size))
    outs = {"qmatmul": tq.qmatmul(x.to(DEVICE), qt),
            "gemm": tq.qgemm(x.to(DEVICE), qt, block_m=32, block_n=32, block_k=64, swap=False),
            "gemm swapped, split-K": tq.qgemm(x.to(DEVICE), qt, block_m=16, block_n=32, block_k=128, swap=True,
                                               split_k=2)}
    if rows <= 3:
        outs["gemv"] = tq.qgemv(x.to(DEVICE), qt)
    for what, out in outs.items():
        assert out.dtype == dtype and out.shape == (rows, 48), what
        assert rel_err(out.cpu(), ref) < 1e-2, what


def test_split_k_and_ragged_shapes():
    qt = quantize(torch.randn(70, 576), bits=4, group_size=64)  # 9 groups: masked GEMV steps; N ragged
    qt = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), 4, 64)
    x = torch.randn(2, 576)
    ref = reference.qmatmul(x, type(qt)(*(t.cpu() for t in (qt.weight, qt.scales, qt.biases)), 4, 64))
    for split in (1, 3):
        for block_n, g_max in ((16, 8), (64, 4)):
            out = tq.qgemv(x.to(DEVICE).bfloat16(), qt, block_n=block_n, g_max=g_max, split_k=split)
            assert rel_err(out.cpu(), ref) < 1e-2
        out = tq.qgemm(x.to(DEVICE).bfloat16(), qt, block_m=16, block_n=32, block_k=128, split_k=split)
        assert rel_err(out.cpu(), ref) < 1e-2


def test_prep_x_planes():
    """Plane j of a packed word's activations carries 2^-((j*bits) % 16); the tail holds the group sums."""
    x = torch.randn(2, 256)
    for bits, gs in ((4, 64), (2, 32), (8, 128)):
        xp = tq.prep_x(x.to(DEVICE), bits, gs).cpu()
        epw, kw = 32 // bits, 256 // (32 // bits)
        for j in range(epw):
            torch.testing.assert_close(xp[:, j * kw:(j + 1) * kw], x[:, j::epw] / 2 ** ((j * bits) % 16))
        torch.testing.assert_close(xp[:, 256:256 + 256 // gs], x.view(2, -1, gs).sum(-1))


def test_bad_inputs_raise_before_launch():
    qt = quantize(torch.randn(16, 128), bits=3, group_size=32)
    with pytest.raises(ValueError, match="3-bit"):
        tq.qgemv(torch.randn(1, 128), qt)
    qt = quantize(torch.randn(16, 128), bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"\[M, 128\]"):
        tq.qgemv(torch.randn(1, 64), qt)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        tq.qgemv(torch.ones(1, 128, dtype=torch.int32), qt)


@pytest.mark.parametrize("bits,group_size,K", [(4, 64, 1024), (8, 32, 384), (2, 128, 256), (4, 64, 576)])
def test_dequantize_and_dequant_gemm(bits, group_size, K):
    """The one-pass dequantize kernel reproduces QuantizedTensor.dequantize (bit for bit on the CPU; a GPU may fuse
    s * q + b into one rounding); the prefill path (dequantize + dense GEMM) matches the reference."""
    qt = quantize(torch.randn(70, K), bits=bits, group_size=group_size)
    dev = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, group_size)
    torch.testing.assert_close(tq.dequantize(dev, torch.float32).cpu(), qt.dequantize(torch.float32),
                               rtol=1e-6 if DEVICE == "cuda" else 0, atol=1e-6 if DEVICE == "cuda" else 0)
    x = torch.randn(40, K)
    assert rel_err(tq.qgemm_dequant(x.to(DEVICE), dev).cpu(), reference.qmatmul(x, qt)) < 1e-3  # TF32 on a GPU
