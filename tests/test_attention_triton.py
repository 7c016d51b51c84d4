"""Split-K decode attention (Triton) against explicit fp64 attention on fresh random data: any split count,
sequences at different positions (splits that see no key), the ring buffer's wrap-around, and the TurboQuant
layout against attention over the dequantized cache; the gated attention's output gate in the merge, and its layer
through the fused kernels against its torch path. Under the interpreter on CPU; on a GPU at once."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.attention import triton as at  # noqa: E402
from sluice.kernels.turboquant import reference as tq  # noqa: E402
from helpers import attention_reference as reference, rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2 if DEVICE == "cuda" else 1e-5  # the GPU multiplies on bf16 tensor cores, the interpreter in fp32
TOL_INT8 = max(TOL, 3e-4)  # TurboQuant on int8 tensor cores: q (and the probabilities) to 15 bits

@pytest.mark.parametrize("splits", [1, 2, 7, None])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (9, 3, 64), (16, 2, 128)])
def test_dense_decode(splits, Hq, Hkv, D):
    merge = {"merge_elems": 32} if splits == 7 else {}  # the merge reads the splits in several loads
    g = torch.Generator().manual_seed(Hq * 10 + D)
    B, cap = 3, 150
    q = torch.randn(B, Hq, D, generator=g)
    k, v = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
    pos = torch.tensor([149, 4, 77])  # entry 1 sees 5 keys: most of its splits see none
    o = at.decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pos.to(DEVICE), 0.125, visible=150,
                            splits=splits, block_n=16, **merge).cpu()
    assert not o.isnan().any()
    for b in range(B):
        n = int(pos[b]) + 1
        assert rel(o[b], reference(q[b], k[b, :, :n], v[b, :, :n], 0.125)) < TOL


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("with_rows", [False, True])
def test_dense_decode_paged(splits, with_rows):
    """A paged cache (`cache/blocks.py`): blocks of 32 positions, each sequence's in a scattered order through its
    table row; the same result as over its positions laid out in a row."""
    g = torch.Generator().manual_seed(splits or 0)
    Hq, Hkv, D, page, B = 4, 2, 64, 32, 3
    pos = torch.tensor([130, 5, 64])
    hist_k, hist_v = torch.randn(B, Hkv, 160, D, generator=g), torch.randn(B, Hkv, 160, D, generator=g)
    blocks = 17
    kb, vb = torch.randn(blocks, Hkv, page, D, generator=g), torch.randn(blocks, Hkv, page, D, generator=g)
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((B + 1, 5), blocks - 1, dtype=torch.int32)  # unused entries: a scratch block
    for b in range(B):
        for i in range(int(pos[b]) // page + 1):
            blk = order.pop()
            table[b, i] = blk
            kb[blk], vb[blk] = hist_k[b, :, i * page:(i + 1) * page], hist_v[b, :, i * page:(i + 1) * page]
    rows = torch.tensor([2, 0, 1])  # query b reads table row rows[b]
    q = torch.randn(B, Hq, D, generator=g)
    kw = dict(rows=rows.to(DEVICE)) if with_rows else {}
    qq, pp = (q[rows], pos[rows]) if with_rows else (q, pos)  # query i: row rows[i]'s
    o = at.decode_attention(qq.to(DEVICE), kb.to(DEVICE), vb.to(DEVICE), pp.to(DEVICE), 0.125, visible=160,
                            splits=splits, block_n=16, table=table.to(DEVICE), **kw).cpu()
    for i in range(B):
        b = int(rows[i]) if with_rows else i
        n = int(pos[b]) + 1
        assert rel(o[i], reference(qq[i], hist_k[b, :, :n], hist_v[b, :, :n], 0.125)) < TOL


@pytest.mark.parametrize("pos", [3, 15, 16, 40, 101])
def test_dense_decode_ring_wraps(pos):
    """Window 16 in a ring of 16 slots: position j lives in slot j % 16; the query sees j in (pos-16, pos]."""
    g = torch.Generator().manual_seed(pos)
    Hq, Hkv, D, W = 4, 2, 64, 16
    hist_k, hist_v = torch.randn(Hkv, pos + 1, D, generator=g), torch.randn(Hkv, pos + 1, D, generator=g)
    k, v = torch.zeros(1, Hkv, W, D), torch.zeros(1, Hkv, W, D)
    for j in range(pos + 1):
        k[0, :, j % W], v[0, :, j % W] = hist_k[:, j], hist_v[:, j]
    q = torch.randn(1, Hq, D, generator=g)
    lo = max(0, pos - W + 1)
    ref = reference(q[0], hist_k[:, lo:], hist_v[:, lo:], 0.1)
    for splits in (1, 3):
        o = at.decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), torch.tensor([pos]).to(DEVICE), 0.1,
                                visible=min(pos + 1, W), window=W, splits=splits, block_n=16).cpu()
        assert rel(o[0], ref) < TOL


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("int8", [0, 1, 2])
def test_turboquant_decode_equals_attention_over_the_dequantized_cache(splits, window, int8):
    """Codes for positions p - j >= RECENT, the exact rotated ring for the newest RECENT; rotated domain; products
    in fp16, or on int8 tensor cores (q, and with int8 = 2 the probabilities, to 15 bits)."""
    g = torch.Generator().manual_seed(splits + (window or 0))
    B, Hq, Hkv, D, recent = 2, 8, 2, 64, 8
    cap = window or 96
    hist = 96
    k, v = torch.randn(B, Hkv, hist, D, generator=g) + 0.3, torch.randn(B, Hkv, hist, D, generator=g)
    kc, ks = tq.quantize(k)
    vc, vs = tq.quantize(v)
    slot = torch.arange(hist) % cap
    codes_k = torch.zeros(B, Hkv, cap, D // 2, dtype=torch.uint8)
    codes_v, scale_k, scale_v = codes_k.clone(), torch.zeros(B, Hkv, cap), torch.zeros(B, Hkv, cap)
    ring_k, ring_v = torch.zeros(B, Hkv, recent, D), torch.zeros(B, Hkv, recent, D)
    pos = torch.tensor([95, 60])
    for b in range(B):
        for j in range(int(pos[b]) + 1):  # what the cache holds after position pos[b]
            codes_k[b, :, slot[j]], codes_v[b, :, slot[j]] = kc[b, :, j], vc[b, :, j]
            scale_k[b, :, slot[j]], scale_v[b, :, slot[j]] = ks[b, :, j], vs[b, :, j]
            ring_k[b, :, j % recent], ring_v[b, :, j % recent] = tq.rotate(k[b, :, j]), tq.rotate(v[b, :, j])
    q = torch.randn(B, Hq, D, generator=g)
    qr = tq.rotate(q)
    kq, vq = tq.dequantize_rotated(kc, ks), tq.dequantize_rotated(vc, vs)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    o = at.decode_attention(d(qr), d(codes_k), d(tq.interleave(codes_v)), d(pos), 0.125, visible=cap, window=window,
                            splits=splits, block_n=16, k_scale=d(scale_k), v_scale=d(scale_v), k_recent=d(ring_k),
                            v_recent=d(ring_v), int8_products=int8, cuda_kernel=False).cpu()
    for b in range(B):
        p = int(pos[b])
        lo = 0 if window is None else max(0, p - window + 1)
        j = torch.arange(lo, p + 1)
        exact = (p - j < recent)[None, :, None]
        keys = torch.where(exact, tq.rotate(k[b][:, lo:p + 1]), kq[b][:, lo:p + 1])
        vals = torch.where(exact, tq.rotate(v[b][:, lo:p + 1]), vq[b][:, lo:p + 1])
        assert rel(o[b], reference(qr[b], keys, vals, 0.125)) < (TOL if int8 == 0 else TOL_INT8)


@pytest.mark.parametrize("D,merge_elems", [(32, None), (128, None), (256, None), (128, 32)])
def test_turboquant_decode_rotates_its_output_back(D, merge_elems):
    """unrotate: the merge kernel returns R^T o, the output of the codec's domain rotated back (D > 64: each
    head's coordinate blocks merged by their own programs, the last one rotating the row; merge_elems: the
    splits read in several loads)."""
    g = torch.Generator().manual_seed(D)
    B, Hq, Hkv, cap, recent = 2, 4, 2, 40, 8
    codes = torch.randint(0, 256, (2, B, Hkv, cap, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(2, B, Hkv, cap, generator=g) + 0.1
    ring = torch.randn(2, B, Hkv, recent, D, generator=g)
    q, pos = torch.randn(B, Hq, D, generator=g), torch.tensor([39, 20])
    d = lambda x: x.to(DEVICE)  # noqa: E731
    args = (d(q), d(codes[0]), d(tq.interleave(codes[1])), d(pos), D ** -0.5, cap)
    kw = dict(splits=3, block_n=16, k_scale=d(scales[0]), v_scale=d(scales[1]), k_recent=d(ring[0]),
              v_recent=d(ring[1]), **({"merge_elems": merge_elems} if merge_elems else {}))
    o = at.decode_attention(*args, **kw).cpu()
    back = at.decode_attention(*args, unrotate=True, **kw).cpu()
    assert rel(back, tq.unrotate(o)) < (1e-5 if DEVICE == "cpu" else 1e-3)
    with pytest.raises(ValueError, match="unrotate"):
        at.decode_attention(d(q), d(ring[0]), d(ring[1]), d(pos), 1.0, recent, unrotate=True)


def test_bad_shapes_raise():
    q = torch.randn(1, 4, 64, device=DEVICE)
    k = torch.randn(1, 3, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        at.decode_attention(q, k, k, torch.tensor([0], device=DEVICE), 1.0, visible=1)
    with pytest.raises(ValueError, match="positions"):
        at.decode_attention(q, k[:, :2], k[:, :2], torch.tensor([0.0], device=DEVICE), 1.0, visible=1)


def test_turboquant_layouts_are_checked():
    """Value codes must come interleaved (reference.interleave), code arrays must have D/2 bytes per position."""
    from sluice.kernels.turboquant import triton as tqt

    B, Hq, Hkv, D, cap = 1, 4, 2, 64, 8
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=DEVICE)  # noqa: E731
    codes = z(B, Hkv, cap, D // 2, dt=torch.uint8)
    kw = dict(k_scale=z(B, Hkv, cap), v_scale=z(B, Hkv, cap), k_recent=z(B, Hkv, 4, D), v_recent=z(B, Hkv, 4, D))
    pos = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="value codes"):  # values row by row, as keys are
        at.decode_attention(z(B, Hq, D), codes, codes, pos, 1.0, 4, **kw)
    with pytest.raises(ValueError, match="TurboQuant codes"):
        tqt.quantize_append(z(B, Hkv, D), z(B, Hkv, cap, D, dt=torch.uint8), kw["k_scale"], kw["k_recent"], pos)


@pytest.mark.parametrize("kind,window", [("dense", None), ("dense", 6), ("turboquant4", None), ("turboquant4", 22)])
def test_caches_decode_through_the_kernel(kind, window):
    """The caches' decode path (the kernel, as on a GPU) equals their reference path, step by step: two sequences
    in rows 3 and 1 of a pool of 4, at different positions, `visible` the most positions a row holds."""
    from sluice.attention import make_attention
    from sluice.attention.turboquant import TurboQuantAttention
    from sluice.cache.turboquant import TurboQuantKVCache
    from sluice.engine.batch import ForwardMeta

    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, T = 2, 4, 2, 64, 40
    rows, prompts = [3, 1], [10, 6]
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))
    d = lambda x: x.to(DEVICE)  # noqa: E731
    outs = {}
    for kernel in (False, True):
        cache = (make_attention("dense", 1, 4, Hkv, D, T, torch.float32, DEVICE, window=window) if kind == "dense"
                 else TurboQuantAttention(TurboQuantKVCache(1, 4, Hkv, D, T, torch.float32, DEVICE, window=window,
                                                            recent=8)))
        cache.decode_kernel = kernel
        o = [cache.forward(0, d(q[b:b + 1, :, :n]), d(k[b:b + 1, :, :n]), d(v[b:b + 1, :, :n]),
                          ForwardMeta.prefill(r, 1, 0, n, DEVICE), 0.125)[0].cpu()
             for b, (r, n) in enumerate(zip(rows, prompts))]
        for step in range(T - max(prompts)):
            pos = [n + step for n in prompts]
            new = [d(torch.stack([x[b, :, p] for b, p in enumerate(pos)])[:, :, None]) for x in (q, k, v)]
            out = cache.forward(0, *new, ForwardMeta.decode_host(rows, pos, T, DEVICE), 0.125).cpu()
            o = [torch.cat([o[b], out[b]], 1) for b in range(B)]
        outs[kernel] = torch.cat(o, 1)
    assert rel(outs[True], outs[False]) < (TOL if kind == "dense" else TOL_INT8)


@pytest.mark.parametrize("D,dtype,B,Hkv,interleaved", [(64, torch.float32, 3, 7, False),
                                                       (128, torch.float32, 3, 7, True),
                                                       (256, torch.bfloat16, 3, 7, False),
                                                       (128, torch.float32, 1, 2, False),
                                                       (256, torch.float32, 1, 1, True)])
def test_quantize_append_matches_the_reference(D, dtype, B, Hkv, interleaved):
    from sluice.kernels.turboquant import triton as tqt

    g = torch.Generator().manual_seed(D)
    cap, R = 12, 4  # 21 vectors: two programs of 16; 2 and 1: one program that size
    x = (torch.randn(B, Hkv, D, generator=g) * 3 + 0.5).to(dtype)
    shape = (B, Hkv, cap // 4, D // 2, 4) if interleaved else (B, Hkv, cap, D // 2)
    stored = torch.zeros(shape, dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(B, Hkv, cap, device=DEVICE)
    ring = torch.zeros(B, Hkv, R, D, dtype=dtype, device=DEVICE)
    tqt.quantize_append(x.to(DEVICE), stored, scales, ring, torch.full((B,), 6, device=DEVICE))  # ring slot 6 % 4
    codes = tq.deinterleave(stored) if interleaved else stored
    ref_codes, ref_scale = tq.quantize(x.float())
    same = (tq.unpack(codes[:, :, 6].cpu()) == tq.unpack(ref_codes)).double().mean()
    assert same > 0.999  # rounding may move a coordinate sitting on a cell boundary
    assert rel(scales[:, :, 6].cpu(), ref_scale) < 1e-3
    tol = 5e-3 if dtype != torch.float32 else 1e-5 if DEVICE == "cuda" else 1e-6  # GPU fp32: bf16 hi + lo
    assert rel(ring[:, :, 2].cpu().float(), tq.rotate(x.float())) < tol
    assert codes[:, :, [0, 5, 7]].count_nonzero() == 0 and ring[:, :, [0, 1, 3]].count_nonzero() == 0


@pytest.mark.parametrize("D,interleaved,first,n,dtype", [(64, False, 3, 50, torch.float32),
                                                         (256, True, 0, 64, torch.bfloat16),
                                                         (128, True, 45, 30, torch.float32)])  # wraps the ring
def test_dequantize_a_range_of_positions(D, interleaved, first, n, dtype):
    """Positions first .. first + n - 1 (slot p % capacity) of the cache's codes back to rotated vectors: the
    reference's dequantize_rotated, in the rows' layout (values interleaved), bit for bit in fp32."""
    from sluice.kernels.turboquant import triton as tqt

    g = torch.Generator().manual_seed(D + n)
    B, Hkv, cap = 2, 3, 64
    codes = torch.randint(0, 256, (B, Hkv, cap, D // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(B, Hkv, cap, generator=g) + 0.1
    stored = tq.interleave(codes) if interleaved else codes
    out = tqt.dequantize(stored.to(DEVICE), scales.to(DEVICE), first, n, dtype).cpu()
    slots = torch.arange(first, first + n) % cap
    ref = tq.dequantize_rotated(codes[:, :, slots], scales[:, :, slots]).to(dtype)
    assert out.shape == (B, Hkv, n, D) and torch.equal(out, ref)


@pytest.mark.parametrize("D,dtype", [(64, torch.float32), (256, torch.bfloat16)])
def test_rotate_matches_the_reference(D, dtype):
    from sluice.kernels.turboquant import triton as tqt

    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(D)).to(dtype)
    y = tqt.rotate(x.to(DEVICE))
    assert rel(y.cpu(), tq.rotate(x.float())) < 1e-5
    assert rel(tqt.rotate(y, inverse=True).cpu(), x.float()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_decode_step_prep_appends_k_and_v_and_rotates_q():
    from sluice.kernels.turboquant import triton as tqt

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, cap = 2, 4, 2, 64, 8
    q, k, v = (torch.randn(B, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=DEVICE)  # noqa: E731
    kc, vc = z(B, Hkv, cap, D // 2, dt=torch.uint8), z(B, Hkv, cap // 4, D // 2, 4, dt=torch.uint8)
    ks, vs, kr, vr = z(B, Hkv, cap), z(B, Hkv, cap), z(B, Hkv, 4, D), z(B, Hkv, 4, D)
    pos = torch.full((B,), 5, dtype=torch.int32, device=DEVICE)  # slot 5, ring slot 5 % 4 = 1
    qr = tqt.decode_step_prep(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc, vc, ks, vs, kr, vr, pos)
    assert rel(qr.cpu(), tq.rotate(q)) < 1e-5
    for x, codes, scales, ring in ((k, kc, ks, kr), (v, tq.deinterleave(vc), vs, vr)):  # values: interleaved
        ref_codes, ref_scale = tq.quantize(x)
        assert (codes[:, :, 5].cpu() == ref_codes).float().mean() > 0.999
        assert rel(scales[:, :, 5].cpu(), ref_scale) < 1e-3
        assert rel(ring[:, :, 1].cpu(), tq.rotate(x)) < 1e-5
        assert codes[:, :, 4].abs().sum() == 0 and ring[:, :, 0].abs().sum() == 0  # nothing else written


def test_append_chunk_stores_a_prefill_chunk():
    """A prefill chunk of 10 positions (3 .. 12) of the sequences in rows 1 and 2 of a pool of 3, in one launch:
    every position's codes and scale, the ring (4 slots) only from the last 4 positions (the earlier ones would race
    for its slots), q rotated."""
    from sluice.kernels.turboquant import triton as tqt

    g = torch.Generator().manual_seed(6)
    B, Hq, Hkv, D, T, cap, P = 2, 4, 2, 64, 10, 16, 3
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (Hq, Hkv, Hkv))
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=DEVICE)  # noqa: E731
    kc, vc = z(P, Hkv, cap, D // 2, dt=torch.uint8), z(P, Hkv, cap // 4, D // 2, 4, dt=torch.uint8)
    ks, vs, kr, vr = z(P, Hkv, cap), z(P, Hkv, cap), z(P, Hkv, 4, D), z(P, Hkv, 4, D)
    qr = tqt.append_chunk(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc, vc, ks, vs, kr, vr, 1, 3)
    assert rel(qr.cpu(), tq.rotate(q)) < 1e-5
    for x, codes, scales, ring in ((k, kc, ks, kr), (v, tq.deinterleave(vc), vs, vr)):  # values: interleaved
        ref_codes, ref_scale = tq.quantize(x)
        assert (codes[1:, :, 3:13].cpu() == ref_codes).float().mean() > 0.999
        assert rel(scales[1:, :, 3:13].cpu(), ref_scale) < 1e-3
        assert rel(ring[1:, :, [9 % 4, 10 % 4, 11 % 4, 12 % 4]].cpu(), tq.rotate(x[:, :, 6:])) < 1e-5
        assert codes[0].abs().sum() == 0 and codes[:, :, 13:].abs().sum() == 0 and ring[0].abs().sum() == 0


def gated_cases(dtype, B, Hq, Hkv, D, cap, P, g):
    """q, gate, a pool of P dense cache rows, B sequences in distinct random rows at random positions."""
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    gate = (torch.randn(B, Hq, D, generator=g) * 3).to(dtype)
    k, v = (torch.randn(P, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    rows = torch.randperm(P, generator=g)[:B].to(torch.int32)
    pos = torch.randint(0, cap, (B,), generator=g).to(torch.int32)
    return q, gate, k, v, rows, pos


def check_gated(gated, o32, gate, dtype):
    """gated = o * sigmoid(gate) as torch rounds it in dtype, from the same kernel's fp32 output o32."""
    ref = o32.to(dtype) * torch.sigmoid(gate)
    assert gated.dtype == dtype and rel(gated, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype != torch.float32:
        assert (gated == ref).float().mean() > 0.99  # a sigmoid's last bit may round differently


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,splits", [("dense", 1), ("dense", 3), ("turboquant", 1), ("turboquant", 3)])
def test_gate_applied_by_the_merge(dtype, kind, splits):
    g = torch.Generator().manual_seed(splits)
    B, Hq, Hkv, D, cap, P = 3, 8, 2, 64, 48, 5
    q, gate, k, v, rows, pos = gated_cases(dtype, B, Hq, Hkv, D, cap, P, g)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    kw = dict(splits=splits, block_n=16, rows=d(rows))
    if kind == "turboquant":
        codes = torch.randint(0, 256, (2, P, Hkv, cap, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = torch.rand(2, P, Hkv, cap, generator=g) + 0.1
        q, k, v = q.float(), codes[0], tq.interleave(codes[1])
        kw.update(k_scale=d(scales[0]), v_scale=d(scales[1]), k_recent=d(torch.randn(P, Hkv, 8, D, generator=g)),
                  v_recent=d(torch.randn(P, Hkv, 8, D, generator=g)), unrotate=True)
    args = (d(q), d(k), d(v), d(pos), D ** -0.5, cap)
    o32 = at.decode_attention(*args, out_dtype=torch.float32, **kw).cpu()
    gated = at.decode_attention(*args, out_dtype=dtype, gate=d(gate), **kw).cpu()
    check_gated(gated, o32, gate, dtype)
    with pytest.raises(ValueError, match="gate"):
        at.decode_attention(*args, out_dtype=dtype, gate=d(gate[:, :4]), **kw)


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes: on the GPU machine")
@pytest.mark.parametrize("kind", ["dense", "turboquant"])
def test_gate_at_qwen3_next_80b_shapes_on_gpu(kind):
    """16 q heads, 2 KV heads of 256, bf16: 4 sequences in rows of a pool of 6, 4096 slots (TurboQuant: the CUDA
    split kernel, the merge gating)."""
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, D, cap, P = 4, 16, 2, 256, 4096, 6
    q, gate, k, v, rows, pos = (x.cuda() for x in gated_cases(torch.bfloat16, B, Hq, Hkv, D, cap, P, g))
    kw = dict(rows=rows)
    if kind == "turboquant":
        codes = torch.randint(0, 256, (2, P, Hkv, cap, D // 2), dtype=torch.int32, device="cuda").to(torch.uint8)
        scales = torch.rand(2, P, Hkv, cap, device="cuda") + 0.1
        q, k, v = q.float(), codes[0], tq.interleave(codes[1])
        recent = torch.randn(2, P, Hkv, 64, D, device="cuda").to(torch.bfloat16)
        kw.update(k_scale=scales[0], v_scale=scales[1], k_recent=recent[0], v_recent=recent[1], unrotate=True)
    args = (q, k, v, pos, D ** -0.5, cap)
    o32 = at.decode_attention(*args, out_dtype=torch.float32, **kw).cpu()
    gated = at.decode_attention(*args, out_dtype=torch.bfloat16, gate=gate, **kw).cpu()
    check_gated(gated, o32, gate.cpu(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,window", [("dense", None), ("dense", 6), ("turboquant4", None)])
@pytest.mark.parametrize("Hq,Hkv,D,r,hidden", [(4, 2, 64, 16, 96), pytest.param(
    16, 2, 256, 64, 2048, marks=pytest.mark.skipif(DEVICE != "cuda", reason="real shapes: on the GPU machine"))])
def test_gated_attention_layer_through_the_fused_kernels(monkeypatch, dtype, kind, window, Hq, Hkv, D, r, hidden):
    """GatedAttention's decode steps through the fused kernels (q/k norm + RoPE with the cache append where the
    cache is dense, the gate in the attention merge) against its torch path: two sequences in cache rows 3 and
    1 of a pool of 4, prefilled to different lengths, then decoding together."""
    from sluice.attention import make_attention
    from sluice.cache.kv import DenseKVCache
    from sluice.cache.pool import CachePool
    from sluice.engine.batch import ForwardMeta
    from sluice.kernels.rope import triton as rope_triton
    from sluice.kernels.rope.reference import rope_cos_sin, rope_inv_freq
    from sluice.layers import attention as layers
    from sluice.layers.linear import Linear

    g = torch.Generator().manual_seed(D + (window or 0))
    w = lambda *shape: Linear((torch.randn(*shape, generator=g) * shape[1] ** -0.5).to(dtype))  # noqa: E731
    norms = [torch.randn(D, generator=g) * 0.2 + 1.0 for _ in range(2)]
    layer = layers.GatedAttention(w(2 * Hq * D, hidden), w(Hkv * D, hidden), w(Hkv * D, hidden), w(hidden, Hq * D),
                                  *norms, Hq, Hkv, D, 1e-6, 0).to(DEVICE)
    inv_freq = rope_inv_freq(r, 1e7)
    T, rows, prompts = 24, [3, 1], [10, 6]
    x = torch.randn(2, T, hidden, generator=g).to(dtype)
    d = lambda t: t.to(DEVICE)  # noqa: E731

    def forward(xs, cache, meta):
        cos, sin = rope_cos_sin(meta.positions.cpu(), inv_freq, dtype)
        return layer(d(xs), d(cos), d(sin), cache, meta).cpu()

    outs, fused = {}, []
    for kernels in (False, True):
        if kernels and DEVICE == "cpu":  # the Triton kernels, under the interpreter
            monkeypatch.setattr(layers, "qk_norm_rope", rope_triton.qk_norm_rope)
        attention = make_attention(kind, 1, 4, Hkv, D, T, dtype, DEVICE, window=window)
        attention.decode_kernel = kernels
        decode, cache = attention.decode, CachePool(attention, None, 3)
        attention.decode = lambda layer, q, k, v, meta, scale, gate=None: (  # records what it is handed
            fused.append((k is None, gate is not None)), decode(layer, q, k, v, meta, scale, gate))[1]
        o = [forward(x[b:b + 1, :n], cache, ForwardMeta.prefill(row, 1, 0, n, DEVICE))
             for b, (row, n) in enumerate(zip(rows, prompts))]
        for step in range(T - max(prompts)):
            pos = [n + step for n in prompts]
            new = torch.stack([x[b, p] for b, p in enumerate(pos)])[:, None]
            out = forward(new, cache, ForwardMeta.decode_host(rows, pos, T, DEVICE))
            o = [torch.cat([o[b], out[b:b + 1]], 1) for b in range(2)]
        outs[kernels] = torch.cat(o, 1)
    assert fused and all(f == (kind == "dense", True) for f in fused)  # the kernel path was taken
    assert outs[True].dtype == dtype
    print("REL", kind, window, dtype, rel(outs[True], outs[False]), (outs[True] == outs[False]).float().mean())
    tol = (TOL if kind == "dense" else TOL_INT8) if dtype == torch.float32 else 1e-2 if DEVICE == "cpu" else 2e-2
    assert rel(outs[True], outs[False]) < tol
    assert isinstance(cache.kv, DenseKVCache) == (kind == "dense")
