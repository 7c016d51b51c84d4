"""The fused q/k head norm + partial RoPE (`kernels/rope/triton.py`) against the torch references on fresh random
data: under the Triton interpreter on CPU, the same tests on a GPU. fp32 agrees to rounding; bf16 rounds where the
references round, so nearly every element is bit-identical."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.norm.reference import rms_norm_fp32_scale  # noqa: E402
from sluice.kernels.rope import triton as rt  # noqa: E402
from sluice.kernels.rope.reference import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,D,r", [(1, 1, 16, 256, 64), (2, 3, 2, 256, 64), (1, 5, 4, 64, 64), (2, 1, 3, 128, 32)])
def test_norm_rope_matches_the_references(B, T, H, D, r, dtype):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H + D)
    wide = (torch.randn(B, T, H, 2 * D, generator=g) * 2).to(dtype)
    x = wide[..., :D]  # a strided view, as q is in the gated attention's projection
    w = torch.randn(D, generator=g) * 0.3 + 1.0
    pos = torch.randint(0, 5000, (B, T), generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(r, 1e7), dtype)
    ref = apply_rope(rms_norm_fp32_scale(x, w, EPS), cos[:, :, None], sin[:, :, None])
    out = rt.norm_rope(x.to(DEVICE), w.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), EPS).cpu()
    assert out.dtype == dtype and out.shape == ref.shape
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if dtype == torch.float32:
        assert err < 1e-6
    else:
        assert err < 1e-2 and (out == ref).float().mean() >= 0.99


def test_norm_rope_rejects_bad_tables():
    x = torch.zeros(1, 2, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="r even"):
        rt.norm_rope(x, torch.ones(64, device=DEVICE), torch.zeros(1, 2, 65, device=DEVICE),
                     torch.zeros(1, 2, 65, device=DEVICE), EPS)
