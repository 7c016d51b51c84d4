"""The absorbed MLA decode kernel (`kernels/mla/triton.py`) against fp64 attention over the latents and against the
torch reference (`kernels/mla/reference.py`), on fresh random data: several batch / head / latent / rope sizes
(padded ones too), split counts, positions 0 and at the capacity's edge, rows anywhere in the pool (the scratch
row included), fp32 and bf16; the latent cache's decode through the kernel against its per-row path; bad input.
Under the Triton interpreter on the CPU (tiny shapes); on a GPU at once."""

import pytest
import torch

pytest.importorskip("triton")

from sluice.kernels.mla import triton as mt  # noqa: E402
from sluice.kernels.mla.reference import absorbed_attention  # noqa: E402
from helpers import rel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter multiplies in fp32; a GPU takes a bf16 cache's products on bf16 tensor cores (the probabilities
# rounded to bf16, as FlashAttention does) and an fp32 cache's in fp32
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-4, torch.bfloat16: 1e-2}


def latent_reference(q_lat, q_pe, cache, rows, positions, scale):
    """fp64 softmax((q_lat c + q_pe k_pe) scale) c for each query over its row's positions 0..p: [B, H, R]."""
    R = q_lat.shape[-1]
    out = []
    for b in range(q_lat.shape[0]):
        kv = cache[int(rows[b]), :int(positions[b]) + 1].double()
        s = (q_lat[b].double() @ kv[:, :R].T + q_pe[b].double() @ kv[:, R:].T) * scale
        out.append(torch.softmax(s, dim=-1) @ kv[:, :R])
    return torch.stack(out)


