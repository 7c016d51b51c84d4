"""GGUF block types onto the affine layout: hand-built blocks against the block definitions and gguf-py."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from sluice.errors import ModelFileError, UnsupportedError
from sluice.quant import QuantizedTensor
from sluice.quant.gguf_blocks import from_gguf

T = GGMLQuantizationType
F32 = np.float32


def random_f16(rng, n: int, wild: bool) -> np.ndarray:
    """wild: any finite fp16 (subnormals, negatives, up to 65504); else typical weight scales."""
    if not wild:
        return (rng.standard_normal(n) * 0.01).astype(np.float16)
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf/nan) -> 15
    return bits.view(np.float16)


def build(qtype, rows: int, cols: int, rng, wild=False):
    """Raw GGUF bytes [rows, bytes_per_row] and the fp32 values the block definition gives, element by element."""
    raw, want = bytearray(), np.zeros((rows, cols), dtype=F32)
    n_blocks = rows * cols // 32
    d, m = random_f16(rng, n_blocks, wild), random_f16(rng, n_blocks, wild)
    for b in range(n_blocks):
        r, c0 = divmod(b * 32, cols)
        raw += d[b].tobytes()
        if qtype == T.Q8_0:
            qs = rng.integers(-128, 128, size=32)
            raw += qs.astype(np.int8).tobytes()
            for j in range(32):
                want[r, c0 + j] = F32(d[b]) * F32(qs[j])
            continue
        if qtype == T.Q4_1:
            raw += m[b].tobytes()
        qs = rng.integers(0, 16, size=32)
        raw += bytes(int(qs[j]) | int(qs[j + 16]) << 4 for j in range(16))
        for j in range(32):
            if qtype == T.Q4_0:
                want[r, c0 + j] = F32(d[b]) * F32(qs[j] - 8)
            else:
                want[r, c0 + j] = F32(d[b]) * F32(qs[j]) + F32(m[b])
    return np.frombuffer(bytes(raw), dtype=np.uint8).reshape(rows, -1), want


QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("rows,cols,wild", [(1, 32, False), (3, 64, False), (5, 96, True), (7, 256, True)])
def test_blocks_match_definition_and_gguf_py(qtype, rows, cols, wild):
    raw, want = build(qtype, rows, cols, np.random.default_rng(rows * cols + int(qtype)), wild)
    assert raw.shape == (rows, cols // 32 * GGML_QUANT_SIZES[qtype][1])
    qt = from_gguf(raw, qtype, (rows, cols), name="blk.0.w")
    assert isinstance(qt, QuantizedTensor)
    assert qt.bits == (8 if qtype == T.Q8_0 else 4) and qt.group_size == 32 and qt.shape == (rows, cols)
    got = qt.dequantize().numpy()
    # Equal values (the sign of a zero may differ: d*0 = -0.0 for d < 0, d*q' + bias gives +0.0).
    assert np.array_equal(got, want)
    assert np.array_equal(got, gguf_dequantize(raw, qtype).reshape(rows, cols))
    # The shape can also be read off the byte rows.
    assert np.array_equal(from_gguf(raw, qtype).dequantize().numpy(), want)


def test_scale_dtype_stays_fp16_unless_a_bias_would_overflow():
    rng = np.random.default_rng(0)
    for qtype in QUANT_TYPES:
        raw, _ = build(qtype, 2, 64, rng)
        qt = from_gguf(raw, qtype, (2, 64))
        assert qt.scales.dtype == qt.biases.dtype == torch.float16
    # d = 1024: -8d fits fp16 (Q4_0), -128d = -131072 does not (Q8_0) -> kept exact in fp32.
    block = np.float16(1024.0).tobytes()
    q4 = np.frombuffer((block + bytes(16)) * 2, dtype=np.uint8).reshape(1, -1)
    q8 = np.frombuffer((block + bytes(32)) * 2, dtype=np.uint8).reshape(1, -1)
    assert from_gguf(q4, T.Q4_0).biases.dtype == torch.float16
    qt8 = from_gguf(q8, T.Q8_0)
    assert qt8.biases.dtype == qt8.scales.dtype == torch.float32
    assert qt8.biases[0, 0].item() == -131072.0
    assert np.array_equal(qt8.dequantize().numpy(), gguf_dequantize(q8, T.Q8_0).reshape(1, 64))


def test_three_dim_tensor():
    raw, want = build(T.Q4_1, 6, 64, np.random.default_rng(1))
    qt = from_gguf(raw.reshape(2, 3, -1), T.Q4_1, (2, 3, 64))
    assert qt.weight.shape == (2, 3, 8) and qt.scales.shape == (2, 3, 2)
    assert np.array_equal(qt.dequantize().numpy(), want.reshape(2, 3, 64))


def test_dense_types():
    rng = np.random.default_rng(2)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    out = from_gguf(f32, T.F32)
    assert out.dtype == torch.float32 and np.array_equal(out.numpy(), f32)
    f16 = f32.astype(np.float16)
    out = from_gguf(f16, T.F16, (3, 5))
    assert out.dtype == torch.float16 and np.array_equal(out.numpy(), f16)
    bf16 = torch.from_numpy(f32).bfloat16()
    raw = bf16.view(torch.int16).numpy().view(np.uint8)  # as gguf's reader gives BF16: bytes [rows, 2*cols]
    out = from_gguf(raw, T.BF16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5) and torch.equal(out, bf16)
    one_d = from_gguf(f32[0], T.F32, (5,))
    assert one_d.shape == (5,)


def test_unsupported_types_name_the_type():
    raw = np.zeros((4, 144), dtype=np.uint8)  # one Q4_K block per row
    with pytest.raises(UnsupportedError, match="'blk.0.ffn_down.weight' has GGUF type Q4_K") as e:
        from_gguf(raw, T.Q4_K, (4, 256), name="blk.0.ffn_down.weight")
    assert "Q4_1" in str(e.value) and "Q8_0" in str(e.value)
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        from_gguf(np.zeros((1, 66), dtype=np.uint8), T.IQ2_XXS)
    with pytest.raises(UnsupportedError, match="unknown GGUF type"):
        from_gguf(np.zeros(4, dtype=np.uint8), 9999)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32])
def test_truncated_data(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(4 * 64 // block * size, dtype=np.uint8)
    with pytest.raises(ModelFileError, match="truncated"):
        from_gguf(raw[:-1], qtype, (4, 64), name="x")
    with pytest.raises(ModelFileError):
        from_gguf(raw, qtype, (5, 64))
    if block > 1:
        with pytest.raises(ModelFileError):
            from_gguf(raw, qtype, (8, 33))  # not whole blocks


def test_demo_gguf_tensors_match_gguf_py(demo_gguf_path):
    reader = GGUFReader(demo_gguf_path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen and not t.name.startswith("blk.1."):
            continue
        seen.add(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out = from_gguf(t.data, t.tensor_type, shape, name=t.name)
        got = out.dequantize() if isinstance(out, QuantizedTensor) else out.float()
        want = gguf_dequantize(t.data, t.tensor_type).reshape(shape)
        assert tuple(got.shape) == shape and np.array_equal(got.numpy(), want), t.name
    assert {T.Q8_0, T.Q4_1, T.F32} <= seen
