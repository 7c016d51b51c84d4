"""Triton quantized matmul (GEMV for few rows, tensor-core GEMM for many) against the torch reference, on fresh
random data: under the Triton interpreter on CPU, at real shapes on a GPU (benchmarks/qmatmul_gpu.py)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.qmatmul import reference  # noqa: E402
from sluice.kernels.qmatmul import gemm  # noqa: E402
from sluice.kernels.qmatmul import triton as qmm  # noqa: E402
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
    outs = {"qmatmul": gemm.qmatmul(x.to(DEVICE), qt),
            "gemm": gemm.qgemm(x.to(DEVICE), qt, block_m=32, block_n=32, block_k=64, swap=False),
            "gemm swapped, split-K": gemm.qgemm(x.to(DEVICE), qt, block_m=16, block_n=32, block_k=128, swap=True,
                                               split_k=2)}
    if rows <= 3:
        outs["gemv"] = qmm.qgemv(x.to(DEVICE), qt)
    for what, out in outs.items():
        assert out.dtype == dtype and out.shape == (rows, 48), what
        assert rel_err(out.cpu(), ref) < 1e-2, what


def test_split_k_and_ragged_shapes():
    qt = quantize(torch.randn(70, 576), bits=4, group_size=64)  # 9 groups: masked GEMV steps; N ragged
    qt = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), 4, 64)
    x = torch.randn(2, 576)
    ref = reference.qmatmul(x, type(qt)(*(t.cpu() for t in (qt.weight, qt.scales, qt.biases)), 4, 64))
    for split in (1, 3):
        for block_n, num_warps in ((8, 1), (16, 2)):
            out = qmm.qgemv(x.to(DEVICE).bfloat16(), qt, block_n=block_n, num_warps=num_warps, split_k=split)
            assert rel_err(out.cpu(), ref) < 1e-2
        out = gemm.qgemm(x.to(DEVICE).bfloat16(), qt, block_m=16, block_n=32, block_k=128, split_k=split)
        assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (2, 128), (2, 32)])
def test_gemv_several_steps_per_split(bits, group_size):
    """Rows longer than one GEMV step (128 words per warp), split or not, with ragged N."""
    qt = quantize(torch.randn(20, 4096), bits=bits, group_size=group_size)
    x = torch.randn(1, 4096).bfloat16()
    ref = reference.qmatmul(x.float(), qt)
    qt = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, group_size)
    for split in (1, 2, 3):
        out = qmm.qgemv(x.to(DEVICE), qt, block_n=8, split_k=split)
        assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gemv_preparing_x_itself_matches_prep_x(prefetch):
    """The one-launch GEMV (x rounded to int16 per group in registers, RAW_X) computes what prep_x + GEMV does,
    whether the first step's weights are read before the dependency wait into L2 (1), registers (2) or not (0);
    several steps per split, split or not, masked steps, ragged N. 2-bit g32 (a group inside one thread's
    words) takes prep_x."""
    g = torch.Generator().manual_seed(prefetch)
    for bits, gs, K in ((4, 64, 2304), (8, 32, 1024), (2, 128, 4096), (4, 32, 320)):
        qt = quantize(torch.randn(20, K, generator=g), bits=bits, group_size=gs)
        qt = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, gs)
        x = (torch.randn(2, K, generator=g) * torch.rand(1, K, generator=g) * 4).bfloat16().to(DEVICE)
        ref = reference.qmatmul(x.float().cpu(), type(qt)(*(t.cpu() for t in (qt.weight, qt.scales, qt.biases)),
                                                          bits, gs))
        for split in (1, 2):
            raw = qmm.qgemv_partials(x, qt, block_n=8, split_k=split, raw_x=True, prefetch=prefetch).sum(0)
            prepped = qmm.qgemv_partials(x, qt, block_n=8, split_k=split, raw_x=False, prefetch=prefetch).sum(0)
            assert rel_err(raw.cpu(), prepped.cpu()) < 1e-4, (bits, gs, split)
            assert rel_err(raw.cpu(), ref) < 1e-2, (bits, gs, split)
    assert not qmm.raw_x_supported(2, 32) and qmm.raw_x_supported(2, 64) and qmm.raw_x_supported(8, 32)
    cpu = quantize(torch.randn(8, 256, generator=g), bits=2, group_size=32)
    qt = type(cpu)(*(t.to(DEVICE) for t in (cpu.weight, cpu.scales, cpu.biases)), 2, 32)
    x = torch.randn(1, 256, generator=g)
    with pytest.raises(ValueError, match="cannot be prepared"):
        qmm.qgemv(x.to(DEVICE), qt, raw_x=True)
    assert rel_err(qmm.qgemv(x.to(DEVICE), qt).cpu(), reference.qmatmul(x, cpu)) < 1e-2  # prep_x, then the GEMV


def unpack_prepared(xp: torch.Tensor, bits: int, gs: int, K: int):
    """prep_x's int32 rows -> (x rounded to int16 per group, in natural order [M, K], x scales, group sums)."""
    epw, d, kw, ng = 32 // bits, 8 // bits, K // (32 // bits), K // gs
    q = torch.empty(xp.shape[0], kw, epw, dtype=torch.int64)
    for p in range(2 * d):
        j = p // 2 + 2 * (p % 2) * d
        pair = xp[:, p * kw:(p + 1) * kw].to(torch.int64)
        q[:, :, j] = ((pair & 0xFFFF) ^ 0x8000) - 0x8000  # the low int16, sign-extended
        q[:, :, j + d] = pair >> 16
    tail = xp[:, 2 * d * kw:2 * d * kw + 2 * ng].contiguous().view(torch.float32)
    return q.view(-1, K), tail[:, :ng], tail[:, ng:]


