"""The DeepSeek decode chain's fused kernels (`kernels/mla/fused.py`, dispatched by `kernels/mla/chain.py`) against
their torch oracles, and the layers through them against the paths they replace: the residual add + Llama RMSNorm
(a tensor, GEMV partials, MoE expert outputs), the MLA input (latent norm, RoPE, cache store whole or paged, W_UK
fold), W_UV into o_proj's layout, the shared-expert slot, the shared experts / dense MLP in two GEMVs, the MoE block
with its shared experts riding in `ExpertOutputs` (two shared experts as two expert slots too); and a model's
decode steps with every fused kernel on against the GPU path before them (the split-K kernel fed by the torch glue),
and a 4-bit model's with two shared experts as expert slots against its reference path. Under the Triton
interpreter on the CPU (tiny shapes), at once on a GPU."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.mla import chain, fused  # noqa: E402
from sluice.kernels.norm.reference import rms_norm  # noqa: E402
from sluice.kernels.rope.reference import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from helpers import rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.slow if DEVICE == "cpu" else []  # interpreted: as the kernel modules in conftest.INTERPRETED
DTYPES = [torch.float32, torch.bfloat16]


def exact(dtype):
    """The interpreter rounds where torch rounds: equal bits up to a different fp32 summation order (fp32 ulps; a
    bf16 value a rounding boundary away, rarely). On a GPU: rsqrt, sums and tensor cores differ more."""
    if DEVICE == "cpu":
        return 1e-6 if dtype == torch.float32 else 1e-2
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "tensor", "partials", "experts"])
def test_add_rms_norm(dtype, kind):
    from sluice.kernels.moe import ExpertOutputs

    g = torch.Generator().manual_seed(1)
    T, D = 5, 96
    h = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(D, generator=g) * 0.2 + 1).to(dtype).to(DEVICE)
    if kind == "none":
        delta, want_s = None, h
    elif kind == "tensor":
        delta = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
        want_s = h + delta
    elif kind == "partials":
        p = torch.randn(3, T, D, generator=g).to(DEVICE)
        delta = chain.Partials(p, dtype)
        want_s = h + p.sum(0).to(dtype).view(h.shape)
    else:
        y = torch.randn(2, T * 3, D, generator=g).to(DEVICE)
        shared = torch.randn(T, D, generator=g).to(dtype).to(DEVICE)
        gate = torch.full((1,), float("inf"), device=DEVICE).expand(T)  # the DeepSeek shared experts' weight 1
        delta = ExpertOutputs(y, torch.rand(T, 3, generator=g).to(DEVICE), dtype, shared, gate)
        want_s = h + delta.combine().view(h.shape)
    s, out, out32 = fused.add_rms_norm(h, delta, w, 1e-5, out32=True)
    want = rms_norm(want_s, w, 1e-5)
    assert s.dtype == dtype and out.dtype == dtype and out32.dtype == torch.float32
    assert rel(s, want_s) < exact(dtype) and rel(out, want) < exact(dtype)
    assert torch.equal(out32, out.float())
    if kind == "none":
        assert s is h


def _prep_case(dtype, paged, S, B=3, H=4, nope=16, P=16, R=32, v=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, H * (nope + P), generator=g)
    kv = torch.randn(S, B, R + P, generator=g)
    if S == 1:
        q, kv = q.to(dtype), kv.to(dtype)
    pos = torch.tensor([5, 0, 31])[:B]
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)[:B]
    cos, sin = rope_cos_sin(pos, rope_inv_freq(P, 1e4), dtype)
    nw = (torch.randn(R, generator=g) * 0.2 + 1).to(dtype)
    kvb = (torch.randn(H, nope + v, R, generator=g) * 0.2).to(dtype)
    table = None
    if paged:  # blocks of 16: row r's block i is table[r, i]
        cache = torch.zeros(8, 16, R + P, dtype=dtype)
        table = torch.tensor([[5, 1], [0, 7], [3, 2]], dtype=torch.int32)
    else:
        cache = torch.zeros(3, 32, R + P, dtype=dtype)
    return q, kv, cos, sin, nw, kvb[:, :nope], kvb[:, nope:], cache, rows, pos, table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged,S,R", [(False, 1, 32), (False, 3, 32), (True, 2, 32), (False, 2, 160)])
def test_mla_prep(dtype, paged, S, R):
    """R = 160: the latent in two column blocks of q_lat (a GPU compile failed on it: both branches bound one name
    at two shapes; the interpreter does not type-check branches)."""
    q, kv, cos, sin, nw, w_uk, w_uv, cache, rows, pos, table = _prep_case(dtype, paged, S, R=R)
    d = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got_cache = d(cache.clone())
    q_lat, q_pe = fused.mla_prep(d(q), d(kv), d(cos), d(sin), d(nw), 1e-6, d(w_uk), got_cache, d(rows), d(pos),
                                 d(table), dtype)
    B, H, nope = q.shape[1], *w_uk.shape[:2]
    R, P = w_uk.shape[2], cos.shape[-1]
    qs = (q.sum(0) if S > 1 else q[0]).to(dtype).view(B, H, nope + P)  # the GEMV's output from its partials
    kvs = (kv.sum(0) if S > 1 else kv[0]).to(dtype)
    new = torch.cat([rms_norm(kvs[:, :R], nw, 1e-6), apply_rope(kvs[:, R:], cos, sin)], -1)
    want = cache.clone()
    for b in range(B):
        r, p = int(rows[b]), int(pos[b])
        if table is None:
            want[r, p] = new[b]
        else:
            want[int(table[r, p // 16]), p % 16] = new[b]
    assert rel(got_cache.cpu(), want) < exact(dtype)
    assert rel(q_pe.cpu(), apply_rope(qs[..., nope:], cos[:, None], sin[:, None])) < exact(dtype)
    assert rel(q_lat.cpu(), torch.einsum("bhn,hnr->bhr", qs[..., :nope], w_uk)) < exact(dtype)


def test_mla_prep_skips_a_position_past_the_capacity():
    q, kv, cos, sin, nw, w_uk, _, cache, rows, pos, _ = _prep_case(torch.float32, False, 1)
    pos = torch.tensor([5, 0, 32])  # capacity 32
    d = lambda t: t.to(DEVICE)  # noqa: E731
    got = d(cache.clone())
    fused.mla_prep(d(q), d(kv), d(cos), d(sin), d(nw), 1e-6, d(w_uk), got, d(rows), d(pos), None, torch.float32)
    assert got[1].abs().sum() == 0 and got[2, 5].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,R,v", [(3, 4, 32, 24), (17, 2, 80, 16)])
def test_uv_out(dtype, B, H, R, v):
    g = torch.Generator().manual_seed(B)
    o_lat = torch.randn(B, H, R, generator=g).to(dtype)
    w_uv = (torch.randn(H, v + 8, R, generator=g) * 0.2).to(dtype)[:, 8:]  # a view, as `MLA.per_head` gives
    got = fused.uv_out(o_lat.to(DEVICE), w_uv.to(DEVICE), dtype).cpu()
    assert got.shape == (B, H * v)
    assert rel(got, torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(B, H * v)) < exact(dtype)


# -- the layers through the kernels ----------------------------------------------------------------------------


@pytest.fixture
def forced(monkeypatch):
    """The DeepSeek layers take the fused kernels for CPU tensors too (under the interpreter); on a GPU they do
    by default."""
    if DEVICE == "cpu":
        monkeypatch.setattr(chain, "FORCE", True)


def _swiglu(I, H, bits, gs, dtype, g, slots=1):
    from sluice.layers.moe import swiglu
    from sluice.quant.affine import quantize

    gate, up, down = (quantize(torch.randn(*shape, generator=g) * 0.1, bits, gs) for shape in ((I, H), (I, H), (H, I)))
    return swiglu(gate, up, down, slots=slots).to(DEVICE)


@pytest.mark.parametrize("split", [True, False])
def test_swiglu_in_two_gemvs(forced, split):
    g = torch.Generator().manual_seed(2)
    mlp = _swiglu(128, 64, 4, 32, torch.float32, g)
    x = torch.randn(2, 64, generator=g).to(DEVICE)
    y = chain.swiglu_gemv(mlp, x, split=split)
    assert y is not None and (split or y.shape[0] == 1)
    assert rel(y.sum(0).cpu(), mlp(x).cpu()) < 2e-2  # x taken per group to int16, as every GEMV takes it


@pytest.mark.parametrize("shared_mult,slots", [(1, 1), (2, 1), (2, 2)])
def test_deepseek_moe_with_its_shared_experts_unsummed(forced, monkeypatch, shared_mult, slots):
    """DeepseekMoE on the Triton MoE kernels: shared experts stored like one routed expert (slot k, appended by the
    router: `group_topk`'s extra slots on a GPU, a cat here), or twice as wide (Moonlight's two): their gate_up in
    two slots as the loader lays it out (slots k, k + 1 of the routed GEMVs, weight 1), or not (`swiglu_gemv` into
    `ExpertOutputs`, weight 1); summed by the fused residual add + norm as its reference path sums them."""
    from sluice.kernels.moe import ExpertOutputs, triton as moe_triton
    from sluice.layers import deepseek_moe as dm
    from sluice.layers.linear import Linear
    from sluice.layers.linear import RMSNorm
    from sluice.quant.affine import quantize

    g = torch.Generator().manual_seed(shared_mult)
    E, I, H, k = 8, 64, 64, 3
    routing = dm.Routing("sigmoid", "noaux_tc", 1, 1, True, 2.5)
    moe = dm.DeepseekMoE(Linear(torch.randn(E, H, generator=g) * 0.3), torch.randn(E, generator=g) * 0.1,
                         quantize(torch.randn(E, 2 * I, H, generator=g) * 0.1, 4, 32),
                         quantize(torch.randn(E, H, I, generator=g) * 0.1, 4, 32), k, routing,
                         _swiglu(I * shared_mult, H, 4, 32, torch.float32, g, slots)).to(DEVICE)
    x = torch.randn(2, 1, H, generator=g).to(DEVICE)
    monkeypatch.setattr(dm, "moe_kernels", lambda m, t: None)
    want = moe(x)  # the reference path
    monkeypatch.setattr(dm, "moe_kernels", lambda m, t: moe_triton)
    out = moe.unsummed(x)
    assert isinstance(out, ExpertOutputs) and (out.shared_out is None) == (slots == shared_mult)
    assert out.weights.shape[1] == k + (slots if slots == shared_mult else 0)
    norm = RMSNorm(torch.ones(H, device=DEVICE), 1e-5)
    h = torch.randn(2, 1, H, generator=g).to(DEVICE)
    s, _, _ = chain.add_rms_norm(h, out, norm)
    assert rel(s.cpu(), (h + want).cpu()) < 2e-2


@pytest.mark.parametrize("case,dtype", [(0, "bfloat16"), (1, "float32"), (4, "bfloat16")])  # (CI time: one dtype each)
def test_decode_steps_through_the_fused_chain(forced, monkeypatch, tmp_path, dtype, case):
    """A tiny DeepSeek's decode steps (the batched GPU path: no host rows) with the fused chain against the same
    steps with it off (the torch glue around the split-K kernel, what the GPU ran before): the logits equal to a
    few fp32 ulps, the same bits in bf16; the fused path taken at every MLA layer."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepseek import CASES, save

    import sluice
    from sluice.attention.mla import MLAAttention
    from sluice.engine.batch import ForwardMeta

    name, make, over = CASES[case]
    d = save(make(seed=len(name), **over), tmp_path / "m")
    calls = []
    fused_decode = MLAAttention.fused_decode
    monkeypatch.setattr(MLAAttention, "fused_decode", lambda *a, **k: (calls.append(1), fused_decode(*a, **k))[1])
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    outs = {}
    for on in (False, True):
        monkeypatch.setenv("SLUICE_DEEPSEEK_KERNELS", "1" if on else "0")
        m = sluice.load(d, device=DEVICE, dtype=dtype)
        cache = m.new_cache(24, rows=2)
        cache.attention.decode_kernel = True  # the split-K kernel (on the CPU: interpreted)
        logits = []
        with torch.inference_mode():
            m.forward(ids[:, :8], cache, 0)
            for t in range(8, 12):
                meta = ForwardMeta.decode_host([0, 1], [t, t], cache.visible, DEVICE)
                meta.rows_host = meta.positions_host = None  # as a captured graph runs it
                logits.append(m.module(ids[:, t:t + 1].to(DEVICE), cache, meta, m.dtype).cpu())
        outs[on] = torch.cat(logits, 1)
    layers = m.config.num_layers if hasattr(m.config, "num_layers") else len(m.module.layers)
    assert len(calls) == 4 * layers
    tol = 1e-6 if dtype == "float32" else 1e-3
    assert rel(outs[True], outs[False]) < (tol if DEVICE == "cpu" else 2e-2)


