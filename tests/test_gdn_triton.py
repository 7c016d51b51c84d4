"""Triton gated delta rule kernels against the fp32 torch references on fresh random data: small shapes under the
Triton interpreter on CPU; the same tests at once on a GPU (and real shapes in benchmarks/gdn_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sluice.kernels.gdn import reference  # noqa: E402
from sluice.kernels.gdn import triton as gt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def inputs(B, T, Hk, Hv, K, V, seed, dtype=torch.float32, decay=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(B, T, Hk, K), k=r(B, T, Hk, K), v=r(B, T, Hv, V), a=r(B, T, Hv), b=r(B, T, Hv),
             A_log=r(Hv) * 0.5 + decay, dt_bias=r(Hv) * 0.5, state=r(B, Hv, K, V) * 0.1)
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return x


def gates(x):
    g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
    return g, x["b"].float().sigmoid()


def to(x, device):
    return {n: t.to(device) for n, t in x.items()}


def run_ours(x, **kw):
    d = to(x, DEVICE)
    state = d.pop("state").clone()
    o = gt.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["a"], d["b"], state, d["A_log"],
                                            d["dt_bias"], **kw)
    return o.cpu(), state.cpu()


def run_reference(x):
    g, beta = gates(x)
    return reference.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, initial_state=x["state"],
                                                use_qk_l2norm=True)


@pytest.mark.parametrize("B,T,Hk,Hv,K,V", [(1, 1, 2, 2, 32, 32), (2, 3, 2, 4, 32, 48), (3, 2, 1, 4, 16, 24),
                                           (1, 5, 2, 4, 64, 64), (1, 1, 1, 1, 256, 256), (2, 1, 2, 4, 128, 128)])
def test_recurrent_matches_reference(B, T, Hk, Hv, K, V):
    x = inputs(B, T, Hk, Hv, K, V, seed=B * 100 + T * 10 + Hv + K)
    o, state = run_ours(x)
    ref_o, ref_state = run_reference(x)
    assert o.dtype == x["v"].dtype and o.shape == (B, T, Hv, V)
    assert rel_rms(o, ref_o) < 1e-5 and rel_rms(state, ref_state) < 1e-5


def test_recurrent_bf16_inputs():
    x = inputs(2, 4, 2, 4, 64, 64, seed=7, dtype=torch.bfloat16)
    o, state = run_ours(x)
    ref_o, ref_state = run_reference(x)  # the same bf16 inputs, computed in fp32
    assert o.dtype == torch.bfloat16
    assert rel_rms(o, ref_o) < 5e-3 and rel_rms(state, ref_state) < 5e-3


@pytest.mark.parametrize("g_value", [0.0, -30.0])
def test_recurrent_with_given_gates(g_value):
    """a = g and b = beta directly: a gate of exactly 1 (g = 0) and a decay that wipes the state (g = -30)."""
    x = inputs(2, 3, 2, 4, 32, 32, seed=11)
    g = torch.full((2, 3, 4), g_value)
    beta = x["b"].sigmoid()
    d = to(x, DEVICE)
    state = d["state"].clone()
    o = gt.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], g.to(DEVICE), beta.to(DEVICE), state)
    ref_o, ref_state = reference.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, beta,
                                                            initial_state=x["state"], use_qk_l2norm=True)
    assert rel_rms(o.cpu(), ref_o) < 1e-5 and rel_rms(state.cpu(), ref_state) < 1e-5


def test_decode_steps_chain_into_the_prefill():
    """Token-by-token decode steps after a first token equal the chunked prefill of the whole sequence."""
    x = inputs(1, 70, 2, 4, 32, 32, seed=5)
    g, beta = gates(x)
    ref_o, ref_state = reference.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, initial_state=x["state"],
                                                        use_qk_l2norm=True)
    d = to(x, DEVICE)
    state = d["state"].clone()
    outs = []
    for t in range(70):
        sl = slice(t, t + 1)
        outs.append(gt.fused_recurrent_gated_delta_rule(d["q"][:, sl], d["k"][:, sl], d["v"][:, sl], d["a"][:, sl],
                                                        d["b"][:, sl], state, d["A_log"], d["dt_bias"]).cpu())
    assert rel_rms(torch.cat(outs, 1), ref_o) < 1e-4 and rel_rms(state.cpu(), ref_state) < 1e-4


def test_state_slots_in_place_and_skipped_entries():
    x = inputs(3, 2, 2, 4, 32, 32, seed=9)
    ref_o, ref_state = run_reference(x)
    d = to(x, DEVICE)
    cache = torch.randn(6, 4, 32, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    slots = [4, -1, 1]  # sequence 1 is a padded entry
    cache[4], cache[1] = d["state"][0], d["state"][2]
    before = cache.clone()
    o = gt.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["a"], d["b"], cache, d["A_log"],
                                            d["dt_bias"], state_indices=torch.tensor(slots, dtype=torch.int32,
                                                                                     device=DEVICE))
    assert rel_rms(o[0].cpu(), ref_o[0]) < 1e-5 and rel_rms(o[2].cpu(), ref_o[2]) < 1e-5
    assert rel_rms(cache[4].cpu(), ref_state[0]) < 1e-5 and rel_rms(cache[1].cpu(), ref_state[2]) < 1e-5
    untouched = [0, 2, 3, 5]
    assert torch.equal(cache[untouched], before[untouched])


def test_views_into_a_projection():
    """q, k, v, a, b as strided views of one [B, T, C] tensor, as the layer hands them over."""
    B, T, Hk, Hv, K, V = 2, 3, 2, 4, 32, 16
    x = inputs(B, T, Hk, Hv, K, V, seed=13)
    flat = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2), x["a"], x["b"]], dim=-1).to(DEVICE)
    kd, vd = Hk * K, Hv * V
    q, k, v, a, b = flat.split([kd, kd, vd, Hv, Hv], dim=-1)
    state = x["state"].to(DEVICE).clone()
    o = gt.fused_recurrent_gated_delta_rule(q.view(B, T, Hk, K), k.view(B, T, Hk, K), v.view(B, T, Hv, V), a, b,
                                            state, x["A_log"].to(DEVICE), x["dt_bias"].to(DEVICE))
    ref_o, ref_state = run_reference(x)
    assert rel_rms(o.cpu(), ref_o) < 1e-5 and rel_rms(state.cpu(), ref_state) < 1e-5


def test_bad_inputs_raise_before_launch():
    x = to(inputs(1, 1, 2, 4, 32, 32, seed=1), DEVICE)
    args = lambda **kw: {**dict(q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], state=x["state"],  # noqa: E731
                                A_log=x["A_log"], dt_bias=x["dt_bias"]), **kw}
    f = gt.fused_recurrent_gated_delta_rule
    with pytest.raises(ValueError, match="state"):
        f(**args(state=x["state"].double()))
    with pytest.raises(ValueError, match="state"):
        f(**args(state=x["state"][:, :2]))
    with pytest.raises(ValueError, match="multiple"):
        f(**args(v=torch.randn(1, 1, 3, 32, device=DEVICE), a=x["a"][..., :3], b=x["b"][..., :3],
                 state=x["state"][:, :3].contiguous(), A_log=x["A_log"][:3], dt_bias=x["dt_bias"][:3]))
    with pytest.raises(ValueError, match="head dims"):
        big = torch.randn(1, 1, 2, 512, device=DEVICE)
        f(**args(q=big, k=big))
    with pytest.raises(ValueError, match="together"):
        f(**args(dt_bias=None))
    with pytest.raises(ValueError, match="state_indices"):
        f(**args(state_indices=torch.zeros(2, dtype=torch.int32, device=DEVICE)))


# ------------------------------------------------------------------------------------- decode + gated norm


def norm_inputs(B, T, Hv, V, seed, dtype, weight_dtype=None):
    """z (a strided view, as the layer's slice of the projection) and a norm weight near 1: random, never zero."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, Hv, 2 * V, generator=g).to(dtype)[..., V:]
    return z, (1.0 + 0.3 * torch.randn(V, generator=g)).to(weight_dtype or dtype)


def same_bits(a, b):
    """The interpreter gives the two-launch path's bits exactly. A GPU may sum the squares of a row in another
    order (the tile layouts differ between the kernels), which can move an output by an ulp or two."""
    if DEVICE == "cpu":
        return torch.equal(a, b)
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[a.dtype]
    return bool(torch.isclose(a.float(), b.float(), rtol=2 * ulp, atol=1e-30).all())


def rule_on(d, state, **kw):
    """The recurrent kernel on the device inputs d, with this state (updated in place)."""
    return gt.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["a"], d["b"], state, d["A_log"],
                                               d["dt_bias"], **kw)


