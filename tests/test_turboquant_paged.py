"""The paged TurboQuant cache (`cache/blocks.py`): its kernels (the decode split kernel, the append of a decode step
and of a prefill chunk, the dequantization of a range of positions) read and write codes and scales as blocks through
a block table, the exact ring one per row; each against the same cache laid out in rows. Then the cache itself:
paged and in rows, the same outputs over prefill chunks and decode steps of rows whose blocks interleave, and a
prefix copied. Under the interpreter on the CPU; on a GPU at once."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.attention import triton as at  # noqa: E402
from sluice.kernels.turboquant import reference as tq  # noqa: E402
from sluice.kernels.turboquant import triton as tqt  # noqa: E402
from helpers import rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows_layout(B, Hkv, D, cap, recent, pos, g):
    """A TurboQuant cache in rows after position pos[b] of random history: key codes [B, Hkv, cap, D/2], value codes
    interleaved [B, Hkv, cap/4, D/2, 4], scales [B, Hkv, cap], rings [B, Hkv, recent, D]."""
    k, v = torch.randn(B, Hkv, cap, D, generator=g) + 0.3, torch.randn(B, Hkv, cap, D, generator=g)
    (kc, ks), (vc, vs) = tq.quantize(k), tq.quantize(v)
    codes_k, codes_v = torch.zeros_like(kc), torch.zeros_like(vc)
    scale_k, scale_v = torch.zeros_like(ks), torch.zeros_like(vs)
    ring_k, ring_v = torch.zeros(B, Hkv, recent, D), torch.zeros(B, Hkv, recent, D)
    for b in range(B):
        n = int(pos[b]) + 1
        codes_k[b, :, :n], codes_v[b, :, :n] = kc[b, :, :n], vc[b, :, :n]
        scale_k[b, :, :n], scale_v[b, :, :n] = ks[b, :, :n], vs[b, :, :n]
        for j in range(max(0, n - recent), n):
            ring_k[b, :, j % recent], ring_v[b, :, j % recent] = tq.rotate(k[b, :, j]), tq.rotate(v[b, :, j])
    return [codes_k, tq.interleave(codes_v), scale_k, scale_v, ring_k, ring_v]


def scattered_table(held, page, width, blocks, g):
    """A table [len(held) + 1, width] (the last row scratch) giving row b blocks for its first held[b] positions, in
    a random order of blocks 0 .. blocks - 1; unassigned entries point at the scratch block `blocks`."""
    order = torch.randperm(blocks, generator=g).tolist()
    table = torch.full((len(held) + 1, width), blocks, dtype=torch.int32)
    for b, n in enumerate(held):
        for i in range(-(-n // page)):
            table[b, i] = order.pop()
    return table


def to_blocks(x, table, page, blocks):
    """Rows x [B, Hkv, cap, ...] (or the values' [B, Hkv, cap/4, ...]) as blocks [blocks + 1, Hkv, page, ...]
    through table: row b's block i holds its positions i page .. (i + 1) page - 1; the rest zero."""
    span = page // 4 if x.dim() == 5 else page  # what a block holds along dim 2
    out = torch.zeros((blocks + 1, *x.shape[1:2], span, *x.shape[3:]), dtype=x.dtype)
    for b in range(x.shape[0]):
        for i, blk in enumerate(table[b].tolist()):
            if blk != blocks:
                out[blk] = x[b, :, i * span:(i + 1) * span]
    return out


def to_rows(x, table, page, blocks):
    """Blocks back as rows (but the scratch row): row b's positions from its blocks, zero where it holds none."""
    span = page // 4 if x.dim() == 5 else page
    out = torch.zeros((table.shape[0] - 1, x.shape[1], table.shape[1] * span, *x.shape[3:]), dtype=x.dtype)
    for b in range(out.shape[0]):
        for i, blk in enumerate(table[b].tolist()):
            if blk != blocks:
                out[b, :, i * span:(i + 1) * span] = x[blk]
    return out


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("int8", [0, 2])
def test_turboquant_decode_paged(splits, with_rows, int8):
    """Blocks of 32 positions in a scattered order through each sequence's table row: the split kernel gives what it
    gives over the same cache in rows (the same tiles, the same sums), the rings read per row either way."""
    g = torch.Generator().manual_seed(splits + 10 * int8)
    B, Hq, Hkv, D, recent, page, cap, blocks = 3, 8, 2, 64, 8, 32, 160, 16
    pos = torch.tensor([130, 5, 64])  # entry 1: every position in the ring
    layout = rows_layout(B, Hkv, D, cap, recent, pos, g)
    table = scattered_table([int(p) + 1 for p in pos], page, cap // page, blocks, g)
    paged = [to_blocks(x, table, page, blocks) for x in layout[:4]] + layout[4:]
    q = tq.rotate(torch.randn(B, Hq, D, generator=g))
    rows = torch.tensor([2, 0, 1])  # query i reads row rows[i]
    qq, pp = (q[rows], pos[rows]) if with_rows else (q, pos)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    kw = dict(splits=splits, block_n=16, int8_products=int8, cuda_kernel=False,
              **(dict(rows=d(rows)) if with_rows else {}))

    def attend(codes_k, codes_v, scale_k, scale_v, ring_k, ring_v, **more):
        return at.decode_attention(d(qq), d(codes_k), d(codes_v), d(pp), 0.125, cap, k_scale=d(scale_k),
                                   v_scale=d(scale_v), k_recent=d(ring_k), v_recent=d(ring_v), **{**kw, **more}).cpu()

    assert rel(attend(*paged, table=d(table)), attend(*layout)) < 1e-6
    with pytest.raises(ValueError, match="page"):  # tiles of 64 would straddle blocks of 32
        attend(*paged, table=d(table), block_n=64)


def test_appends_write_through_the_table():
    """decode_step_prep (sequences in rows 2 and 0 at positions 37 and 70) and append_chunk (rows 1 and 2,
    positions 20 .. 69: three blocks of 32) write the codes and scales at (table[row, p // page], p % page) and
    the ring of the row: read back as rows, what the same calls write into the rows layout; the other blocks and
    the scratch block untouched."""
    g = torch.Generator().manual_seed(7)
    P, Hq, Hkv, D, recent, page, cap, blocks = 3, 4, 2, 64, 8, 32, 96, 12
    table = scattered_table([96, 96, 96], page, cap // page, blocks - 3, g)  # blocks 9 .. 11: never handed out
    table[table == blocks - 3] = blocks  # the scratch block
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt)  # noqa: E731
    layout = [z(P, Hkv, cap, D // 2, dt=torch.uint8), z(P, Hkv, cap // 4, D // 2, 4, dt=torch.uint8),
              z(P, Hkv, cap), z(P, Hkv, cap), z(P, Hkv, recent, D), z(P, Hkv, recent, D)]
    paged = [to_blocks(x, table, page, blocks) for x in layout[:4]] + [x.clone() for x in layout[4:]]
    d = lambda xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    rows_dev, paged_dev, tab = d(layout), d(paged), table.to(DEVICE)
    q, k, v = (torch.randn(2, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    rows, pos = torch.tensor([2, 0]).to(DEVICE), torch.tensor([37, 70], dtype=torch.int32).to(DEVICE)
    qr = [tqt.decode_step_prep(*d([q, k, v]), *cache, pos, rows=rows, **kw).cpu()
          for cache, kw in ((rows_dev, {}), (paged_dev, {"table": tab}))]
    assert torch.equal(qr[0], qr[1])
    q, k, v = (torch.randn(2, h, 50, D, generator=g) for h in (Hq, Hkv, Hkv))
    qr = [tqt.append_chunk(*d([q, k, v]), *cache, 1, 20, **kw).cpu()
          for cache, kw in ((rows_dev, {}), (paged_dev, {"table": tab}))]
    assert torch.equal(qr[0], qr[1])
    for x, y in zip(rows_dev[:4], paged_dev[:4]):
        y = y.cpu()
        assert torch.equal(to_rows(y, table, page, blocks), x.cpu())
        assert not y[blocks - 3:].any()  # blocks no row holds, and the scratch block
    for x, y in zip(rows_dev[4:], paged_dev[4:]):
        assert torch.equal(x.cpu(), y.cpu()) and x.any()


@pytest.mark.parametrize("D,interleaved,first,n", [(64, False, 3, 50), (128, True, 0, 64), (64, True, 45, 70)])
def test_dequantize_through_the_table(D, interleaved, first, n):
    """Positions first .. first + n - 1 of each row, read through its table row: bit for bit what the rows layout
    gives."""
    g = torch.Generator().manual_seed(D + n)
    B, Hkv, page, cap, blocks = 2, 3, 32, 128, 9
    codes = torch.randint(0, 256, (B, Hkv, cap, D // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(B, Hkv, cap, generator=g) + 0.1
    stored = tq.interleave(codes) if interleaved else codes
    table = scattered_table([cap] * B, page, cap // page, blocks - 1, g)
    ref = tqt.dequantize(stored.to(DEVICE), scales.to(DEVICE), first, n, torch.float32).cpu()
    out = tqt.dequantize(to_blocks(stored, table, page, blocks).to(DEVICE),
                         to_blocks(scales, table, page, blocks).to(DEVICE), first, n, torch.float32,
                         table=table[:B].to(DEVICE)).cpu()
    assert out.shape == (B, Hkv, n, D) and torch.equal(out, ref)


def test_paged_cache_is_checked():
    from sluice.attention import make_attention
    from sluice.cache.turboquant import TurboQuantKVCache

    with pytest.raises(ValueError, match="sliding-window"):
        TurboQuantKVCache(1, 2, 2, 64, 128, window=16, page=32, blocks=8)
    with pytest.raises(ValueError, match="multiple of 32"):
        TurboQuantKVCache(1, 2, 2, 64, 128, page=48, blocks=8)
    paged = make_attention("turboquant4", 2, 3, 2, 64, 100, torch.float32, "cpu", page=32, blocks=10).cache
    rows = make_attention("turboquant4", 2, 3, 2, 64, 100, torch.float32, "cpu").cache
    assert paged.table is not None and rows.table is None
    assert paged.k_codes.shape == (2, 11, 2, 32, 32) and paged.v_codes.shape == (2, 11, 2, 8, 32, 4)
    assert paged.k_recent.shape == rows.k_recent.shape  # the ring: one per row
    assert paged.capacity == paged.max_positions == 128
    assert (paged.bytes_per_token(), paged.fixed_bytes()) == (rows.bytes_per_token(), rows.fixed_bytes())


@pytest.mark.parametrize("kernel,page", [(False, 32), (True, 64)])  # (CI time: the kernel at one page size)
def test_paged_cache_gives_the_outputs_of_rows(kernel, page):
    """Rows 0, 1, 2 prefilled in chunks taken in turns (their blocks interleave), row 0's first 50 positions then
    copied as row 3's prefix (`copy_prefix`: whole blocks shared, the partial one copied; the ring as row state), rows
    0 and 3 going on apart, then decode steps of all four (blocks handed out in alternating orders): every output of
    the paged cache equals the rows layout's, through the backend's `forward` with the caches' metas, decode steps
    through the split kernel (`kernel`) or row by row through prefill; and the codes read back as rows are the same. A
    prefix copied into another paged cache lands in blocks of its own, the same codes. (The Triton split kernel's tiles
    stay within a block: in blocks of 32 they hold 32 positions, not the rows layout's 64, and its int8 products
    quantize the probabilities per tile: close, not equal.)"""
    from sluice.attention.turboquant import TurboQuantAttention
    from sluice.cache.turboquant import TurboQuantKVCache
    from sluice.engine.batch import ForwardMeta

    g = torch.Generator().manual_seed(11)
    Hq, Hkv, D, cap, blocks, steps = 4, 2, 64, 160, 14, 10
    data = {r: [torch.randn(1, h, cap, D, generator=g) for h in (Hq, Hkv, Hkv)] for r in range(4)}
    data[3] = [torch.cat([a[:, :, :50], b[:, :, 50:]], 2) for a, b in zip(data[0], data[3])]  # row 0's prefix
    make = lambda **kw: TurboQuantKVCache(1, 5, Hkv, D, cap, torch.float32, DEVICE, recent=8, **kw)  # noqa: E731
    rows, paged = make(), make(page=page, blocks=blocks)
    backends = [TurboQuantAttention(c) for c in (rows, paged)]
    for a in backends:
        a.decode_kernel, a.cpu_kernel = kernel, False  # (the C kernel reads rows)
    tol = 3e-4 if kernel and page == 32 and DEVICE == "cpu" else 1e-6 if DEVICE == "cpu" else 1e-5
    d = lambda x: x.to(DEVICE)  # noqa: E731

    def prefill(row, t0, t1):
        assert paged.table.ensure(row, t1)
        paged.table.sync()
        q, k, v = (d(x[:, :, t0:t1]) for x in data[row])
        o = [a.forward(0, q, k, v, ForwardMeta.prefill(row, 1, t0, t1 - t0, DEVICE), 0.125).cpu()
             for a in backends]
        assert rel(o[1], o[0]) < tol, (row, t0)

    for chunks in ([(0, 0, 20), (1, 0, 45), (2, 0, 5)], [(0, 20, 50), (1, 45, 85), (2, 5, 6)]):
        for row, t0, t1 in chunks:
            prefill(row, t0, t1)
    for c in (rows, paged):
        c.copy_prefix(0, 3, 50, c)
        for t in c.row_state():
            t[:, 3].copy_(t[:, 0])
    full = 50 // page  # whole blocks shared, the partial one copied
    assert paged.table.owned[3][:full] == paged.table.owned[0][:full]
    assert all(paged.table.refs[b] == 2 for b in paged.table.owned[0][:full])
    assert paged.table.owned[3][full] != paged.table.owned[0][full]
    other = make(page=page, blocks=blocks)
    paged.copy_prefix(0, 1, 50, other)
    prefill(3, 50, 67)
    prefill(0, 50, 62)
    ends = {0: 62, 1: 85, 2: 6, 3: 67}
    for step in range(steps):
        order = [0, 1, 2, 3] if step % 2 else [3, 2, 1, 0]
        for r in order:
            assert paged.table.ensure(r, ends[r] + 1)
        paged.table.sync()
        pos = [ends[r] for r in order]
        new = [d(torch.stack([data[r][i][0, :, ends[r]] for r in order])[:, :, None]) for i in range(3)]
        o = [a.forward(0, *new, ForwardMeta.decode_host(order, pos, cap, DEVICE), 0.125).cpu() for a in backends]
        assert rel(o[1], o[0]) < tol, step
        for r in order:
            ends[r] += 1
    table = paged.table.host
    for name in ("k_codes", "v_codes", "k_scale", "v_scale"):
        x, y = getattr(rows, name)[0].cpu(), to_rows(getattr(paged, name)[0].cpu(), table, page, blocks)
        for r, n in ends.items():
            n = n // 4 if name == "v_codes" else n
            assert torch.equal(x[r, :, :n], y[r, :, :n]), (name, r)
        z = to_rows(getattr(other, name)[0].cpu(), other.table.host, page, blocks)
        n = 48 // 4 if name == "v_codes" else 50  # (the values: whole groups of four)
        assert torch.equal(z[1, :, :n], y[3, :, :n]), name
    assert len(other.table.owned[1]) == full + 1 and other.table.free_blocks == blocks - full - 1
