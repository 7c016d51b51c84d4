"""Native CPU kernels (attention decode step, RMSNorm) against their torch references, fresh random data."""

import pytest
import torch

from sluice.kernels import cpu as native
from sluice.kernels.attention import cpu as attention_cpu
from sluice.kernels.attention.reference import attention
from sluice.kernels.norm import cpu as norm_cpu
from sluice.kernels.norm.reference import rms_norm
from sluice.kernels.rope.reference import apply_rope, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the CPU kernels")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("Hq,Hkv,D,rot", [(9, 3, 64, 64), (8, 8, 128, 128), (16, 2, 256, 64), (4, 1, 32, 16)])
@pytest.mark.parametrize("pos", [0, 1, 77])
def test_attention_decode_step_matches_reference(Hq, Hkv, D, rot, pos):
    g = torch.Generator().manual_seed(Hq * 1000 + D + pos)
    cap = pos + 5
    k_cache = torch.randn(Hkv, cap, D, generator=g)
    v_cache = torch.randn(Hkv, cap, D, generator=g)
    qkv = torch.randn(Hq + 2 * Hkv, D, generator=g)
    cos, sin = rope_cos_sin(torch.tensor([pos]), rope_inv_freq(rot, 10000.0), torch.float32)
    # reference: rope q and k, write the cache, attend over positions 0..pos
    q = apply_rope(qkv[:Hq], cos, sin)
    k = apply_rope(qkv[Hq:Hq + Hkv], cos, sin)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k[:, pos], ref_v[:, pos] = k, qkv[Hq + Hkv:]
    ref = attention(q[None, :, None], ref_k[None, :, :pos + 1], ref_v[None, :, :pos + 1], D ** -0.5)
    out = attention_cpu.decode_step(qkv, cos[0], sin[0], k_cache, v_cache, pos, D ** -0.5)
    assert rel_err(out, ref.reshape(-1)) < 1e-5
    assert torch.allclose(k_cache[:, pos], ref_k[:, pos], atol=1e-6) and torch.equal(v_cache[:, pos], ref_v[:, pos])
    assert torch.equal(k_cache[:, pos + 1:], ref_k[:, pos + 1:])  # nothing else written


def test_attention_decode_step_rejects_bad_shapes():
    with pytest.raises(ValueError, match="unsupported"):
        attention_cpu.decode_step(torch.randn(7, 64), torch.ones(64), torch.zeros(64), torch.zeros(2, 4, 64),
                                  torch.zeros(2, 4, 64), 4, 0.125)


def test_native_kernels_refuse_short_buffers():
    """Raw pointers go to C, so a buffer shorter than its shape claims is a ValueError in the wrapper, never a read
    past it (issue #26: a GGUF whose norm weight was short made the native RMSNorm read past its buffer)."""
    with pytest.raises(ValueError, match="weight"):
        norm_cpu.rms_norm(torch.randn(3, 64), torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        norm_cpu.rms_norm(torch.randn(3, 64), torch.randn(64, dtype=torch.float64), 1e-5)
    qkv, cache = torch.randn(8, 64), torch.zeros(2, 4, 64)
    with pytest.raises(ValueError, match="unsupported"):  # cos longer than the head
        attention_cpu.decode_step(qkv, torch.ones(128), torch.zeros(128), cache, cache.clone(), 1, 0.125)
    with pytest.raises(ValueError, match="sin"):
        attention_cpu.decode_step(qkv, torch.ones(64), torch.zeros(32), cache, cache.clone(), 1, 0.125)
    with pytest.raises(ValueError, match="v_cache"):
        attention_cpu.decode_step(qkv, torch.ones(64), torch.zeros(64), cache, torch.zeros(2, 64, 4).transpose(1, 2), 1,
                                  0.125)
    with pytest.raises(ValueError, match="unsupported"):
        attention_cpu.decode_step(qkv, torch.ones(64), torch.zeros(64), cache, cache.clone(), -1, 0.125)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (5, 2048)])
def test_rms_norm_matches_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    assert rel_err(norm_cpu.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)) < 1e-6