def fused_and_separate(x, z, weight, eps, **kw):
    """(the fused launch's output, the two launches' output, the fused state, the two launches' state)."""
    d = to(x, DEVICE)
    z, weight = z.to(DEVICE), weight.to(DEVICE)
    fused_state, state = d["state"].clone(), d["state"].clone()
    fused = rule_on(d, fused_state, z=z, norm_weight=weight, norm_eps=eps, **kw)
    o = rule_on(d, state, **kw)
    separate = gt.gated_rms_norm(o, z, weight, eps)
    return fused.cpu(), separate.cpu(), fused_state.cpu(), state.cpu()


@pytest.mark.parametrize("B,T,Hk,Hv,K,V,block_v,dtype,weight_dtype", [
    (1, 1, 2, 4, 16, 32, 32, torch.float32, None),  # one program per head: normalised in registers
    (1, 1, 2, 4, 16, 32, 8, torch.float32, None),  # four programs per head: the last one normalises
    (3, 2, 1, 2, 16, 24, 8, torch.bfloat16, None),  # V not a power of two, three blocks, the last partly masked
    (3, 1, 2, 2, 16, 24, 32, torch.bfloat16, torch.float32),  # w * normed rounded in fp32, then bf16
    (2, 1, 1, 2, 16, 16, 16, torch.float16, None)])
