"""The CPU quantized-matmul kernel against the torch reference, on fresh random data."""

import pytest
import torch

from sluice.kernels import qmatmul as qm
from sluice.kernels.qmatmul import cpu, reference
from sluice.quant.affine import QuantizedTensor, quantize

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernel")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_qmatmul_matches_reference(bits, group_size, sdtype, rows):
    g = torch.Generator().manual_seed(bits * 1000 + group_size + rows)
    w = torch.randn(80, 384, generator=g).to(sdtype)
    qt = quantize(w, bits=bits, group_size=group_size)
    x = torch.randn(rows, 384, generator=g)
    ref = reference.qmatmul(x, qt)
    out = qm.qmatmul(x, qt)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_rows_is_exact(bits):
    g = torch.Generator().manual_seed(bits)
    qt = quantize(torch.randn(50, 256, generator=g), bits=bits, group_size=64)
    full = qt.dequantize(torch.float32)
    assert torch.equal(cpu.dequantize_rows(qt), full)
    rows = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(qm.dequantize_rows(qt, rows), full[rows])


def test_unsupported_bits_fall_back_to_reference():
    qt = quantize(torch.randn(16, 128), bits=3, group_size=32)
    assert not cpu.supports(qt)
    x = torch.randn(2, 128)
    assert rel_err(qm.qmatmul(x, qt), reference.qmatmul(x, qt)) < 1e-6


def test_wrong_input_width_is_an_error():
    qt = quantize(torch.randn(16, 128), bits=4, group_size=32)
    with pytest.raises(ValueError, match="features"):
        qm.qmatmul(torch.randn(1, 64), qt)


def test_batched_leading_dims():
    qt = quantize(torch.randn(24, 64), bits=4, group_size=32)
    x = torch.randn(2, 5, 64)
    assert qm.qmatmul(x, qt).shape == (2, 5, 24)
    assert isinstance(qt, QuantizedTensor)


def test_native_kernel_refuses_short_buffers():
    """The C kernel takes raw pointers: a packed weight, scales or input shorter than the shapes claim is a
    ValueError in the wrapper, never a read past the buffer (issue #26)."""
    qt = quantize(torch.randn(16, 128), bits=4, group_size=32)
    short_scales = QuantizedTensor(qt.weight, qt.scales[:8], qt.biases, 4, 32)  # 16 rows of words, 8 of scales
    with pytest.raises(ValueError, match="scales"):
        cpu.QMatmul(short_scales)
    with pytest.raises(ValueError, match="biases"):
        cpu.dequantize_rows(QuantizedTensor(qt.weight, qt.scales, qt.biases[:, :2].contiguous(), 4, 32))
    with pytest.raises(ValueError, match="features"):
        cpu.QMatmul(qt)(torch.randn(1, 64))
    with pytest.raises(ValueError, match="contiguous"):
        cpu.QMatmul(qt)(torch.randn(128, 2).T)
