"""The decode kernels on a pool of cache rows, as a batching engine drives them: sequence b of a step lives in cache
row rows[b] of a pool with more rows than the step has sequences, at its own position positions[b] (device
tensors, so a CUDA graph can capture the step), and `visible` is the capacity, not the real positions. Against
fp64 attention over the rows' visible keys (dense; TurboQuant: the dequantized codes, the newest RECENT exact) and
`turboquant.reference`; rows the step does not name must stay untouched. Under the interpreter on CPU; on a GPU
at once (there the TurboQuant split is the CUDA C kernel where it applies)."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.attention import triton as at  # noqa: E402
from sluice.kernels.turboquant import reference as tq  # noqa: E402
from sluice.kernels.turboquant import triton as tqt  # noqa: E402
from helpers import attention_reference as reference, rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2 if DEVICE == "cuda" else 1e-5  # the GPU multiplies on bf16 tensor cores, the interpreter in fp32
TOL_TQ = 5e-3 if DEVICE == "cuda" else 3e-4  # TurboQuant: q and the probabilities to 15 bits (int8 products)
d = lambda x: x.to(DEVICE)  # noqa: E731


def visible_positions(p: int, window: int | None) -> torch.Tensor:
    return torch.arange(0 if window is None else max(0, p - window + 1), p + 1)


@pytest.mark.parametrize("window,positions", [(None, [95, 0, 40]), (24, [70, 0, 23])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dense_decode_reads_the_rows_of_a_pool(window, positions, index_dtype):
    """A pool of 5 rows, the step's 3 sequences in rows 3, 0, 2 (rows 1 and 4 hold other sequences' keys); with a
    window, a ring of `window` slots (position j in slot j % window, wrapped for position 70)."""
    g = torch.Generator().manual_seed(len(positions) + (window or 0))
    P, Hq, Hkv, D = 5, 4, 2, 32
    cap = window or 96
    k, v = torch.randn(P, Hkv, cap, D, generator=g), torch.randn(P, Hkv, cap, D, generator=g)
    q = torch.randn(3, Hq, D, generator=g)
    rows, pos = torch.tensor([3, 0, 2], dtype=index_dtype), torch.tensor(positions, dtype=index_dtype)
    o = at.decode_attention(d(q), d(k), d(v), d(pos), 0.2, visible=cap, window=window, splits=3, block_n=16,
                            rows=d(rows)).cpu()
    for b, (r, p) in enumerate(zip(rows.tolist(), positions)):
        slots = visible_positions(p, window) % cap
        assert rel(o[b], reference(q[b], k[r][:, slots], v[r][:, slots], 0.2)) < TOL, b


def test_dense_decode_without_rows_reads_row_b():
    """rows=None: query b reads row b (the batch dims equal), as rows = 0..B-1 does."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, cap = 3, 4, 2, 32, 64
    k, v = torch.randn(B, Hkv, cap, D, generator=g), torch.randn(B, Hkv, cap, D, generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    pos = d(torch.tensor([63, 0, 17]))
    o = at.decode_attention(d(q), d(k), d(v), pos, 0.2, visible=cap, splits=2, block_n=16).cpu()
    with_rows = at.decode_attention(d(q), d(k), d(v), pos, 0.2, visible=cap, splits=2, block_n=16,
                                    rows=d(torch.arange(B))).cpu()
    assert torch.equal(o, with_rows)
    for b, p in enumerate(pos.tolist()):
        assert rel(o[b], reference(q[b], k[b, :, :p + 1], v[b, :, :p + 1], 0.2)) < TOL


def turboquant_pool(P, Hkv, D, cap, recent, g):
    """Random codes (not zeros: every row holds something), scales and exact rings: (kernel tensors on DEVICE, the
    codes of keys and values row by row [P, Hkv, cap, D/2] on the CPU)."""
    codes = torch.randint(0, 256, (2, P, Hkv, cap, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(2, P, Hkv, cap, generator=g) + 0.1
    ring = torch.randn(2, P, Hkv, recent, D, generator=g)
    cache = {"k_scale": d(scales[0]), "v_scale": d(scales[1]), "k_recent": d(ring[0]), "v_recent": d(ring[1])}
    return d(codes[0]), d(tq.interleave(codes[1])), cache


def turboquant_reference(q, kc, vc, cache, row, p, window, recent):
    """fp64 attention of q [Hq, D] (rotated; scale D^-1/2) over row `row` at position p: key j exact from the ring
    (slot j % recent) when p - j < recent, else dequantized from the codes at slot j % cap."""
    cap = kc.shape[2]
    j = visible_positions(p, window)
    exact = (p - j < recent)[None, :, None]
    ks, vs, kr, vr = (cache[n].cpu()[row] for n in ("k_scale", "v_scale", "k_recent", "v_recent"))
    vcodes = tq.deinterleave(vc.cpu())[row]
    keys = torch.where(exact, kr[:, j % recent], tq.dequantize_rotated(kc.cpu()[row][:, j % cap], ks[:, j % cap]))
    vals = torch.where(exact, vr[:, j % recent], tq.dequantize_rotated(vcodes[:, j % cap], vs[:, j % cap]))
    return reference(q, keys, vals, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("D,window,positions", [(64, None, [95, 0, 5, 40]), (32, 24, [0, 70, 9, 31])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_turboquant_decode_reads_the_rows_of_a_pool(D, window, positions, index_dtype):
    """4 sequences in rows 3, 0, 2, 5 of a pool of 6, at position 0, inside the recent ring (< 8), and beyond it;
    with a window, a ring of 32 slots (the cache's capacity in 32s) wrapped for position 70; visible = capacity."""
    g = torch.Generator().manual_seed(D + (window or 0))
    P, Hq, Hkv, recent = 6, 4, 2, 8
    cap = 32 if window else 96
    kc, vc, cache = turboquant_pool(P, Hkv, D, cap, recent, g)
    q = torch.randn(len(positions), Hq, D, generator=g)
    rows, pos = torch.tensor([3, 0, 2, 5], dtype=index_dtype), torch.tensor(positions, dtype=index_dtype)
    o = at.decode_attention(d(q), kc, vc, d(pos), D ** -0.5, visible=cap, window=window, splits=3, block_n=16,
                            rows=d(rows), **cache).cpu()
    for b, (r, p) in enumerate(zip(rows.tolist(), positions)):
        assert rel(o[b], turboquant_reference(q[b], kc, vc, cache, r, p, window, recent)) < TOL_TQ, b
    # rows=None on the pool's first rows: row b
    first = at.decode_attention(d(q), kc, vc, d(pos), D ** -0.5, visible=cap, window=window, splits=3, block_n=16,
                                **cache).cpu()
    for b, p in enumerate(positions):
        assert rel(first[b], turboquant_reference(q[b], kc, vc, cache, b, p, window, recent)) < TOL_TQ, b


@pytest.mark.parametrize("interleaved,index_dtype", [(False, torch.int32), (True, torch.int64)])
def test_quantize_append_writes_each_sequence_into_its_row_and_slot(interleaved, index_dtype):
    """Sequence b's vector goes to slot positions[b] % cap of row rows[b] (a ring wraps: position 37 in 32 slots)
    and to ring slot positions[b] % R; nothing else in the pool changes."""
    g = torch.Generator().manual_seed(int(interleaved))
    P, Hkv, D, cap, R = 5, 2, 32, 32, 8
    x = torch.randn(3, Hkv, D, generator=g) * 2 + 0.3
    rows, pos = torch.tensor([4, 1, 2], dtype=index_dtype), torch.tensor([37, 0, 12], dtype=index_dtype)
    codes = torch.randint(0, 256, (P, Hkv, cap, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales, ring = torch.rand(P, Hkv, cap, generator=g) + 0.1, torch.randn(P, Hkv, R, D, generator=g)
    stored = d(tq.interleave(codes) if interleaved else codes)
    kscales, kring = d(scales), d(ring)
    tqt.quantize_append(d(x), stored, kscales, kring, d(pos), rows=d(rows))
    out = tq.deinterleave(stored.cpu()) if interleaved else stored.cpu()
    ref_codes, ref_scale = tq.quantize(x)
    written = torch.zeros(P, cap, dtype=torch.bool)
    written_ring = torch.zeros(P, R, dtype=torch.bool)
    for b, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        assert (tq.unpack(out[r, :, p % cap]) == tq.unpack(ref_codes[b])).double().mean() > 0.99
        assert rel(kscales.cpu()[r, :, p % cap], ref_scale[b]) < 1e-3
        assert rel(kring.cpu()[r, :, p % R], tq.rotate(x[b])) < 1e-5
        written[r, p % cap], written_ring[r, p % R] = True, True
    assert torch.equal(out.permute(0, 2, 1, 3)[~written], codes.permute(0, 2, 1, 3)[~written])
    assert torch.equal(kscales.cpu().permute(0, 2, 1)[~written], scales.permute(0, 2, 1)[~written])
    assert torch.equal(kring.cpu().permute(0, 2, 1, 3)[~written_ring], ring.permute(0, 2, 1, 3)[~written_ring])


def test_decode_step_prep_then_attention_on_a_pool():
    """One decode step as the TurboQuant cache takes it: append k and v at (rows, positions), rotate q, attend
    with visible = capacity. The new key is the newest exact one of its row; rows the step does not name keep
    their contents; without rows, row b."""
    g = torch.Generator().manual_seed(2)
    P, Hq, Hkv, D, cap, recent = 4, 4, 2, 64, 64, 8
    kc, vc, cache = turboquant_pool(P, Hkv, D, cap, recent, g)
    before = [t.clone() for t in (kc, vc, *cache.values())]
    q, k, v = (torch.randn(2, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    rows, pos = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([50, 3], dtype=torch.int32)
    qr = tqt.decode_step_prep(d(q), d(k), d(v), kc, vc, *cache.values(), d(pos), rows=d(rows))
    assert rel(qr.cpu(), tq.rotate(q)) < 1e-5
    for b, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        assert rel(cache["k_recent"].cpu()[r, :, p % recent], tq.rotate(k[b])) < 1e-5
        assert rel(cache["v_recent"].cpu()[r, :, p % recent], tq.rotate(v[b])) < 1e-5
        for x, codes, scales in ((k[b], kc.cpu(), cache["k_scale"]), (v[b], tq.deinterleave(vc.cpu()),
                                                                      cache["v_scale"])):
            ref_codes, ref_scale = tq.quantize(x)
            assert (codes[r, :, p] == ref_codes).double().mean() > 0.99
            assert rel(scales.cpu()[r, :, p], ref_scale) < 1e-3
    for now, was in zip((kc, vc, *cache.values()), before):
        assert torch.equal(now[[1, 3]].cpu(), was[[1, 3]].cpu())
    o = at.decode_attention(qr, kc, vc, d(pos), D ** -0.5, visible=cap, splits=2, block_n=16, rows=d(rows),
                            **cache).cpu()
    for b, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        assert rel(o[b], turboquant_reference(qr[b].cpu(), kc, vc, cache, r, p, None, recent)) < TOL_TQ, b
    # without rows: sequence b in row b
    tqt.decode_step_prep(d(q), d(k), d(v), kc, vc, *cache.values(), d(pos))
    for b, p in enumerate(pos.tolist()):
        assert rel(cache["k_recent"].cpu()[b, :, p % recent], tq.rotate(k[b])) < 1e-5


def test_bad_rows_raise():
    q = torch.randn(2, 4, 32, device=DEVICE)
    k = torch.randn(3, 2, 16, 32, device=DEVICE)
    pos = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="rows must be"):
        at.decode_attention(q, k, k, pos, 1.0, 16, rows=torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="rows must be"):
        at.decode_attention(q, k, k, pos, 1.0, 16, rows=torch.tensor([0.0, 1.0], device=DEVICE))
    with pytest.raises(ValueError, match="no `rows`"):
        at.decode_attention(q, k[:1], k[:1], pos, 1.0, 16)
    codes = torch.zeros(1, 2, 16, 16, dtype=torch.uint8, device=DEVICE)
    scales, ring = torch.zeros(1, 2, 16, device=DEVICE), torch.zeros(1, 2, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="positions must be"):
        tqt.quantize_append(q[:, :2], codes, scales, ring, pos[:1], rows=pos)
    with pytest.raises(ValueError, match="no `rows`"):
        tqt.quantize_append(q[:, :2], codes, scales, ring, pos)