def test_recurrent_with_gated_norm(B, T, Hk, Hv, K, V, block_v, dtype, weight_dtype):
    """The gated norm fused into the recurrent launch: the bits of the recurrent kernel followed by
    `gated_rms_norm`, close to the torch references, the same state."""
    from sluice.kernels.norm.reference import gated_rms_norm

    x = inputs(B, T, Hk, Hv, K, V, seed=B * 100 + T * 10 + V + block_v, dtype=dtype)
    z, weight = norm_inputs(B, T, Hv, V, seed=block_v, dtype=dtype, weight_dtype=weight_dtype)
    fused, separate, fused_state, state = fused_and_separate(x, z, weight, 1e-6, block_v=block_v)
    assert fused.dtype == dtype and fused.shape == (B, T, Hv, V)
    assert same_bits(fused, separate) and same_bits(fused_state, state)
    ref_o, _ = run_reference(x)
    ref = gated_rms_norm(ref_o.to(dtype), z, weight, 1e-6)
    # bf16: the interpreter truncates o to bf16 where torch rounds to nearest
    assert rel_rms(fused, ref) < {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("block_v", [8, 32])
def test_recurrent_gated_norm_slots_and_repeated_calls(block_v):
    """State slots, a skipped entry (its output unwritten, its counters untouched) and three launches in a row:
    the last program of each head resets its counter, so every launch equals the two-launch path."""
    B, T, Hk, Hv, K, V = 3, 1, 1, 2, 16, 32
    cache = torch.randn(5, Hv, K, V, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE)
    separate_cache = cache.clone()
    for step in range(3):
        x = to(inputs(B, T, Hk, Hv, K, V, seed=60 + step), DEVICE)
        z, weight = (t.to(DEVICE) for t in norm_inputs(B, T, Hv, V, seed=step, dtype=torch.float32))
        fused = rule_on(x, cache, state_indices=slots, z=z, norm_weight=weight, norm_eps=1e-6, block_v=block_v)
        o = rule_on(x, separate_cache, state_indices=slots, block_v=block_v)
        separate = gt.gated_rms_norm(o[[0, 2]], z[[0, 2]], weight, 1e-6)  # the skipped entry's o is unwritten
        assert same_bits(fused[[0, 2]].cpu(), separate.cpu()) and same_bits(cache.cpu(), separate_cache.cpu())
    assert not gt._head_counters(B * Hv, cache.device).any()


def test_gated_norm_bad_inputs():
    x = to(inputs(1, 1, 2, 4, 16, 16, seed=1), DEVICE)
    z, weight = (t.to(DEVICE) for t in norm_inputs(1, 1, 4, 16, seed=1, dtype=torch.float32))
    with pytest.raises(ValueError, match="together"):
        rule_on(x, x["state"], z=z)
    with pytest.raises(ValueError, match="z must"):
        rule_on(x, x["state"], z=z[:, :, :2], norm_weight=weight)
    with pytest.raises(ValueError, match="norm_weight must"):
        rule_on(x, x["state"], z=z, norm_weight=weight[:8])


# ---------------------------------------------------------------------------------------------------- prefill


def run_chunk(x, **kw):
    d = to(x, DEVICE)
    state = d.pop("state").clone()
    o = gt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["a"], d["b"], state, d["A_log"], d["dt_bias"], **kw)
    return o.cpu(), state.cpu()