def data(B, H, R, P, pool, cap, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(pool, cap, R + P, generator=g).to(dtype)
    q_lat = torch.randn(B, H, R, generator=g).to(dtype)
    q_pe = torch.randn(B, H, P, generator=g).to(dtype)
    return q_lat, q_pe, cache


CASES = [  # B, H, R, P, pool rows, capacity, rows, positions, splits, block_h
    (3, 4, 64, 16, 5, 70, [4, 0, 2], [69, 0, 37], None, None),  # the capacity's edge, position 0, the last row
    (2, 16, 32, 16, 3, 40, [1, 1], [5, 39], 3, None),  # two queries on one row; short rows see few splits
    (1, 20, 32, 16, 2, 48, [1], [47], 2, 16),  # two head blocks, the second part padding
    (4, 2, 48, 8, 6, 33, [5, 3, 0, 2], [32, 16, 1, 31], 1, None),  # R, P not powers of two (padded)
    (5, 3, 32, 16, 8, 64, [7, 6, 2, 0, 4], [63, 31, 32, 0, 17], 7, None),  # splits of 16 past most positions
    (2, 128, 32, 16, 3, 80, [2, 0], [79, 33], None, None),  # DeepSeek-V3's heads: two blocks of 64, planned splits
    (3, 72, 32, 16, 4, 50, [1, 3, 0], [49, 0, 20], 3, None),  # 64 + 8 heads: the second block mostly padding
    (2, 128, 32, 16, 3, 48, [0, 2], [47, 12], 2, 32),  # 128 heads in four blocks of 32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_fp64_attention_over_the_latents(case, dtype):
    B, H, R, P, pool, cap, rows, positions, splits, block_h = case
    q_lat, q_pe, cache = data(B, H, R, P, pool, cap, dtype, seed=B * 100 + H)
    rows, positions = torch.tensor(rows, dtype=torch.int32), torch.tensor(positions)
    scale = 2 / (R + P) ** 0.5  # peaked scores: the softmax weights matter
    d = lambda x: x.to(DEVICE)  # noqa: E731
    o = mt.mla_decode(d(q_lat), d(q_pe), d(cache), d(rows), d(positions), cap, scale, splits=splits, block_n=16,
                      block_h=block_h, min_per_split=16).cpu()
    assert o.dtype == dtype and o.shape == (B, H, R)
    assert not o.isnan().any()
    assert rel(o, latent_reference(q_lat, q_pe, cache, rows, positions, scale)) < TOL[dtype]


@pytest.mark.parametrize("splits,H,page", [(1, 4, 16), (3, 4, 16), (None, 4, 16), (3, 128, 16), (None, 128, 16),
                                          (4, 4, 32)])
def test_kernel_reads_a_paged_cache(splits, H, page):
    """A paged latent cache (`cache/blocks.py`): each row's positions in blocks scattered through the pool by its
    table row; the result of the same positions laid out in rows (few heads, and V3's 128 in blocks of 64). A split
    runs over several blocks (one split), or starts inside one (splits of 16 positions in blocks of 32)."""
    B, R, P, pool, cap = 3, 32, 16, 4, 64
    q_lat, q_pe, cache = data(B, H, R, P, pool, cap, torch.float32, seed=splits or 0)
    rows, positions = torch.tensor([3, 0, 2], dtype=torch.int32), torch.tensor([63, 5, 40])
    blocks = 17
    paged = torch.randn(blocks + 1, page, R + P, generator=torch.Generator().manual_seed(9))
    table = torch.full((pool, cap // page), blocks, dtype=torch.int32)  # unused entries: the scratch block
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    for r, p in zip(rows.tolist(), positions.tolist()):
        for i in range(p // page + 1):
            blk = table[r, i] = order.pop()
            paged[blk] = cache[r, i * page:(i + 1) * page]
    scale = 2 / (R + P) ** 0.5
    d = lambda x: x.to(DEVICE)  # noqa: E731
    o = mt.mla_decode(d(q_lat), d(q_pe), d(paged), d(rows), d(positions), cap, scale, splits=splits, block_n=16,
                      min_per_split=16, table=d(table)).cpu()
    assert rel(o, latent_reference(q_lat, q_pe, cache, rows, positions, scale)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_decode_equals_the_torch_reference(dtype):
    """The folded decode (W_UK into q, the kernel, W_UV on its output) against `absorbed_attention` with its
    position mask, the rows gathered over a loose `visible` (the capacity, as a decode graph passes it)."""
    g = torch.Generator().manual_seed(7)
    B, H, nope, v, R, P, pool, cap = 3, 4, 16, 24, 64, 16, 4, 50
    cache = torch.randn(pool, cap, R + P, generator=g).to(dtype)
    q_nope, q_pe = torch.randn(B, H, nope, generator=g).to(dtype), torch.randn(B, H, P, generator=g).to(dtype)
    w_uk, w_uv = (torch.randn(H, nope, R, generator=g) * 0.1).to(dtype), torch.randn(H, v, R, generator=g).to(dtype)
    rows, positions = torch.tensor([2, 3, 0]), torch.tensor([0, 49, 20], dtype=torch.int32)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    o = mt.absorbed_decode(d(q_nope), d(q_pe), d(cache), d(rows), d(positions), cap, d(w_uk), d(w_uv), 0.2).cpu()
    ref = absorbed_attention(q_nope[:, None].double(), q_pe[:, None].double(), cache[rows].double(),
                             w_uk.double(), w_uv.double(), 0.2, positions[:, None])[:, 0]
    assert o.dtype == dtype and o.shape == (B, H, v)
    assert rel(o, ref) < TOL[dtype]
    # and the torch reference itself, its products rounded to the inputs' dtype (what the CPU and the GPU's torch
    # path run)
    low = absorbed_attention(q_nope[:, None], q_pe[:, None], cache[rows], w_uk, w_uv, 0.2, positions[:, None])[:, 0]
    assert rel(o, low) < 2 * TOL[dtype]


@pytest.mark.parametrize("H,paged", [(128, True), (16, False)])  # (128 heads whole rows: the paged case's path)
def test_real_latent_sizes(H, paged):
    """R = 512, P = 64 (DeepSeek-V3 / Kimi-K2 / Moonlight), bf16, at a tiny context: the default sizes (64 heads a
    program for 128 heads, 16 for 16) and planned splits; paged in blocks of 16 (tiles of 16)."""
    B, R, P, pool, cap = 2, 512, 64, 3, 32
    q_lat, q_pe, cache = data(B, H, R, P, pool, cap, torch.bfloat16, seed=H)
    rows, positions = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([31, 20])
    scale = 1 / (128 + P) ** 0.5  # V3's softmax scale (qk_nope 128 + rope 64)
    table, kv = None, cache
    if paged:
        page = 16
        kv = torch.zeros(pool * cap // page + 1, page, R + P, dtype=torch.bfloat16)
        table = torch.arange(pool * cap // page, dtype=torch.int32).flip(0).reshape(pool, cap // page).contiguous()
        for r in range(pool):
            for i in range(cap // page):
                kv[table[r, i]] = cache[r, i * page:(i + 1) * page]
    d = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    o = mt.mla_decode(d(q_lat), d(q_pe), d(kv), d(rows), d(positions), cap, scale, table=d(table)).cpu()
    assert o.dtype == torch.bfloat16 and o.shape == (B, H, R)
    assert rel(o, latent_reference(q_lat, q_pe, cache, rows, positions, scale)) < TOL[torch.bfloat16]


def test_split_plan():
    """`plan_splits`: programs in whole waves of the resident slots, as few splits as keep them as full, none
    shorter than the shortest split; sizes by head count."""
    for units, visible, slots in ((2, 32768, 132), (32, 32768, 132), (16, 32768, 528), (64, 4096, 528),
                                  (1, 32768, 528), (200, 32768, 132), (4, 100, 132)):
        ns = mt.plan_splits(units, visible, slots, 128)
        assert 1 <= ns and (ns == 1 or visible // ns >= 128)
        n = units * ns
        filled = n / (-(-n // slots) * slots)
        most = max(1, visible // 128)
        assert filled >= 0.95 * max(units * k / (-(-units * k // slots) * slots) for k in range(1, most + 1))
    assert mt.plan_splits(128, 32768, 132, 128) == 1  # V3 at batch 64: one program per (sequence, head block)
    assert mt.plan_splits(32, 32768, 132, 128) == 4  # batch 16: 128 programs of 132 slots
    assert mt.plan_splits(16, 32768, 528, 128) == 32  # 16 heads at batch 16, four programs an SM
    assert mt.default_sizes(16, 512)[0] == 16 and mt.default_sizes(128, 512)[:3] == (64, 64, 8)
    # short launches (splits of the usual length would leave multiprocessors idle): batch 1 over a short context
    assert mt.short_launch(1, 576, 128, 132) and mt.short_launch(2, 4096, 128, 132)
    assert not mt.short_launch(16, 2048, 128, 132) and not mt.short_launch(1, 32768, 128, 132)


def test_a_row_does_not_depend_on_its_batch():
    """Batches that round up to the same power of two plan the same splits: a query's output is bit-equal whether
    it decodes with 2 or with 3 others (a decode step's rows are batch-invariant)."""
    q_lat, q_pe, cache = data(4, 4, 32, 16, 4, 300, torch.float32, seed=11)
    rows, positions = torch.tensor([3, 1, 0, 2]), torch.tensor([299, 150, 7, 64])
    d = lambda x: x.to(DEVICE)  # noqa: E731
    four = mt.mla_decode(d(q_lat), d(q_pe), d(cache), d(rows), d(positions), 300, 0.1, block_n=16).cpu()
    three = mt.mla_decode(d(q_lat[:3]), d(q_pe[:3]), d(cache), d(rows[:3]), d(positions[:3]), 300, 0.1,
                          block_n=16).cpu()
    assert torch.equal(four[:3], three)


def test_a_query_that_sees_nothing_is_zero():
    """A query whose position is -1 (no key) gets 0 from the merge, not NaN."""
    q_lat, q_pe, cache = data(2, 2, 32, 16, 2, 20, torch.float32, seed=5)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    o = mt.mla_decode(d(q_lat), d(q_pe), d(cache), d(torch.tensor([0, 1])), d(torch.tensor([-1, 19])), 20, 0.1,
                      splits=2, block_n=16).cpu()
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert rel(o[1:], latent_reference(q_lat[1:], q_pe[1:], cache, [1], [19], 0.1)) < TOL[torch.float32]


def test_splits_past_the_keys_write_no_output_and_the_merge_reads_none(monkeypatch):
    """A decode graph plans its splits for the whole capacity; the splits past a query's keys write only (max -inf,
    sum 0). The partial outputs start as NaN here: the merge must not read the ones never written."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    q_lat, q_pe, cache = data(2, 4, 32, 16, 3, 128, torch.float32, seed=9)
    rows, positions = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([20, 70])
    d = lambda x: x.to(DEVICE)  # noqa: E731
    monkeypatch.setattr(torch, "empty", nan_empty)
    o = mt.mla_decode(d(q_lat), d(q_pe), d(cache), d(rows), d(positions), 128, 0.1, splits=8, block_n=16,
                      min_per_split=16).cpu()
    monkeypatch.undo()
    assert not o.isnan().any()
    assert rel(o, latent_reference(q_lat, q_pe, cache, rows, positions, 0.1)) < TOL[torch.float32]


@pytest.mark.parametrize("page", [None, 16])
def test_the_latent_cache_decodes_through_the_kernel(page):
    """`MLAAttention.forward`'s batched decode (device rows and positions, a loose `visible`) through the kernel,
    step by step, equals its per-row reference path: two sequences in rows 3 and 1 of a pool of 4; whole rows, or
    paged (blocks of 16 handed to the two rows in turn)."""
    from sluice.attention.mla import MLAAttention
    from sluice.cache.latent import LatentCache
    from sluice.engine.batch import ForwardMeta

    g = torch.Generator().manual_seed(3)
    H, nope, v, R, P, T = 4, 16, 16, 32, 16, 24
    rows, prompts = [3, 1], [9, 4]
    q_nope, q_pe = torch.randn(2, T, H, nope, generator=g), torch.randn(2, T, H, P, generator=g)
    c, k_pe = torch.randn(2, T, R, generator=g), torch.randn(2, T, P, generator=g)
    w_uk, w_uv = torch.randn(H, nope, R, generator=g) * 0.2, torch.randn(H, v, R, generator=g)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    outs = {}
    for kernel in (False, True):
        cache = LatentCache(1, 4, R, P, T, torch.float32, DEVICE, page=page, blocks=None if page is None else 6)
        attention = MLAAttention(cache)
        attention.decode_kernel = kernel
        if page is not None:
            for n in range(page, 2 * page + 1, page):
                for r in rows:
                    assert cache.table.ensure(r, n)
            cache.table.sync()
        for b, (r, n) in enumerate(zip(rows, prompts)):
            cut = lambda x: d(x[b:b + 1, :n])  # noqa: E731
            attention.forward(0, cut(q_nope), cut(q_pe), cut(c), cut(k_pe), ForwardMeta.prefill(r, 1, 0, n, DEVICE),
                              0.3, d(w_uk), d(w_uv))
        steps = []
        for step in range(T - max(prompts)):
            pos = [n + step for n in prompts]
            new = [d(torch.stack([x[b, p] for b, p in enumerate(pos)])[:, None]) for x in (q_nope, q_pe, c, k_pe)]
            meta = ForwardMeta.decode_host(rows, pos, T, DEVICE)
            if kernel:  # as a captured graph runs it: no host rows
                meta.rows_host = meta.positions_host = None
            steps.append(attention.forward(0, *new, meta, 0.3, d(w_uk), d(w_uv)).cpu())
        outs[kernel] = torch.cat(steps, 1)
    assert outs[True].shape == (2, T - max(prompts), H, v)
    assert rel(outs[True], outs[False]) < TOL[torch.float32]


def test_bad_input_raises():
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt)  # noqa: E731
    ql, qp, cache, idx = z(2, 4, 32), z(2, 4, 16), z(3, 20, 48), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="R \\+ P"):
        mt.mla_decode(ql, qp, z(3, 20, 40), idx, idx, 20, 0.1)
    with pytest.raises(ValueError, match="share B and H"):
        mt.mla_decode(ql, z(2, 3, 16), cache, idx, idx, 20, 0.1)
    with pytest.raises(ValueError, match="positions must be"):
        mt.mla_decode(ql, qp, cache, idx, z(2), 20, 0.1)
    with pytest.raises(ValueError, match="rows must be"):
        mt.mla_decode(ql, qp, cache, idx[:1], idx, 20, 0.1)
    with pytest.raises(ValueError, match="visible"):
        mt.mla_decode(ql, qp, cache, idx, idx, 0, 0.1)
    with pytest.raises(ValueError, match="unit last"):
        mt.mla_decode(z(2, 32, 4).transpose(1, 2), qp, cache, idx, idx, 20, 0.1)
    with pytest.raises(ValueError, match="powers of two"):
        mt.mla_decode(ql, qp, cache, idx, idx, 20, 0.1, block_n=24)