def test_decode_runs_two_shared_experts_as_expert_slots(monkeypatch, tmp_path):
    """A tiny DeepSeek-V3 with two shared experts (Moonlight's layout), 4-bit: the loader lays the shared gate_up out
    in two slots, and decode steps with the MoE on the Triton kernels (the shared experts as slots k, k + 1 of the
    routed GEMVs) give the reference path's logits; with the routed experts streamed through 6 device slots (the
    shared slots' ids E, E + 1 mapped to S, S + 1) the same bits as with every expert in place."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepseek import QUANT16, save, v3

    import sluice
    from sluice.engine.batch import ForwardMeta
    from sluice.formats.convert import convert
    from sluice.kernels.moe import triton as mt
    from sluice.layers import deepseek_moe as dm

    src = save(v3(seed=11, **dict(QUANT16, num_hidden_layers=2, n_shared_experts=2)), tmp_path / "hf")
    mlx = convert(src, tmp_path / "mlx", bits=4, group_size=32, quiet=True)
    seen = []
    moe_decode = mt.moe_decode

    def spy(x, ids, weights, *args, shared_expert=None, **kw):
        seen.append((ids[:, -2:].cpu(), None if shared_expert is None else shared_expert[0].n))
        return moe_decode(x, ids, weights, *args, shared_expert=shared_expert, **kw)

    monkeypatch.setattr(mt, "moe_decode", spy)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(3))
    outs = {}
    for run, on, slots in (("reference", False, None), ("kernels", True, None), ("streamed", True, 6)):
        # the kernels for decode steps alone (a prefill's grouped GEMMs are slow under the interpreter)
        monkeypatch.setattr(dm, "moe_kernels", lambda m, t, on=on: mt if on and t.numel() <= 4 * t.shape[-1] else None)
        m = sluice.load(mlx, device=DEVICE, dtype="float32", **({"expert_slots": slots} if slots else {}))
        moe = m.module.layers[1].mlp
        assert moe.shared.slots == 2 and m.module.layers[0].mlp.slots == 1
        cache = m.new_cache(16, rows=2)
        logits = []
        seen.clear()
        with torch.inference_mode():
            m.forward(ids[:, :8], cache, 0)
            for t in range(8, 10):
                meta = ForwardMeta.decode_host([0, 1], [t, t], cache.visible, DEVICE)
                logits.append(m.module(ids[:, t:t + 1].to(DEVICE), cache, meta, m.dtype).cpu())
        outs[run] = torch.cat(logits, 1)
        if on:  # every step: the shared experts as the last two slots, ids one and two past the stack
            E = moe.gate_up.weight.shape[0]
            assert E == (slots or 16) and len(seen) == 2
            assert all(n == 2 and torch.equal(last, torch.tensor([[E, E + 1]] * 2, dtype=torch.int32))
                       for last, n in seen)
    assert rel(outs["kernels"], outs["reference"]) < 1e-3
    assert torch.equal(outs["streamed"], outs["kernels"])
