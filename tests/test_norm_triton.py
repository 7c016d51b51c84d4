"""Triton gated RMSNorm (GDN output norm) against `norm.reference.gated_rms_norm` on fresh random data: under
the Triton interpreter on CPU, the same tests on a GPU.

The kernel rounds where the reference rounds, so in bf16/fp16 nearly every element is bit-identical (the rest
differ by one ulp, where fp32 rsqrt/sigmoid last-bit differences straddle a rounding boundary)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.norm import reference  # noqa: E402
from sluice.kernels.norm import triton as nt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def rand(g, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def check(y, x, z, w):
    y_ref = reference.gated_rms_norm(x, z, w, EPS)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape and y.is_contiguous()
    y = y.cpu()
    if x.dtype == torch.float32:
        assert rel_err(y, y_ref) <= 1e-5
    else:
        assert rel_err(y, y_ref) <= 1e-2
        assert (y == y_ref).float().mean() >= 0.99  # same rounding points


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
def test_matches_reference_with_strided_z(D, dtype):
    """x [B, T, heads, D]; z a slice of a wider projection output reshaped to heads, as in the GDN layer."""
    g = torch.Generator().manual_seed(D)
    B, T, H = 2, 7, 5  # 70 rows: not a multiple of the row block
    x = rand(g, B, T, H, D, dtype=dtype)
    proj = rand(g, B, T, 2 * H * D + 24, dtype=dtype)
    z = proj[..., 24 + H * D:].reshape(B, T, H, D)
    w = rand(g, D, dtype=dtype, scale=0.2) + 1
    xd, projd, wd = (t.to(DEVICE) for t in (x, proj, w))
    zd = projd[..., 24 + H * D:].reshape(B, T, H, D)
    assert not zd.is_contiguous() and zd.data_ptr() == projd.data_ptr() + (24 + H * D) * proj.element_size()
    check(nt.gated_rms_norm(xd, zd, wd, EPS), x, z, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_weight_and_other_layouts(dtype):
    """An fp32 weight (w * norm is then fp32, not x's dtype), 2-D and 1-D inputs, a non-contiguous x."""
    g = torch.Generator().manual_seed(1)
    D = 128
    w = rand(g, D, scale=0.2) + 1
    x2 = rand(g, 37, D, dtype=dtype)
    z2 = rand(g, 37, D, dtype=dtype)
    check(nt.gated_rms_norm(x2.to(DEVICE), z2.to(DEVICE), w.to(DEVICE), EPS), x2, z2, w)
    x1, z1 = x2[3], z2[4]
    check(nt.gated_rms_norm(x1.to(DEVICE), z1.to(DEVICE), w.to(DEVICE), EPS), x1, z1, w)
    big = rand(g, 3, 40, 6, D, dtype=dtype)  # x = every other head, rows of two strides
    x4, z4 = big[:, :, ::2], big[:, :, 1::2]
    bigd = big.to(DEVICE)
    check(nt.gated_rms_norm(bigd[:, :, ::2], bigd[:, :, 1::2], w.to(dtype).to(DEVICE), EPS), x4, z4, w.to(dtype))


def test_large_rows_and_eps():
    """Rows of very different scales (the eps matters for the small ones)."""
    g = torch.Generator().manual_seed(2)
    x = rand(g, 50, 4, 128) * torch.logspace(-4, 3, 50)[:, None, None]
    z = rand(g, 50, 4, 128)
    w = rand(g, 128, scale=0.2) + 1
    y = nt.gated_rms_norm(x.to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-5)
    assert rel_err(y.cpu(), reference.gated_rms_norm(x, z, w, 1e-5)) <= 1e-5


def test_bad_inputs_raise():
    x = torch.randn(4, 3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    bad = [
        (x, x[..., :32], w),                              # z shape
        (x, x, torch.ones(63, device=DEVICE)),            # weight length
        (x, x, torch.ones(1, 64, device=DEVICE)),         # weight not 1-D
        (x.to(torch.int32), x, w),                        # x dtype
        (x, x.to(torch.float64), w),                      # z dtype
        (x, x, w.to(torch.int32)),                        # weight dtype
        (torch.randn(2, 9000, device=DEVICE), torch.randn(2, 9000, device=DEVICE), torch.ones(9000, device=DEVICE)),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            nt.gated_rms_norm(*args, EPS)
    if DEVICE == "cuda":
        with pytest.raises(ValueError):
            nt.gated_rms_norm(x, x, w.cpu(), EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 96), (2, 1, 4, 256)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_residual_add_and_norm(shape, dtype, with_delta):
    """The decoder block's residual add and next input norm in one launch: s = h + delta exactly as torch adds
    (bit-identical), y = rms_norm_fp32_scale(s) to the last ulp almost everywhere."""
    g = torch.Generator().manual_seed(sum(shape) + with_delta)
    h = rand(g, *shape, dtype=dtype, scale=3.0)
    wide = rand(g, *shape[:-1], 2 * shape[-1], dtype=dtype)
    delta = wide[..., shape[-1]:]  # a strided view
    w = rand(g, shape[-1]) * 0.5 + 1.0
    s, y = nt.add_rms_norm(h.to(DEVICE), delta.to(DEVICE) if with_delta else None, w.to(DEVICE), EPS)
    s_ref = h + delta if with_delta else h
    y_ref = reference.rms_norm_fp32_scale(s_ref, w, EPS)
    assert torch.equal(s.cpu(), s_ref)
    assert y.dtype == dtype and y.shape == h.shape
    if dtype == torch.float32:
        assert rel_err(y.cpu(), y_ref) <= 1e-6
    else:
        assert rel_err(y.cpu(), y_ref) <= 1e-2 and (y.cpu() == y_ref).float().mean() >= 0.99


def test_add_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="h \\(and delta"):
        nt.add_rms_norm(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 4, device=DEVICE),
                        torch.ones(8, device=DEVICE), EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, k, splits, shared", [(1, 11, 1, False), (3, 4, 2, True), (37, 2, 1, True)])
def test_add_rms_norm_sums_unsummed_expert_outputs(tokens, k, splits, shared, dtype):
    """An MoE block's outputs handed over unsummed (`ExpertOutputs`) give the bits of `combine` then the add and norm:
    the sum runs in the same device function. (The interpreter truncates bf16 casts where a GPU rounds, so bf16 is
    checked on a GPU only.)"""
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("the Triton interpreter truncates bf16 casts")
    from sluice.kernels.moe import ExpertOutputs

    H = 96
    g = torch.Generator().manual_seed(tokens * 100 + k)
    h = rand(g, 1, tokens, H, dtype=dtype, scale=3.0).to(DEVICE)
    y = rand(g, splits, tokens * k, H).to(DEVICE)
    weights = torch.rand(tokens, k, generator=g).to(DEVICE)
    shared_out = rand(g, tokens, H, dtype=dtype).to(DEVICE) if shared else None
    gate = rand(g, tokens).to(DEVICE) if shared else None
    w = (rand(g, H) * 0.5 + 1.0).to(DEVICE)
    experts = ExpertOutputs(y, weights, dtype, shared_out, gate)
    s, out = nt.add_rms_norm(h, experts, w, EPS)
    s_ref, out_ref = nt.add_rms_norm(h, experts.combine().view(h.shape), w, EPS)
    assert torch.equal(s, s_ref) and torch.equal(out, out_ref)
    ref = sum(weights[:, j, None] * y.sum(0)[j::k] for j in range(k))
    if shared:
        ref = ref + torch.sigmoid(gate)[:, None] * shared_out.float()
    assert rel_err(s.view(tokens, H).float() - h.view(tokens, H).float(), ref) <= 1e-2
    with pytest.raises(ValueError, match="expert outputs"):
        nt.add_rms_norm(h[..., :48], experts, w[:48], EPS)
    with pytest.raises(ValueError, match="y must be"):  # rows of fewer tokens than the weights say
        ExpertOutputs(y[:, :-1], weights, dtype)
    with pytest.raises(ValueError, match="weights must be"):
        ExpertOutputs(y, weights.double(), dtype)