def test_prep_x_rounds_x_to_int16_per_group():
    """prep_x: x ~= q * xscale with |q| <= 32767 (the group's largest |x| maps to 32767), in the pair order dp2a
    meets the codes in; the tail holds the scales and the exact fp32 group sums."""
    x = torch.randn(2, 256)
    x[1, :64] = 0  # an all-zero group: scale 0, codes 0
    for bits, gs in ((4, 64), (2, 32), (8, 128)):
        q, xs, sums = unpack_prepared(qmm.prep_x(x.to(DEVICE), bits, gs).cpu(), bits, gs, 256)
        amax = x.view(2, -1, gs).abs().amax(-1)
        torch.testing.assert_close(xs, amax / qmm.X_INT_MAX)
        torch.testing.assert_close(sums, x.view(2, -1, gs).sum(-1))
        assert q.abs().max() == qmm.X_INT_MAX
        expect = torch.round(x.view(2, -1, gs) / torch.where(amax > 0, amax / qmm.X_INT_MAX, 1)[..., None])
        assert (q - expect.view(2, 256)).abs().max() <= 1  # round-half-even vs half-up, fp32 vs fp32 divide
        assert torch.equal(q[1, :64], torch.zeros(64, dtype=torch.int64))


def test_bad_inputs_raise_before_launch():
    qt = quantize(torch.randn(16, 128), bits=3, group_size=32)
    with pytest.raises(ValueError, match="3-bit"):
        qmm.qgemv(torch.randn(1, 128), qt)
    qt = quantize(torch.randn(16, 128), bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"\[M, 128\]"):
        qmm.qgemv(torch.randn(1, 64), qt)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        qmm.qgemv(torch.ones(1, 128, dtype=torch.int32), qt)


@pytest.mark.parametrize("bits,group_size,K,dtype", [(4, 64, 576, torch.bfloat16), (8, 32, 384, torch.float32),
                                                     (2, 128, 256, torch.float16)])
def test_dequantize_rows_is_an_exact_lookup(bits, group_size, K, dtype):
    """The embedding lookup kernel gives QuantizedTensor.dequantize's rows, rounded once to the dtype, bit for bit
    (no fused multiply-add on a GPU either), for ids of any shape."""
    qt = quantize(torch.randn(37, K), bits=bits, group_size=group_size)
    dev = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, group_size)
    rows = torch.tensor([[3, 36, 0], [3, 17, 5]])
    out = qmm.dequantize_rows(dev, rows.to(DEVICE), dtype)
    assert out.shape == (2, 3, K) and out.dtype == dtype
    assert torch.equal(out.cpu(), qt.dequantize(torch.float32)[rows].to(dtype))


@pytest.mark.parametrize("bits,group_size,K", [(4, 64, 1024), (8, 32, 384), (2, 128, 256), (4, 64, 576)])
def test_dequantize_and_dequant_gemm(bits, group_size, K):
    """The one-pass dequantize kernel reproduces QuantizedTensor.dequantize (bit for bit on the CPU; a GPU may fuse
    s * q + b into one rounding); the prefill path (dequantize + dense GEMM) matches the reference."""
    qt = quantize(torch.randn(70, K), bits=bits, group_size=group_size)
    dev = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, group_size)
    torch.testing.assert_close(qmm.dequantize(dev, torch.float32).cpu(), qt.dequantize(torch.float32),
                               rtol=1e-6 if DEVICE == "cuda" else 0, atol=1e-6 if DEVICE == "cuda" else 0)
    x = torch.randn(40, K)
    assert rel_err(gemm.qgemm_dequant(x.to(DEVICE), dev).cpu(), reference.qmatmul(x, qt)) < 1e-3  # TF32 on a GPU


@pytest.mark.parametrize("M,bits,group_size", [(1, 4, 64), (3, 8, 32)])
def test_projection_with_the_decode_conv_in_one_launch(M, bits, group_size):
    """qgemv_conv = the GEMV, then causal_conv1d_update on its first C channels: the same bits, outputs and conv
    states, for sequences in any state slots."""
    from sluice.kernels.conv1d.triton import causal_conv1d_update

    g = torch.Generator().manual_seed(M + bits)
    N, K, C, W = 96, 256, 64, 4
    qt = quantize(torch.randn(N, K, generator=g), bits=bits, group_size=group_size)
    dev = type(qt)(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), bits, group_size)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    weight = torch.randn(C, W, generator=g).bfloat16().to(DEVICE)
    state = torch.randn(5, C, W - 1, generator=g).bfloat16().to(DEVICE)
    rows = torch.tensor([4, 0, 2][:M], device=DEVICE)
    expect_state = state.clone()
    expect = qmm.qgemv(x, dev, split_k=1)
    expect[:, :C] = causal_conv1d_update(expect[:, :C], weight, expect_state, state_indices=rows)
    got = qmm.qgemv_conv(x, dev, weight, state, rows)
    assert torch.equal(got, expect)
    assert torch.equal(state, expect_state)
    with pytest.raises(ValueError, match="qgemv_conv: unsupported"):
        qmm.qgemv_conv(x, dev, weight, state[:, :, :2], rows)
