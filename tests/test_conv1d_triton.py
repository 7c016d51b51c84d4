"""Triton causal depthwise conv1d (prefill and decode update) against `conv1d.reference` on fresh random data:
tiny shapes under the Triton interpreter on CPU, the same tests on a GPU.

fp32 outputs agree to ~1e-7 relative; bf16 ones are compared with the reference run on the same bf16 inputs (one
rounding of the fp32 sum; the interpreter truncates instead of rounding to nearest, ~4e-3). States are copies of
inputs, so they must match exactly."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.conv1d import reference  # noqa: E402
from sluice.kernels.conv1d import triton as ct  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def rand(g, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def make(seed, B, T, C, W, dtype, with_state=True):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, B, T, C, dtype=dtype)
    w = rand(g, C, W, dtype=dtype, scale=0.5)
    state = rand(g, B, C, W - 1, dtype=dtype) if with_state else None
    return x, w, state


def dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def check(y, new_state, y_ref, state_ref, dtype):
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert rel_err(y.cpu(), y_ref) <= TOL[dtype]
    torch.testing.assert_close(new_state.cpu(), state_ref, rtol=0, atol=0)


SHAPES = [(2, 1, 40, 4), (3, 2, 72, 4), (1, 63, 200, 4), (2, 64, 130, 4), (2, 65, 96, 4), (1, 130, 200, 4),
          (2, 5, 33, 2), (2, 9, 50, 8), (1, 3, 17, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("B,T,C,W", SHAPES)
def test_prefill_matches_reference(B, T, C, W, with_state, dtype):
    x, w, state = make(1000 * T + C + W, B, T, C, W, dtype, with_state)
    y_ref, state_ref = reference.causal_conv1d(x, w, state)
    xd, wd, sd = dev(x, w, None if state is None else state.clone())
    y, new_state = ct.causal_conv1d(xd, wd, sd)
    check(y, new_state, y_ref, state_ref, dtype)
    if state is not None:
        assert torch.equal(sd.cpu(), state)  # no state_indices: the new state is a new tensor


@pytest.mark.parametrize("block_t,block_c", [(16, 32), (32, 64)])
def test_prefill_several_channel_blocks(block_t, block_c):
    """C = 200 over blocks of 32 / 64 channels (the last one ragged), and several body tiles per sequence."""
    x, w, state = make(77, 2, 65, 200, 4, torch.float32)
    y_ref, state_ref = reference.causal_conv1d(x, w, state)
    y, new_state = ct.causal_conv1d(*dev(x, w, state), block_t=block_t, block_c=block_c)
    check(y, new_state, y_ref, state_ref, torch.float32)


def test_prefill_no_activation_strided_inputs():
    """x a column slice of a wider projection output, state a transposed view: read through their strides."""
    g = torch.Generator().manual_seed(7)
    B, T, C, W = 2, 37, 100, 4
    proj = rand(g, B, T, C + 30)
    x = proj[..., 10:10 + C]
    state = rand(g, B, W - 1, C).transpose(1, 2)  # [B, C, W-1] with stride 1 along C
    w = rand(g, W, C, scale=0.5).t()  # [C, W], non-contiguous
    y_ref, state_ref = reference.causal_conv1d(x, w, state, activation=None)
    xd, wd, sd = dev(proj, w, state)
    y, new_state = ct.causal_conv1d(xd[..., 10:10 + C], wd, sd, activation=None)
    check(y, new_state, y_ref, state_ref, torch.float32)


def ref_conv(x, w, state, activation="silu"):
    """The reference, which fails on T = 0 (F.conv1d's input shorter than its kernel): there the state passes."""
    if x.shape[1] == 0:
        B, _, C = x.shape
        s = x.new_zeros(B, C, w.shape[1] - 1) if state is None else state.to(x.dtype).clone()
        return x.clone(), s
    return reference.causal_conv1d(x, w, state, activation)


def test_empty_prefill_keeps_state():
    x, w, state = make(2, 2, 0, 24, 4, torch.float32)
    y, new_state = ct.causal_conv1d(*dev(x, w, state))
    assert y.shape == (2, 0, 24)
    torch.testing.assert_close(new_state.cpu(), state, rtol=0, atol=0)


def _split_reference(x, w, state, lens):
    ys, states, t = [], [], 0
    for i, n in enumerate(lens):
        y, s = ref_conv(x[:, t:t + n], w, None if state is None else state[i:i + 1])
        ys.append(y)
        states.append(s)
        t += n
    return torch.cat(ys, dim=1), torch.cat(states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_packed_sequences_match_separate_runs(with_state, dtype, cu_dtype):
    lens = [5, 1, 0, 70, 2, 64, 3]  # an empty sequence, ones shorter than W-1, ones crossing tile boundaries
    C, W = 72, 4
    g = torch.Generator().manual_seed(11 + with_state)
    x = rand(g, 1, sum(lens), C, dtype=dtype)
    w = rand(g, C, W, dtype=dtype, scale=0.5)
    state = rand(g, len(lens), C, W - 1, dtype=dtype) if with_state else None
    y_ref, state_ref = _split_reference(x, w, state, lens)
    cu = torch.tensor([0] + lens, dtype=cu_dtype).cumsum(0).to(cu_dtype)
    y, new_state = ct.causal_conv1d(*dev(x, w, state), cu_seqlens=cu.to(DEVICE), block_c=32)
    check(y, new_state, y_ref, state_ref, dtype)


def test_more_sequences_than_the_minimum_search_covers():
    """The binary search over the sequences' starts takes at least `LOG_N_MIN` steps (one compiled kernel for any
    number of sequences up to 2^LOG_N_MIN); past that it takes more: 150 sequences of 0-4 tokens."""
    lens = [(7 * i) % 5 for i in range(150)]
    assert len(lens) > 2 ** ct.LOG_N_MIN
    C, W = 24, 4
    g = torch.Generator().manual_seed(5)
    x = rand(g, 1, sum(lens), C)
    w = rand(g, C, W, scale=0.5)
    y_ref, state_ref = _split_reference(x, w, None, lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(DEVICE)
    y, new_state = ct.causal_conv1d(*dev(x, w), cu_seqlens=cu, block_c=32)
    check(y, new_state, y_ref, state_ref, torch.float32)


def test_packed_sequences_state_cache_in_place():
    lens = [2, 40, 1, 67]
    C, W, slots = 50, 4, 7
    idx = [5, -1, 0, 3]
    g = torch.Generator().manual_seed(3)
    x = rand(g, 1, sum(lens), C)
    w = rand(g, C, W, scale=0.5)
    cache = rand(g, slots, C, W - 1)
    per_seq = torch.stack([cache[i] if i >= 0 else torch.zeros(C, W - 1) for i in idx])
    y_ref, state_ref = _split_reference(x, w, per_seq, lens)
    cache_d = cache.to(DEVICE)
    cu = torch.tensor([0] + lens).cumsum(0).to(DEVICE)
    y, new_state = ct.causal_conv1d(*dev(x, w), cache_d, cu_seqlens=cu,
                                    state_indices=torch.tensor(idx, dtype=torch.int32, device=DEVICE))
    assert new_state is cache_d
    assert rel_err(y.cpu(), y_ref) <= 1e-5  # the skipped sequence: convolved from a zero state
    expect = cache.clone()
    for i, slot in enumerate(idx):
        if slot >= 0:
            expect[slot] = state_ref[i]
    torch.testing.assert_close(cache_d.cpu(), expect, rtol=0, atol=0)  # other slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_state_cache_in_place(dtype):
    B, T, C, W, slots = 3, 6, 40, 4, 5
    idx = [4, -1, 1]
    x, w, _ = make(5, B, T, C, W, dtype)
    cache = rand(torch.Generator().manual_seed(6), slots, C, W - 1, dtype=dtype)
    per_seq = torch.stack([cache[i] if i >= 0 else torch.zeros(C, W - 1, dtype=dtype) for i in idx])
    y_ref, state_ref = reference.causal_conv1d(x, w, per_seq)
    cache_d = cache.to(DEVICE)
    y, new_state = ct.causal_conv1d(*dev(x, w), cache_d,
                                    state_indices=torch.tensor(idx, dtype=torch.int32, device=DEVICE))
    assert new_state is cache_d
    assert rel_err(y.cpu(), y_ref) <= TOL[dtype]
    expect = cache.clone()
    expect[4], expect[1] = state_ref[0], state_ref[2]
    torch.testing.assert_close(cache_d.cpu(), expect, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [2, 4, 8])
def test_decode_after_prefill_equals_whole_prefill(W, dtype):
    B, T0, steps, C = 2, 5, 6, 90
    x, w, state = make(20 + W, B, T0 + steps, C, W, dtype)
    y_ref, state_ref = reference.causal_conv1d(x, w, state)
    xd, wd, sd = dev(x, w, state)
    y0, conv_state = ct.causal_conv1d(xd[:, :T0], wd, sd)
    ys = [y0]
    for t in range(T0, T0 + steps):
        ys.append(ct.causal_conv1d_update(xd[:, t], wd, conv_state, block_c=32)[:, None])
    check(torch.cat(ys, dim=1), conv_state, y_ref, state_ref, dtype)


def test_decode_state_indices_skip():
    B, C, W, slots = 3, 70, 4, 6
    idx = [2, -1, 5]
    g = torch.Generator().manual_seed(9)
    x = rand(g, B, C)
    w = rand(g, C, W, scale=0.5)
    cache = rand(g, slots, C, W - 1)
    per_seq = torch.stack([cache[i] if i >= 0 else torch.zeros(C, W - 1) for i in idx])
    y_ref, state_ref = reference.causal_conv1d(x[:, None], w, per_seq)
    cache_d = cache.to(DEVICE)
    y = ct.causal_conv1d_update(*dev(x, w), cache_d, torch.tensor(idx, dtype=torch.int32, device=DEVICE))
    assert rel_err(y.cpu(), y_ref[:, 0]) <= 1e-5
    expect = cache.clone()
    expect[2], expect[5] = state_ref[0], state_ref[2]
    torch.testing.assert_close(cache_d.cpu(), expect, rtol=0, atol=0)


def test_bad_inputs_raise():
    B, T, C, W = 2, 5, 16, 4
    x, w, state = dev(*make(0, B, T, C, W, torch.float32))
    i32 = dict(dtype=torch.int32, device=DEVICE)
    bad_prefill = [
        dict(x=x[0], weight=w),                                   # x not [B, T, C]
        dict(x=x.to(torch.int32), weight=w),                      # x dtype
        dict(x=x, weight=w[:-1]),                                 # weight not [C, W]
        dict(x=x, weight=w[:, 0]),
        dict(x=x, weight=torch.randn(C, 1, device=DEVICE)),       # W out of range
        dict(x=x, weight=torch.randn(C, 9, device=DEVICE)),
        dict(x=x, weight=w, state=state[:, :, :2]),               # state [B, C, W-2]
        dict(x=x, weight=w, state=state[:1]),                     # state for one sequence
        dict(x=x, weight=w, state=state.to(torch.int32)),
        dict(x=x, weight=w, activation="relu"),
        dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 5, 10], **i32)),      # packed x must be [1, T, C]
        dict(x=x[:1], weight=w, cu_seqlens=torch.tensor([0.0, 5.0], device=DEVICE)),
        dict(x=x, weight=w, state=state, state_indices=torch.tensor([0], **i32)),
        dict(x=x, weight=w, state_indices=torch.tensor([0, 1], **i32)),    # indices without a cache
        dict(x=x, weight=w, state=state[:, :-1], state_indices=torch.tensor([0, 1], **i32)),
    ]
    for kwargs in bad_prefill:
        with pytest.raises(ValueError):
            ct.causal_conv1d(**kwargs)
    conv_state = state.clone()
    bad_update = [
        dict(x=x, weight=w, conv_state=conv_state),                          # x not [B, C]
        dict(x=x[:, 0], weight=w, conv_state=conv_state[:, :-1]),
        dict(x=x[:, 0], weight=w, conv_state=conv_state[:1]),                 # B slots without indices
        dict(x=x[:, 0], weight=w[:, :1], conv_state=conv_state[..., :0]),
        dict(x=x[:, 0], weight=w, conv_state=conv_state, state_indices=torch.tensor([0], **i32)),
        dict(x=x[:, 0], weight=w, conv_state=conv_state, activation="gelu"),
    ]
    for kwargs in bad_update:
        with pytest.raises(ValueError):
            ct.causal_conv1d_update(**kwargs)
    if DEVICE == "cuda":
        with pytest.raises(ValueError):
            ct.causal_conv1d(x, w.cpu())