@pytest.mark.parametrize("B,T,Hk,Hv,K,V", [(1, 1, 2, 2, 32, 32), (1, 63, 1, 2, 32, 32), (2, 64, 2, 4, 32, 16),
                                           (1, 65, 1, 4, 16, 32), (1, 130, 2, 2, 64, 64), (1, 20, 1, 1, 256, 256)])
def test_chunk_matches_reference(B, T, Hk, Hv, K, V):
    x = inputs(B, T, Hk, Hv, K, V, seed=T * 7 + Hv + K)
    o, state = run_chunk(x)
    ref_o, ref_state = run_reference(x)
    assert o.shape == (B, T, Hv, V) and o.dtype == x["v"].dtype
    assert rel_rms(o, ref_o) < 1e-4 and rel_rms(state, ref_state) < 1e-4


@pytest.mark.parametrize("g_value", [0.0, -20.0])
def test_chunk_with_given_gates(g_value):
    """Gate exactly 1 everywhere (nothing decays: the state only grows) and a decay that wipes it every token."""
    x = inputs(1, 70, 1, 2, 32, 32, seed=3)
    g = torch.full((1, 70, 2), g_value)
    beta = x["b"].sigmoid()
    d = to(x, DEVICE)
    state = d["state"].clone()
    o = gt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], g.to(DEVICE), beta.to(DEVICE), state)
    ref_o, ref_state = reference.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, beta,
                                                            initial_state=x["state"], use_qk_l2norm=True)
    assert rel_rms(o.cpu(), ref_o) < 1e-4 and rel_rms(state.cpu(), ref_state) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_half_inputs(dtype):
    """w, u, v_new and the chunk states are held in the inputs' dtype (as FLA does). The Triton interpreter
    truncates fp32 -> bf16 stores where a GPU rounds to nearest (~3x the error): 1e-2 there, 5e-3 on a GPU."""
    x = inputs(1, 100, 2, 4, 64, 64, seed=17, dtype=dtype)
    o, state = run_chunk(x)
    ref_o, ref_state = run_reference(x)
    bound = 1e-2 if dtype == torch.bfloat16 and DEVICE == "cpu" else 5e-3
    assert rel_rms(o, ref_o) < bound and rel_rms(state, ref_state) < bound


@pytest.mark.parametrize("cu_on_device", [False, True])
def test_packed_sequences_equal_separate_runs(cu_on_device):
    """cu_seqlens from the host (checked, copied once) or already on the device (chunks found in-kernel)."""
    lens = [1, 70, 0, 64, 5]
    Hk, Hv, K, V = 1, 2, 32, 32
    parts = [inputs(1, n, Hk, Hv, K, V, seed=40 + i) for i, n in enumerate(lens)]
    packed = {n: torch.cat([p[n] for p in parts], dim=1) for n in ("q", "k", "v", "a", "b")}
    packed.update(A_log=parts[0]["A_log"], dt_bias=parts[0]["dt_bias"])
    cache = torch.randn(8, Hv, K, V, generator=torch.Generator().manual_seed(2))
    slots = [6, 0, 3, 1, 7]
    for p, s in zip(parts, slots):
        p.update(A_log=packed["A_log"], dt_bias=packed["dt_bias"], state=cache[s].clone()[None])
    d = to(packed, DEVICE)
    cache_d = cache.to(DEVICE).clone()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    o = gt.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["a"], d["b"], cache_d, d["A_log"], d["dt_bias"],
                                  state_indices=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                                  cu_seqlens=torch.tensor(cu, device=DEVICE) if cu_on_device else cu).cpu()
    for i, p in enumerate(parts):
        ref_o, ref_state = run_reference(p)
        if lens[i]:
            assert rel_rms(o[:, cu[i]:cu[i + 1]], ref_o) < 1e-4
        assert rel_rms(cache_d[slots[i]].cpu(), ref_state[0]) < 1e-4
    assert torch.equal(cache_d[[2, 4, 5]].cpu(), cache[[2, 4, 5]])


