"""The fused q/k head norms + partial RoPE (`kernels/rope/triton.py`) against the torch references on fresh random
data: under the Triton interpreter on CPU, the same tests on a GPU. fp32 agrees to rounding; bf16 rounds where the
references round, so nearly every element is bit-identical. A decode step's cache append (k and v straight into a
dense cache at each sequence's row and slot) against `kernels.rope.qk_norm_rope`'s torch path."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.norm.reference import rms_norm_fp32_scale  # noqa: E402
from sluice.kernels.rope import qk_norm_rope as qk_norm_rope_torch  # noqa: E402
from sluice.kernels.rope import triton as rt  # noqa: E402
from sluice.kernels.rope.reference import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def projection(B, T, Hq, Hkv, D, r, dtype, g):
    """q, k, v as views of one fused projection output ([query | gate] per q head, then k, then v), the weights,
    cos and sin at random positions."""
    qkv = (torch.randn(B, T, 2 * Hq * D + 2 * Hkv * D, generator=g) * 2).to(dtype)
    qg, k, v = qkv.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = qg.view(B, T, Hq, 2 * D)[..., :D]
    wq, wk = (torch.randn(D, generator=g) * 0.3 + 1.0 for _ in range(2))
    pos = torch.randint(0, 5000, (B, T), generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(r, 1e7), dtype)
    return q, k.view(B, T, Hkv, D), v.view(B, T, Hkv, D), wq, wk, cos, sin


def reference(x, w, cos, sin):
    return apply_rope(rms_norm_fp32_scale(x, w, EPS), cos[:, :, None], sin[:, :, None])


def check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if dtype == torch.float32:
        assert err < 1e-6
    else:
        assert err < 1e-2 and (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,r", [(1, 1, 16, 2, 256, 64), (2, 3, 2, 2, 256, 64), (1, 5, 4, 1, 64, 64),
                                            (2, 1, 3, 5, 128, 32)])
def test_qk_norm_rope_matches_the_references(B, T, Hq, Hkv, D, r, dtype):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + Hq + D)
    q, k, v, wq, wk, cos, sin = projection(B, T, Hq, Hkv, D, r, dtype, g)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    oq, ok = rt.qk_norm_rope(d(q), d(k), d(wq), d(wk), d(cos), d(sin), EPS)
    check(oq.cpu(), reference(q, wq, cos, sin), dtype)
    check(ok.cpu(), reference(k, wk, cos, sin), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap,positions", [(40, [39, 7, 22]), (16, [95, 7, 40])])  # the second: a ring's slots
def test_decode_step_appends_k_and_v_to_the_cache(dtype, cap, positions):
    """Three sequences in cache rows 5, 0, 3 of a pool of 6 at their own positions: k' and v land at slot
    position % cap of their rows, nothing else changes, q' is what it is without the cache."""
    g = torch.Generator().manual_seed(cap)
    B, P, Hq, Hkv, D, r = 3, 6, 4, 2, 64, 16
    q, k, v, wq, wk, cos, sin = projection(B, 1, Hq, Hkv, D, r, dtype, g)
    rows, pos = torch.tensor([5, 0, 3], dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)
    caches = [torch.randn(P, Hkv, cap, D, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    ref_q, none = qk_norm_rope_torch(q, k, wq, wk, cos, sin, EPS, v, *want, pos, rows)
    assert none is None
    d = lambda x: x.to(DEVICE)  # noqa: E731
    got = [d(c) for c in caches]
    oq, ok = rt.qk_norm_rope(d(q), d(k), d(wq), d(wk), d(cos), d(sin), EPS, d(v), *got, d(pos), d(rows))
    assert ok is None
    check(oq.cpu(), ref_q, dtype)
    plain_q, plain_k = rt.qk_norm_rope(d(q), d(k), d(wq), d(wk), d(cos), d(sin), EPS)
    assert torch.equal(oq, plain_q)
    for b in range(B):  # exactly the kernel's own k' and the projection's v
        slot = int(pos[b]) % cap
        assert torch.equal(got[0][int(rows[b]), :, slot], plain_k[b, 0])
        assert torch.equal(got[1][int(rows[b]), :, slot].cpu(), v[b, 0])
    at = (rows.long(), slice(None), pos.long() % cap)
    check(got[0].cpu()[at], want[0][at], dtype)
    assert torch.equal(got[1].cpu(), want[1])
    kept = torch.ones(P, Hkv, cap, dtype=torch.bool)
    kept[rows.long(), :, pos.long() % cap] = False
    for c, before in zip(got, caches):
        assert torch.equal(c.cpu()[kept], before[kept])


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes: on the GPU machine")
@pytest.mark.parametrize("T", [1, 300])
def test_qwen3_next_80b_shapes_on_gpu(T):
    """Qwen3-Next-80B's gated attention: 16 q heads, 2 KV heads of 256, rotary 64, bf16; a decode step of 8
    sequences appending to a 4096-slot cache (rows of a pool of 12), and a prefill chunk."""
    g = torch.Generator().manual_seed(T)
    B, Hq, Hkv, D, r = (8 if T == 1 else 1), 16, 2, 256, 64
    q, k, v, wq, wk, cos, sin = (x.cuda() for x in projection(B, T, Hq, Hkv, D, r, torch.bfloat16, g))
    oq, ok = rt.qk_norm_rope(q, k, wq, wk, cos, sin, EPS)
    check(oq.cpu(), reference(q.cpu(), wq.cpu(), cos.cpu(), sin.cpu()), torch.bfloat16)
    check(ok.cpu(), reference(k.cpu(), wk.cpu(), cos.cpu(), sin.cpu()), torch.bfloat16)
    if T == 1:
        caches = [torch.randn(12, Hkv, 4096, D, generator=g).to(torch.bfloat16) for _ in range(2)]
        rows = torch.tensor([11, 0, 3, 7, 2, 9, 5, 1], dtype=torch.int32)
        pos = torch.randint(0, 4096, (B,), generator=g).to(torch.int32)
        want = [c.clone() for c in caches]
        qk_norm_rope_torch(q.cpu(), k.cpu(), wq.cpu(), wk.cpu(), cos.cpu(), sin.cpu(), EPS, v.cpu(), *want, pos, rows)
        got = [c.cuda() for c in caches]
        aq, _ = rt.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, v, *got, pos.cuda(), rows.cuda())
        assert torch.equal(aq, oq)
        at = (rows.long(), slice(None), pos.long() % 4096)
        check(got[0].cpu()[at], want[0][at], torch.bfloat16)  # the new keys, then everything else
        assert torch.equal(got[1].cpu(), want[1])
        keys = got[0].cpu()
        keys[at] = want[0][at]
        assert torch.equal(keys, want[0])


def test_qk_norm_rope_rejects_bad_arguments():
    x = torch.zeros(1, 2, 3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="r even"):
        rt.qk_norm_rope(x, x, w, w, torch.zeros(1, 2, 65, device=DEVICE), torch.zeros(1, 2, 65, device=DEVICE), EPS)
    cs = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 3, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one token per sequence"):  # T = 2
        rt.qk_norm_rope(x, x, w, w, cs, cs, EPS, x, cache, cache, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                        torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="positions"):
        rt.qk_norm_rope(x[:, :1], x[:, :1], w, w, cs[:, :1], cs[:, :1], EPS, x[:, :1], cache, cache,
                        torch.zeros(1, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cos_sin_tables_match_the_reference(dtype):
    """The one-launch cos/sin tables: on a GPU the bits of the reference run there (torch's CUDA cos and sin are
    libdevice's, as the kernel's); under the interpreter (numpy's cos and sin) within one unit of the last place."""
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 300_000, (3, 5), generator=g).to(DEVICE)
    inv_freq = rope_inv_freq(64, 10_000_000.0).to(DEVICE)
    cos, sin = rt.rope_cos_sin(positions, inv_freq, dtype)
    ref_cos, ref_sin = (t.cpu() for t in rope_cos_sin(positions, inv_freq, dtype))
    assert cos.shape == ref_cos.shape == (3, 5, 64) and cos.dtype == dtype
    for got, ref in ((cos.cpu(), ref_cos), (sin.cpu(), ref_sin)):
        if DEVICE == "cuda":
            assert torch.equal(got, ref)
        else:
            ulp = torch.finfo(dtype).eps * ref.float().abs().clamp(min=torch.finfo(dtype).tiny)
            assert ((got.float() - ref.float()).abs() <= ulp).all()
