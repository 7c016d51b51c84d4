"""The CUDA C TurboQuant decode kernel (kernels/attention/cuda.py, NVRTC) against fp64 attention over the
dequantized cache with the newest positions exact, against the Triton kernel, and over a paged cache (blocks through a
table) against the same cache in rows: GPU only (CI has none; there the Triton kernel, which does the same math, runs
under the interpreter); the byte-permute decode is checked on the CPU against an emulation of prmt."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels import nvrtc  # noqa: E402
from sluice.kernels.attention import cuda as tq_cuda  # noqa: E402
from sluice.kernels.attention import triton as at  # noqa: E402
from sluice.kernels.turboquant import reference as tq  # noqa: E402
from helpers import attention_reference as reference, rel  # noqa: E402

gpu = pytest.mark.skipif(not nvrtc.available(), reason="needs an NVIDIA GPU and NVRTC")


def test_a_wrong_nvrtc_library_path_says_so(monkeypatch, tmp_path):
    from sluice.errors import InvalidOptionError

    monkeypatch.setenv("SLUICE_NVRTC_LIB", str(tmp_path / "libnvrtc.so"))
    monkeypatch.setattr(nvrtc, "_libs", {})
    with pytest.raises(InvalidOptionError, match="SLUICE_NVRTC_LIB=.*unset it"):
        nvrtc._nvrtc()


@pytest.mark.skipif(not nvrtc.compiler_found(), reason="NVRTC's library not found")
@pytest.mark.parametrize("paged", [False, True])
def test_the_kernel_compiles_for_sm90(paged):
    """Every head dim and group size the kernel takes, its ring's and positions' dtypes, rows or not: compiled for
    sm_90 without a GPU (NVRTC only), so a compile error shows in CI."""
    src = tq_cuda.SOURCE.read_text()
    for D, G, ring_bf16, rows in ((64, 1, True, 0), (128, 8, False, 32), (256, 4, True, 64), (256, 8, False, 0)):
        defines = dict(D=D, G=G, QP=tq_cuda.Q_PARTS, W=tq_cuda.WARPS, STAGES=tq_cuda.STAGES, RING_BF16=int(ring_bf16),
                       POS64=int(rows == 64), ROWS=rows, PAGED=int(paged))
        assert nvrtc.compile_cubin(src, "tq_decode_split", defines, "sm_90")


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (nibble i of sel) & 7 of {b, a}, or with the
    nibble's bit 3 set that byte's sign replicated (0x00 / 0xFF)."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _int8s(word: int) -> list[int]:
    return [x - 256 if x > 127 else x for x in word.to_bytes(4, "little")]


def _levels(w: int, tables) -> tuple[list[int], list[int]]:
    """tq_decode.cu `levels`: the A and B parts (as int8 lists) of nibbles 0-3 and 4-7 of the code word w."""
    ta0, ta1, tb0, tb1 = tables
    x = w ^ 0x88888888
    lo = [a + b for a, b in zip(_int8s(_prmt(ta0, ta1, w)), _int8s(_prmt(tb0, tb1, x)))]
    hi = [a + b for a, b in zip(_int8s(_prmt(ta0, ta1, w >> 16)), _int8s(_prmt(tb0, tb1, x >> 16)))]
    return lo, hi


def test_byte_permutes_give_the_levels_minus_one():
    """The kernel's decode: prmt(TA, code) + prmt(TB, code ^ 8) = L(code) - 1 for every code in every nibble, and
    the value words' regrouping (0x6420 / 0x7531) gives each coordinate's levels at the four positions. CPU only:
    an emulation of prmt on the kernel's own tables (cuda._tables)."""
    levels = tq.int_levels()
    tables = tq_cuda._tables()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        codes = torch.randint(0, 16, (8,), generator=g).tolist()
        w = sum(c << (4 * i) for i, c in enumerate(codes))
        lo, hi = _levels(w, tables)
        assert lo + hi == [levels[c] - 1 for c in codes]
        # a value word: byte i is position i, low nibble coordinate c, high nibble c + D/2
        ta0, ta1, tb0, tb1 = tables
        x = w ^ 0x88888888
        for t_lo, t_hi, sel in ((ta0, ta1, w), (tb0, tb1, x)):
            r1, r2 = _prmt(t_lo, t_hi, sel), _prmt(t_lo, t_hi, sel >> 16)
            c_part, c2_part = _int8s(_prmt(r1, r2, 0x6420)), _int8s(_prmt(r1, r2, 0x7531))
            ref1 = [_int8s(_prmt(t_lo, t_hi, (sel >> (8 * i)) & 0xF))[0] for i in range(4)]
            ref2 = [_int8s(_prmt(t_lo, t_hi, (sel >> (8 * i + 4)) & 0xF))[0] for i in range(4)]
            assert c_part == ref1 and c2_part == ref2


