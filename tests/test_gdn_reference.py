"""Gated delta rule references: recurrent == chunked (WY form), both == HF's recurrent oracle; conv1d state."""

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels.conv1d.reference import causal_conv1d
from sluice.kernels.gdn.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def inputs(B, T, Hk, Hv, K, V, dtype, seed, gate="normal"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, Hk, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, Hv, V, generator=g, dtype=dtype)
    a = torch.randn(B, T, Hv, generator=g, dtype=dtype)
    A_log = torch.rand(Hv, generator=g, dtype=dtype) * 2
    gates = -A_log.exp() * F.softplus(a + 1.0)  # as the model computes them
    if gate == "strong":  # decay near its floor: exp(g) ~ 1e-9 .. 1e-22
        gates = -20 - 30 * torch.rand(B, T, Hv, generator=g, dtype=dtype)
    elif gate == "one":  # exp(g) exactly 1 and beta exactly 1
        gates = torch.zeros(B, T, Hv, dtype=dtype)
    beta = torch.ones(B, T, Hv, dtype=dtype) if gate == "one" else torch.rand(B, T, Hv, generator=g, dtype=dtype)
    state = torch.randn(B, Hv, K, V, generator=g, dtype=dtype) * 0.1
    return q, k, v, gates, beta, state


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("gate", ["normal", "strong", "one"])
def test_chunked_equals_recurrent(dtype, tol, T, ratio, gate):
    q, k, v, g, beta, s0 = inputs(2, T, 2, 2 * ratio, 16, 24, dtype, seed=T * 10 + ratio, gate=gate)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    assert o_c.dtype == dtype and o_c.shape == v.shape and s_c.shape == s0.shape
    assert rel_err(o_c, o_r) < tol
    assert rel_err(s_c, s_r) < tol


def test_small_chunk_size_and_no_initial_state():
    q, k, v, g, beta, _ = inputs(1, 37, 1, 2, 8, 8, torch.float64, seed=3)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    assert rel_err(o_c, o_r) < 1e-10 and rel_err(s_c, s_r) < 1e-10


def test_recurrent_matches_hf_oracle():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = inputs(2, 45, 2, 4, 32, 16, torch.float32, seed=11)
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    assert rel_err(o, o_hf) < 1e-6 and rel_err(s, s_hf) < 1e-6


def test_state_carries_across_calls():
    """Prefill in two pieces (state out -> state in) equals one call over the whole sequence."""
    q, k, v, g, beta, s0 = inputs(1, 100, 2, 4, 16, 16, torch.float64, seed=5)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    o1, s1 = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], initial_state=s0,
                                    use_qk_l2norm=True)
    o2, s2 = recurrent_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], initial_state=s1,
                                        use_qk_l2norm=True)
    assert rel_err(torch.cat([o1, o2], 1), o_all) < 1e-10 and rel_err(s2, s_all) < 1e-10


def test_bad_shapes_are_errors():
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 3, 8, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="multiple"):
        recurrent_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, s0 = inputs(1, 5, 2, 4, 8, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="initial state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0[:, :2])


@pytest.mark.parametrize("T", [1, 3, 17])
def test_causal_conv1d_matches_padded_conv_and_carries_state(T):
    g = torch.Generator().manual_seed(T)
    B, C, W = 2, 12, 4
    x = torch.randn(B, T + 9, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], groups=C, padding=W - 1)[..., : T + 9]).transpose(1, 2)
    y_all, s_all = causal_conv1d(x, w)
    assert rel_err(y_all, ref) < 1e-12
    y1, s1 = causal_conv1d(x[:, :T], w)
    y2, s2 = causal_conv1d(x[:, T:], w, state=s1)
    assert rel_err(torch.cat([y1, y2], 1), ref) < 1e-12 and torch.equal(s2, s_all)
    assert torch.equal(s_all, x[:, -(W - 1):].transpose(1, 2))