def test_chunk_prefill_then_decode_steps():
    """Prefill of 65 tokens by chunks, then decode steps: equal to the reference over the whole sequence."""
    x = inputs(1, 68, 2, 4, 32, 32, seed=21)
    ref_o, ref_state = run_reference(x)
    d = to(x, DEVICE)
    state = d["state"].clone()
    sl = slice(0, 65)
    outs = [gt.chunk_gated_delta_rule(d["q"][:, sl], d["k"][:, sl], d["v"][:, sl], d["a"][:, sl], d["b"][:, sl],
                                      state, d["A_log"], d["dt_bias"]).cpu()]
    for t in range(65, 68):
        sl = slice(t, t + 1)
        outs.append(gt.fused_recurrent_gated_delta_rule(d["q"][:, sl], d["k"][:, sl], d["v"][:, sl], d["a"][:, sl],
                                                        d["b"][:, sl], state, d["A_log"], d["dt_bias"]).cpu())
    assert rel_rms(torch.cat(outs, 1), ref_o) < 1e-4 and rel_rms(state.cpu(), ref_state) < 1e-4


def test_chunk_bad_cu_seqlens():
    x = to(inputs(1, 10, 1, 2, 16, 16, seed=1), DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gt.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["state"], x["A_log"], x["dt_bias"],
                                  cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="slots"):
        gt.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["state"], x["A_log"], x["dt_bias"],
                                  cu_seqlens=[0, 4, 10])


@pytest.mark.parametrize("static", [False, True])
def test_flat_step_kernels_match_each_sequence_alone(static):
    """A flat step (`engine/batch.py`: decode tokens first, then prompt chunks, then padding) through a Gated DeltaNet
    layer's kernels (one conv launch for every segment, the recurrent kernel for the decodes, the chunked one for the
    chunks; static: over all the tokens and every padded table): each sequence's output and states as the references
    give it alone; the padding's output is zero."""
    from sluice.cache.pool import CachePool, RecurrentStates
    from sluice.engine.batch import FlatBatch
    from sluice.layers.gated_deltanet import GatedDeltaNet

    nk, nv, dk, dv, W = 2, 4, 16, 16, 4
    C = 2 * nk * dk + nv * dv
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layer = GatedDeltaNet(None, r(C, W) * 0.5, r(nv) * 0.5, r(nv) * 0.5, r(dv), None, nk, nv, dk, dv, 1e-6, 0)
    layer = layer.to(DEVICE)
    decodes, chunks = [(0, 9), (2, 30)], [(1, [0] * 20, 0), (3, [0] * 70, 5)]  # 70: more than one 64-token chunk
    batch = FlatBatch(decodes, chunks, 128, n_pad=100, r_pad=6, static=static, pad_row=5)
    _, meta = batch.place(torch.zeros(FlatBatch.size(100, 6), dtype=torch.long, device=DEVICE))
    mixed, b, a = r(1, 100, C).to(DEVICE), r(1, 100, nv).to(DEVICE), r(1, 100, nv).to(DEVICE)
    outs = {}
    for name, kernels in (("kernels", gt), ("reference", None)):
        g.manual_seed(6)
        pool = CachePool(None, RecurrentStates(1, 6, C, W, nv, dk, dv, torch.float32, DEVICE), 5)
        pool.states.conv.copy_(r(*pool.states.conv.shape))
        pool.states.recurrent.copy_(r(*pool.states.recurrent.shape) * 0.1)
        o = pool.mix(lambda m, *t: layer._mix_flat(kernels, pool, m, *t), meta, mixed, b, a)
        outs[name] = (o.cpu(), pool.states.conv.cpu(), pool.states.recurrent.cpu())
    (o, conv, state), (ref_o, ref_conv, ref_state) = outs["kernels"], outs["reference"]
    assert o.shape == (1, 100, nv, dv) and not o[:, batch.n:].any()
    assert rel_rms(o, ref_o) < 1e-4
    assert rel_rms(conv, ref_conv) < 1e-6 and rel_rms(state, ref_state) < 1e-4