def build(B, Hkv, D, hist, cap, recent, pos, ring_dtype, g):
    """A cache as the TurboQuant cache holds it after position pos[b] of random history (keys with a mean, so the
    scores have structure), and the fp64 reference's keys and values per sequence."""
    k = torch.randn(B, Hkv, hist, D, generator=g) * 1.5 + 0.4
    v = torch.randn(B, Hkv, hist, D, generator=g) * torch.rand(B, Hkv, hist, 1, generator=g) * 3
    kc, ks = tq.quantize(k)
    vc, vs = tq.quantize(v)
    codes_k = torch.zeros(B, Hkv, cap, D // 2, dtype=torch.uint8)
    codes_v, scale_k, scale_v = codes_k.clone(), torch.zeros(B, Hkv, cap), torch.zeros(B, Hkv, cap)
    ring_k, ring_v = torch.zeros(B, Hkv, recent, D), torch.zeros(B, Hkv, recent, D)
    for b in range(B):
        for j in range(int(pos[b]) + 1):
            s = j % cap
            codes_k[b, :, s], codes_v[b, :, s] = kc[b, :, j], vc[b, :, j]
            scale_k[b, :, s], scale_v[b, :, s] = ks[b, :, j], vs[b, :, j]
            ring_k[b, :, j % recent], ring_v[b, :, j % recent] = tq.rotate(k[b, :, j]), tq.rotate(v[b, :, j])
    d = lambda x: x.cuda()  # noqa: E731
    cache = dict(k_scale=d(scale_k), v_scale=d(scale_v), k_recent=d(ring_k.to(ring_dtype)),
                 v_recent=d(ring_v.to(ring_dtype)))
    return d(codes_k), d(tq.interleave(codes_v)), cache, (k, v, kc, ks, vc, vs)


@gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(16, 2, 256), (32, 8, 128), (9, 3, 64), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 160])
@pytest.mark.parametrize("ring_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_equals_attention_over_the_dequantized_cache(Hq, Hkv, D, window, ring_dtype):
    g = torch.Generator().manual_seed(Hq + D + (window or 0))
    B, recent, hist = 3, 64, 600
    cap = 192 if window else 608
    pos = torch.tensor([599, 40, 333])  # entry 1: every position in the ring; with a window the ring wraps
    kcodes, vcodes, cache, (k, v, kc, ks, vc, vs) = build(B, Hkv, D, hist, cap, recent, pos, ring_dtype, g)
    q = torch.randn(B, Hq, D, generator=g)
    qr = tq.rotate(q)
    scale = D ** -0.5
    args = (qr.cuda(), kcodes, vcodes, pos.cuda().int(), scale)
    assert tq_cuda.applies(args[0], kcodes, vcodes, cache["k_scale"], cache["v_scale"], cache["k_recent"],
                           cache["v_recent"], args[3])
    visible = min(600, window or 600)
    outs = {}
    for splits in (None, 1, 3):
        outs[splits] = at.decode_attention(*args, visible, window=window, splits=splits, **cache).cpu()
    kq, vq = tq.dequantize_rotated(kc, ks), tq.dequantize_rotated(vc, vs)
    for b in range(B):
        p = int(pos[b])
        lo = 0 if window is None else max(0, p - window + 1)
        j = torch.arange(lo, p + 1)
        exact = (p - j < recent)[None, :, None]
        ring = lambda x: tq.rotate(x[b][:, lo:p + 1]).to(ring_dtype).float()  # noqa: E731
        keys = torch.where(exact, ring(k), kq[b][:, lo:p + 1])
        vals = torch.where(exact, ring(v), vq[b][:, lo:p + 1])
        ref = reference(qr[b], keys, vals, scale)
        for splits, o in outs.items():
            err = rel(o[b], ref)
            assert err < 5e-3, (splits, b, err)
    # the same partials as the Triton kernel, through the same merge
    triton_out = at.decode_attention(*args, visible, window=window, cuda_kernel=False, **cache).cpu()
    assert rel(outs[None], triton_out) < 5e-3


@gpu
def test_cuda_kernel_unrotates_and_is_captured_by_a_graph():
    """unrotate through the merge; the launch recorded by a CUDA graph replays with new inputs."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, recent, cap = 2, 16, 2, 256, 64, 4096
    pos = torch.tensor([4095, 1000])
    kcodes, vcodes, cache, _ = build(B, Hkv, D, 4096, cap, recent, pos, torch.bfloat16, g)
    q = tq.rotate(torch.randn(B, Hq, D, generator=g)).cuda()
    posd = pos.cuda()  # int64 positions (the caches pass int32): the kernel reads either
    run = lambda: at.decode_attention(q, kcodes, vcodes, posd, 0.0625, 4096, unrotate=True, **cache)  # noqa: E731
    first = run()
    plain = at.decode_attention(q, kcodes, vcodes, posd, 0.0625, 4096, **cache)
    assert rel(first.cpu(), tq.unrotate(plain.cpu())) < 1e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        q.copy_(tq.rotate(torch.randn(B, Hq, D, generator=g)).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out.cpu(), run().cpu()) < 1e-6


@gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(16, 2, 256), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 160])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cuda_kernel_reads_the_rows_of_a_pool(Hq, Hkv, D, window, index_dtype):
    """Three sequences in rows 3, 0, 2 of a pool of 5, at positions 599 (with a window the ring wraps), 40 (every
    position in the ring) and 0; visible = the capacity; the same partials as the Triton kernel."""
    g = torch.Generator().manual_seed(D + (window or 0))
    P, recent, hist = 5, 64, 600
    cap = 192 if window else 608
    row_pos = torch.tensor([40, 77, 0, 599, 333])  # each pool row's position
    kcodes, vcodes, cache, (k, v, kc, ks, vc, vs) = build(P, Hkv, D, hist, cap, recent, row_pos, torch.bfloat16, g)
    rows = torch.tensor([3, 0, 2])
    pos = row_pos[rows]
    qr = tq.rotate(torch.randn(3, Hq, D, generator=g))
    scale = D ** -0.5
    args = (qr.cuda(), kcodes, vcodes, pos.cuda().to(index_dtype), scale, cap)
    kw = dict(window=window, rows=rows.cuda().to(index_dtype), **cache)
    assert tq_cuda.applies(args[0], kcodes, vcodes, cache["k_scale"], cache["v_scale"], cache["k_recent"],
                           cache["v_recent"], args[3], kw["rows"])
    o = at.decode_attention(*args, **kw).cpu()
    kq, vq = tq.dequantize_rotated(kc, ks), tq.dequantize_rotated(vc, vs)
    for b, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        lo = 0 if window is None else max(0, p - window + 1)
        exact = (p - torch.arange(lo, p + 1) < recent)[None, :, None]
        keys = torch.where(exact, tq.rotate(k[r][:, lo:p + 1]).bfloat16().float(), kq[r][:, lo:p + 1])
        vals = torch.where(exact, tq.rotate(v[r][:, lo:p + 1]).bfloat16().float(), vq[r][:, lo:p + 1])
        assert rel(o[b], reference(qr[b], keys, vals, scale)) < 5e-3, b
    triton_out = at.decode_attention(*args, cuda_kernel=False, **kw).cpu()
    assert rel(o, triton_out) < 5e-3


@gpu
def test_a_captured_decode_step_replays_new_rows_and_positions():
    """A decode step as the engine captures it (append K and V, rotate q, attend with visible = the capacity,
    rotate back), replayed with other rows, positions and inputs written into its tensors: the outputs and the
    whole pool equal an eager run of the same step."""
    from sluice.kernels.turboquant import triton as tqt

    g = torch.Generator().manual_seed(9)
    P, Hq, Hkv, D, recent, cap = 4, 16, 2, 256, 64, 1024
    kcodes, vcodes, cache, _ = build(P, Hkv, D, cap, cap, recent, torch.full((P,), cap - 1), torch.bfloat16, g)
    pool = [kcodes, vcodes, cache["k_scale"], cache["v_scale"], cache["k_recent"], cache["v_recent"]]
    q, k, v = (torch.randn(2, h, D, generator=g).cuda() for h in (Hq, Hkv, Hkv))
    rows, pos = torch.tensor([2, 0], dtype=torch.int32).cuda(), torch.tensor([700, 5], dtype=torch.int32).cuda()

    def step():
        qr = tqt.decode_step_prep(q, k, v, *pool, pos, rows=rows)
        return at.decode_attention(qr, kcodes, vcodes, pos, D ** -0.5, cap, unrotate=True, rows=rows, **cache)

    step()  # compiles, and asks the occupancy, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_rows, new_pos in (([1, 3], [1023, 64]), ([3, 2], [0, 500]), ([0, 1], [63, 1000])):
        rows.copy_(torch.tensor(new_rows))
        pos.copy_(torch.tensor(new_pos))
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g))
        before = [t.clone() for t in pool]
        graph.replay()
        replayed, pool_replayed = out.clone(), [t.clone() for t in pool]
        for t, b in zip(pool, before):
            t.copy_(b)
        eager = step()
        assert rel(replayed.cpu(), eager.cpu()) < 1e-6
        assert all(torch.equal(a, b) for a, b in zip(pool_replayed, pool))
        assert not all(torch.equal(a, b) for a, b in zip(pool, before))  # the step wrote into the pool


def paged(x, table, page, blocks):
    """A cache tensor of rows [B, Hkv, cap, ...] (value codes: [B, Hkv, cap/4, ...]) as blocks [blocks + 1, Hkv,
    page, ...]: row b's block i (table[b, i], unless the scratch block `blocks`) holds its positions i page ..
    (i + 1) page - 1."""
    span = page // 4 if x.dim() == 5 else page
    out = torch.zeros((blocks + 1, *x.shape[1:2], span, *x.shape[3:]), dtype=x.dtype, device=x.device)
    for b in range(x.shape[0]):
        for i, blk in enumerate(table[b].tolist()):
            if blk != blocks:
                out[blk] = x[b, :, i * span:(i + 1) * span]
    return out


@gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(16, 2, 256), (8, 2, 128), (9, 3, 64)])
@pytest.mark.parametrize("page", [32, 256])
@pytest.mark.parametrize("with_rows", [False, True])
def test_cuda_kernel_reads_a_paged_cache(Hq, Hkv, D, page, with_rows):
    """The codes and scales in blocks of `page` positions (256: eight of the kernel's 32-position blocks; 32: a table
    look-up for each), scattered through each row's table row, the ring one per row: the CUDA C kernel and the
    Triton one each give over the blocks what they give over the same cache in rows."""
    g = torch.Generator().manual_seed(D + page)
    B, recent, hist, blocks = 3, 64, 600, 40 * 256 // page
    cap = -(-hist // page) * page
    row_pos = torch.tensor([599, 40, 333])  # entry 1: every position in the ring
    kcodes, vcodes, cache, _ = build(B, Hkv, D, hist, cap, recent, row_pos, torch.bfloat16, g)
    order = torch.randperm(blocks, generator=g).tolist()
    table = torch.full((B + 1, cap // page), blocks, dtype=torch.int32)  # unused entries: the scratch block
    for b in range(B):
        for i in range(int(row_pos[b]) // page + 1):
            table[b, i] = order.pop()
    table = table.cuda()
    blocked = dict(k_scale=paged(cache["k_scale"], table, page, blocks),
                   v_scale=paged(cache["v_scale"], table, page, blocks),
                   k_recent=cache["k_recent"], v_recent=cache["v_recent"])
    kb, vb = paged(kcodes, table, page, blocks), paged(vcodes, table, page, blocks)
    rows = torch.tensor([2, 0, 1]) if with_rows else torch.arange(B)
    qr = tq.rotate(torch.randn(B, Hq, D, generator=g)).cuda()
    pos = row_pos[rows].cuda().int()
    kw = dict(rows=rows.cuda().int()) if with_rows else {}
    assert tq_cuda.applies(qr, kb, vb, blocked["k_scale"], blocked["v_scale"], blocked["k_recent"],
                           blocked["v_recent"], pos, kw.get("rows"), table)
    for cuda_kernel in (True, False):
        for splits in (None, 3):
            ref = at.decode_attention(qr, kcodes, vcodes, pos, D ** -0.5, cap, splits=splits, cuda_kernel=cuda_kernel,
                                      **kw, **cache).cpu()
            out = at.decode_attention(qr, kb, vb, pos, D ** -0.5, cap, splits=splits, cuda_kernel=cuda_kernel,
                                      table=table, **kw, **blocked).cpu()
            # the CUDA C kernel streams the same 32-position blocks either way; the Triton one's tiles stay within a
            # block (of 32: tiles of 32, not 64 or 128), its int8 products quantizing the probabilities per tile
            assert rel(out, ref) < (1e-6 if cuda_kernel or page == 256 else 5e-3), (cuda_kernel, splits)
