"""Triton MoE kernels (router, decode GEMVs, prefill grouped GEMMs, combine) against the torch reference on fresh
random data: tiny shapes under the Triton interpreter on CPU, real shapes on a GPU (benchmarks/moe_gpu.py).

The Triton 3.9 interpreter truncates fp32 -> bf16 stores (about 3x the error of round-to-nearest): the prefill
path, which holds h and the expert outputs in x's dtype, measures ~0.009 there in bf16 (round-to-nearest on a GPU:
expected a few 1e-3), so it is also checked in fp16 and fp32 at tighter bounds."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.moe import reference  # noqa: E402
from sluice.kernels.moe import grouped as mg  # noqa: E402
from sluice.kernels.moe import triton as mt  # noqa: E402
from sluice.kernels.qmatmul import triton as qmm  # noqa: E402
from sluice.quant.affine import QuantizedTensor, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I = 8, 128, 64


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def on_device(qt):
    return QuantizedTensor(*(t.to(DEVICE) for t in (qt.weight, qt.scales, qt.biases)), qt.bits, qt.group_size)


def experts(g, bits, gs_gate_up, gs_down):
    gate_up = quantize(torch.randn(E, 2 * I, H, generator=g) * 0.1, bits, gs_gate_up)
    down = quantize(torch.randn(E, H, I, generator=g) * 0.1, bits, gs_down)
    return gate_up, down


@pytest.mark.parametrize("n_exp,k,norm", [(8, 2, True), (8, 4, False), (512, 10, True), (1000, 16, False)])
def test_route_matches_reference(n_exp, k, norm):
    logits = 2 * torch.randn(37, n_exp, generator=torch.Generator().manual_seed(n_exp + k))
    ids, weights = mt.route(logits.to(DEVICE), k, norm)
    ref_w, ref_ids = reference.route(logits, k, norm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu().long(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=1e-5, atol=1e-7)


def test_route_breaks_ties_towards_the_lower_index():
    logits = torch.zeros(2, E)
    logits[1, 5] = 1.0
    ids, weights = mt.route(logits.to(DEVICE), 3, True)
    assert ids.cpu().tolist() == [[0, 1, 2], [5, 0, 1]]
    torch.testing.assert_close(weights[0].cpu(), torch.full((3,), 1 / 3))


def test_route_adds_the_shared_expert_slot():
    g = torch.Generator().manual_seed(3)
    logits, gate = 2 * torch.randn(5, E, generator=g), torch.randn(5, 1, generator=g)
    ids, weights = mt.route(logits.to(DEVICE), 3, True, gate.to(DEVICE))
    ref_ids, ref_w = mt.route(logits.to(DEVICE), 3, True)
    assert ids.shape == (5, 4) and torch.equal(ids[:, :3], ref_ids) and (ids[:, 3] == E).all()
    assert torch.equal(weights[:, :3], ref_w)
    torch.testing.assert_close(weights[:, 3].cpu(), torch.sigmoid(gate[:, 0]))


@pytest.mark.parametrize("S,n_exp", [(3, E), (6, 1000)])  # 1000 experts: the 6 partials are read 4 at a time
def test_route_adds_split_k_partials(S, n_exp):
    g = torch.Generator().manual_seed(4)
    parts = torch.randn(S, 2, n_exp + 1, generator=g)  # S partial sums of [E logits | shared gate logit]
    ids, weights = mt.route(parts[..., :n_exp].to(DEVICE), 3, True, parts[..., n_exp].contiguous().to(DEVICE))
    ref_ids, ref_w = mt.route(parts.sum(0)[:, :n_exp].to(DEVICE), 3, True, parts.sum(0)[:, n_exp].to(DEVICE))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)


@pytest.mark.parametrize("T,bits,gs", [(1, 4, 64), (3, 8, 32), (2, 2, 64)])
def test_decode_runs_the_shared_expert_as_one_more_slot(T, bits, gs):
    """moe_decode with the shared expert as expert id E (stored apart) equals the reference with the shared
    expert's output computed on its own."""
    g = torch.Generator().manual_seed(T + bits)
    gate_up, down = experts(g, bits, gs, gs)
    sh_gu = quantize(torch.randn(2 * I, H, generator=g) * 0.1, bits, gs)
    sh_down = quantize(torch.randn(H, I, generator=g) * 0.1, bits, gs)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits, gate = 2 * torch.randn(T, E, generator=g), torch.randn(T, generator=g)
    gu = x.float() @ sh_gu.dequantize(torch.float32).T
    shared_out = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ sh_down.dequantize(torch.float32).T
    ref = reference.moe_reference(x, logits, gate_up, down, 2, True, shared_out, gate[:, None])
    ids, weights = mt.route(logits.to(DEVICE), 2, True, gate.to(DEVICE))
    slots = mt.shared_slots(on_device(gate_up), on_device(down), on_device(sh_gu), on_device(sh_down))
    out = mt.moe_decode(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down), shared_expert=slots)
    assert rel_err(out.cpu(), ref) <= 1e-2
    assert mt.shared_slots(gate_up, down, sh_down, sh_gu) is None  # swapped: not stored like a routed expert
    with pytest.raises(ValueError, match="stored like one routed expert"):
        mt.moe_decode(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down),
                      shared_expert=(mt.ExtraExperts(on_device(sh_down), 1, 0, 0),
                                     mt.ExtraExperts(on_device(sh_gu), 1, 0, 0)))
    with pytest.raises(ValueError, match="ExtraExperts"):
        mt.moe_decode(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down),
                      shared_expert=(on_device(sh_gu), on_device(sh_down)))


@pytest.mark.parametrize("T,n,bits,gs,ordered", [(1, 2, 4, 32, False), (3, 3, 2, 32, True), (2, 1, 8, 64, False)])
def test_decode_runs_a_wide_shared_mlp_as_expert_slots(T, n, bits, gs, ordered):
    """A shared MLP of intermediate n*I (DeepSeek's n shared experts), its gate_up rows in slots (`swiglu` with
    `slots`), runs as n more expert slots (ids E..E+n-1, weight 1) of the same launches: the routed experts plus the
    whole MLP, its checkpoint layout. Down's slots are column blocks, rows n*I apart (the routed experts': I); n = 1:
    a shared expert whose down rows lie further apart than the routed experts' (a column slice) reads its own
    strides. 2-bit group 32: the down GEMV's x prepared by `swiglu_prep`."""
    from sluice.layers.moe import swiglu

    g = torch.Generator().manual_seed(T + n + bits)
    gate_up, down = experts(g, bits, gs, gs)
    gate, up = (quantize(torch.randn(n * I, H, generator=g) * 0.1, bits, gs) for _ in range(2))
    sh_down = quantize(torch.randn(H, n * I + (gs if n == 1 else 0), generator=g) * 0.1, bits, gs)
    if n == 1:  # columns 0..I-1 of a wider weight: its own row strides
        words = I * bits // 32
        sh_down = QuantizedTensor(sh_down.weight[:, :words], sh_down.scales[:, :I // gs], sh_down.biases[:, :I // gs],
                                  bits, gs)
        assert sh_down.weight.stride(0) != down.weight.stride(1)
    mlp = swiglu(gate, up, sh_down, slots=n)
    assert mlp.slots == n
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = 2 * torch.randn(T, E, generator=g)
    deq = (lambda qt: qt.dequantize(torch.float32))
    h = torch.nn.functional.silu(x.float() @ deq(gate).T) * (x.float() @ deq(up).T)
    shared_out = h @ deq(sh_down).T
    ref = reference.moe_reference(x, logits, gate_up, down, 2, True, shared_out, torch.full((T, 1), float("inf")))
    torch.testing.assert_close(mlp(x.float()), shared_out, rtol=1e-4, atol=1e-5)  # the module reads its slots too
    # (down as made: the module holds a contiguous copy of the column slice)
    extras = mt.shared_slots(on_device(gate_up), on_device(down), on_device(mlp.gate_up.qt), on_device(sh_down), n)
    assert extras is not None and extras[0].n == n
    assert mt.shared_slots(gate_up, down, mlp.gate_up.qt, sh_down, n + 1) is None
    ids, weights = mt.route(logits.to(DEVICE), 2, True)
    ids = torch.cat([ids, torch.arange(E, E + n, dtype=torch.int32, device=DEVICE).expand(T, n)], 1)
    weights = torch.cat([weights, torch.ones(T, n, device=DEVICE)], 1)
    out = mt.moe_decode(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down), shared_expert=extras,
                        expert_order=ordered)
    assert rel_err(out.cpu(), ref) <= 1e-2
    if n > 1:
        with pytest.raises(ValueError, match="stored like one routed expert"):
            mt.moe_decode(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down),
                          shared_expert=tuple(mt.ExtraExperts(e.qt, 1, 0, 0) for e in extras))


def test_slot_order_is_a_stable_sort_by_expert():
    g = torch.Generator().manual_seed(3)
    for n in (1, 31, 33, 200, 1500):  # 1500: more slots than one compare chunk
        ids = torch.randint(0, 9, (n,), generator=g, dtype=torch.int32)
        order = mt.slot_order(ids.to(DEVICE)).cpu()
        assert order.dtype == torch.int32
        assert torch.equal(order.long(), torch.sort(ids, stable=True).indices)


@pytest.mark.parametrize("T, k, experts_, block_m, count_here", [
    (3, 2, 8, 16, True), (200, 10, 64, 16, True), (200, 10, 64, 16, False), (1100, 8, 32, 128, False)],
    ids=["few", "sorted by slot_order", "counted by a histogram launch", "sorted by torch.sort"])
def test_tile_table_matches_a_sort(T, k, experts_, block_m, count_here, monkeypatch):
    """The grouped GEMMs' table: slots in stable expert order, each expert's first row, and its tiles; the slots
    counted by the table's program itself or by a histogram launch before it."""
    monkeypatch.setattr(mg, "COUNT_IN_TABLE_SLOTS", 10**9 if count_here else 0)
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(experts_, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    table = mg.tile_table(ids.to(DEVICE), mt.expert_order(ids.to(DEVICE)), experts_, block_m)
    order, offsets, tile_expert, tile_row = (t.cpu() for t in table)
    assert torch.equal(order.long(), torch.sort(ids.reshape(-1), stable=True).indices)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts_)
    assert torch.equal(offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    want = [(e, int(offsets[e]) + j * block_m) for e in range(experts_) for j in range(-(-int(counts[e]) // block_m))]
    used = tile_expert < experts_
    assert list(zip(tile_expert[used].tolist(), tile_row[used].tolist())) == want
    assert used[:len(want)].all() and not used[len(want):].any()


@pytest.mark.parametrize("T", [5])
def test_decode_in_expert_order_gives_the_same_bits(T):
    """The GEMV programs launched in expert order compute every slot as before: the same bits, either way (the order
    itself, over several programs: `test_slot_order_is_a_stable_sort_by_expert`)."""
    g = torch.Generator().manual_seed(T)
    gate_up, down = experts(g, 4, 64, 64)
    x = torch.randn(T, H, generator=g).bfloat16().to(DEVICE)
    ids, weights = mt.route((2 * torch.randn(T, E, generator=g)).to(DEVICE), 3, True)
    args = (x, ids, weights, on_device(gate_up), on_device(down))
    assert torch.equal(mt.moe_decode(*args, expert_order=True), mt.moe_decode(*args, expert_order=False))


# (path, tokens, top-k, bits, group size of gate_up, of down, renormalise, shared expert)
CASES = [
    ("decode", 1, 2, 4, 64, 64, True, True),
    ("decode", 3, 4, 8, 32, 64, False, True),
    ("decode", 2, 3, 2, 32, 32, True, False),
    ("prefill", 3, 2, 4, 128, 64, True, True),  # most experts empty: tiles past the table's end exit
    ("prefill", 37, 4, 4, 32, 32, True, True),
    ("prefill", 37, 3, 8, 64, 64, False, False),
    ("prefill", 37, 2, 2, 32, 64, True, True),
]


def run_case(path, T, k, bits, gs_gu, gs_down, norm, shared, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = experts(g, bits, gs_gu, gs_down)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = 2 * torch.randn(T, E, generator=g)
    shared_out = torch.randn(T, H, generator=g).to(dtype) if shared else None
    gate_logit = torch.randn(T, 1, generator=g) if shared else None
    ref = reference.moe_reference(x, logits, gate_up, down, k, norm, shared_out, gate_logit)
    ids, weights = mt.route(logits.to(DEVICE), k, norm)
    run = mt.moe_decode if path == "decode" else mt.moe_prefill
    to = (lambda t: None if t is None else t.to(DEVICE))
    out = run(x.to(DEVICE), ids, weights, on_device(gate_up), on_device(down), to(shared_out), to(gate_logit))
    assert out.dtype == dtype and out.shape == (T, H)
    return rel_err(out.cpu(), ref)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-k{c[2]}-{c[3]}bit-g{c[4]}/{c[5]}" for c in CASES])
def test_moe_matches_reference(case):
    assert run_case(*case, dtype=torch.bfloat16, seed=sum(case[1:6])) <= 1e-2


@pytest.mark.parametrize("block_m, config", [
    (16, mg.GemmConfig(stack=True, prefetch=False)), (32, mg.GemmConfig(32, 128)), (16, mg.GemmConfig(128)),
    (64, mg.GemmConfig(32, 32, stack=True)), (16, mg.GemmConfig(num_stages=2, prefetch=False))],
    ids=["stacked", "two-groups-a-step", "wide", "narrow-stacked", "no-prefetch"])
def test_prefill_configs_match(block_m, config):
    """Every tile shape, stacked gate/up tiles, two groups a K step, scales loaded a step ahead or not: the
    grouped GEMMs give the default's result."""
    g = torch.Generator().manual_seed(11)
    gate_up, down = experts(g, 4, 32, 64)
    x = torch.randn(21, H, generator=g).to(DEVICE)
    ids, weights = mt.route((2 * torch.randn(21, E, generator=g)).to(DEVICE), 3, True)
    args = (x, ids, weights, on_device(gate_up), on_device(down))
    torch.testing.assert_close(mt.moe_prefill(*args, block_m=block_m, gate_up_config=config, down_config=config),
                               mt.moe_prefill(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,bound", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_prefill_tighter_in_fp16_and_fp32(dtype, bound):
    assert run_case("prefill", 37, 4, 4, 64, 32, True, True, dtype=dtype, seed=5) <= bound


def test_moe_picks_decode_or_prefill(monkeypatch):
    """The expert GEMVs up to DECODE_MAX_TOKENS tokens, unless the experts average GROUPED_MIN_ROWS rows: then the
    grouped GEMMs, which read each expert once (Moonlight's 64 experts, top-6, at batch 64; Qwen3-Next's 512, top-10,
    at 128)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(mt, "moe_decode", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(mt, "moe_prefill", lambda *a, **k: calls.append("prefill"))
    for T, k, E in ((mt.DECODE_MAX_TOKENS, 4, 512), (mt.DECODE_MAX_TOKENS + 1, 4, 512), (16, 6, 64), (64, 6, 64)):
        experts = SimpleNamespace(weight=torch.empty(E, 1, 1))
        mt.moe(torch.zeros(T, H), torch.zeros(T, k, dtype=torch.int32), None, experts, None)
    assert calls == ["decode", "prefill", "decode", "prefill"]
    assert mt.gemv_decode(21, 6, 64) and not mt.gemv_decode(22, 6, 64)  # 2 rows an expert: 21 * 6 < 128 <= 22 * 6
    assert mt.gemv_decode(64, 10, 512) and not mt.gemv_decode(128, 10, 512)  # Qwen3-Next: 1.25 and 2.5 rows


@pytest.mark.parametrize("bits,group_size", [(2, 32), (4, 64), (8, 128)])
def test_swiglu_prep_is_prep_x_of_h(bits, group_size):
    g = torch.Generator().manual_seed(bits)
    n = 128 + 2 * (256 // group_size)  # prep_x's planes, scales and group sums (the row padding is left unwritten)
    y = torch.randn(2, 5, 512, generator=g)  # two split-K partials of 5 rows of [gate | up]
    y[:, :, :256] += 50  # gate >= ~90: exp(-g) vanishes against 1, silu(g) = g exactly, so h is exact too
    gate, up = y.sum(0).chunk(2, dim=-1)
    xp = mt.swiglu_prep(y.to(DEVICE), bits, group_size).cpu()
    assert xp.shape == qmm.prep_x(up.to(DEVICE), bits, group_size).shape
    ref = qmm.prep_x((gate * up).to(DEVICE), bits, group_size).cpu()
    assert torch.equal(xp[:, :128], ref[:, :128])  # the int16 planes
    torch.testing.assert_close(xp[:, 128:n].view(torch.float32), ref[:, 128:n].view(torch.float32),
                               rtol=1e-4, atol=1e-5)  # scales and sums (summed in another order)
    y = torch.randn(2, 5, 512, generator=g)  # silu in the general case: the exp may differ by an ulp
    gate, up = y.sum(0).chunk(2, dim=-1)
    xp = mt.swiglu_prep(y.to(DEVICE), bits, group_size).cpu()
    ref = qmm.prep_x((torch.nn.functional.silu(gate) * up).to(DEVICE), bits, group_size).cpu()
    lo = lambda t: ((t.to(torch.int64) & 0xFFFF) ^ 0x8000) - 0x8000  # noqa: E731
    assert (lo(xp[:, :128]) - lo(ref[:, :128])).abs().max() <= 1  # an ulp may move a rounding by one
    assert ((xp[:, :128].to(torch.int64) >> 16) - (ref[:, :128].to(torch.int64) >> 16)).abs().max() <= 1
    torch.testing.assert_close(xp[:, 128:n].view(torch.float32), ref[:, 128:n].view(torch.float32),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 64)])
def test_down_gemv_takes_swiglu_from_the_gate_up_partials(bits, group_size):
    """The down GEMV preparing h = silu(g) * u from the gate_up partials itself (one launch) gives what it gives on
    `swiglu_prep`'s prepared h (two launches): the same products, up to fp32 summation order."""
    g = torch.Generator().manual_seed(bits + group_size)
    _, down = experts(g, bits, 64, group_size)
    down = on_device(down)
    ids = torch.randint(0, E, (6,), generator=g, dtype=torch.int32).to(DEVICE)
    y_gu = torch.randn(2, 6, 2 * I, generator=g).to(DEVICE)  # two split-K partials of 6 slots' [gate | up]
    fused = mt._expert_gemv(y_gu, down, ids, x_div=1, swiglu=True)
    ref = mt._expert_gemv(mt.swiglu_prep(y_gu, bits, group_size), down, ids, x_div=1)
    assert rel_err(fused.sum(0), ref.sum(0)) <= 1e-5


def test_combine_sums_splits_and_gates_the_shared_expert():
    g = torch.Generator().manual_seed(0)
    T, k = 3, 4
    y = torch.randn(2, T * k, H, generator=g)
    weights = torch.rand(T, k, generator=g)
    shared, gate = torch.randn(T, H, generator=g), torch.randn(T, generator=g)
    out = mt.combine(*(t.to(DEVICE) for t in (y, weights)), torch.float32, shared.to(DEVICE), gate.to(DEVICE))
    ref = (weights[:, :, None] * y.sum(0).view(T, k, H)).sum(1) + torch.sigmoid(gate)[:, None] * shared
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_before_launch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, E, generator=g).to(DEVICE)
    for bad, match in ((lambda: mt.route(logits[None, None], 2, True), r"\[T, E\]"),
                       (lambda: mt.route(logits[None].bfloat16(), 2, True), r"fp32 \[S, T, E\] partials"),
                       (lambda: mt.route(logits.int(), 2, True), r"\[T, E\]"),
                       (lambda: mt.route(logits, E + 1, True), "top_k"),
                       (lambda: mt.route(torch.randn(1, 32, device=DEVICE), 17, True), "top_k"),
                       (lambda: mt.route(torch.randn(1, 1025, device=DEVICE), 2, True), "1024 experts")):
        with pytest.raises(ValueError, match=match):
            bad()
    gate_up, down = (on_device(w) for w in experts(g, 4, 32, 32))
    x = torch.randn(2, H, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = mt.route(logits, 2, True)
    three_bit = on_device(quantize(torch.randn(E, H, I, generator=g), 3, 32))
    for args, match in (((x[:, :64], ids, weights, gate_up, down), r"x must be \[T, 128\]"),
                        ((x.int(), ids, weights, gate_up, down), "bf16, fp16 or fp32"),
                        ((x, ids.long(), weights, gate_up, down), "int32"),
                        ((x, ids, weights[:, :1], gate_up, down), "fp32"),
                        ((x, ids, weights, gate_up, three_bit), "3-bit"),
                        ((x, ids, weights, gate_up, gate_up), "down must be"),
                        ((x, ids, weights, gate_up.dequantize(), down), "stacked QuantizedTensor"),
                        ((x, ids, weights, gate_up, down, x), "come together"),
                        ((x, ids, weights, gate_up, down, x[:1], weights[:, 0]), r"shared_out must be")):
        for run in (mt.moe_decode, mt.moe_prefill):
            with pytest.raises(ValueError, match=match):
                run(*args)
    with pytest.raises(ValueError, match="2I"):
        mt.swiglu_prep(torch.randn(1, 2, 63, device=DEVICE), 4, 32)
    with pytest.raises(ValueError, match=r"\[S, 8, H\]"):
        mt.combine(torch.randn(1, 3, H, device=DEVICE), torch.rand(2, 4, device=DEVICE), torch.float32)


def sparse_moe(T, n_exp, hidden, inter, k, quantized_router=False):
    from sluice.layers.linear import Linear
    from sluice.layers.moe import SparseMoE, SwiGLU

    g = torch.Generator().manual_seed(T)
    q = (lambda *shape: quantize(torch.randn(*shape, generator=g) * 0.05, 4, 64))
    shared = SwiGLU(Linear(q(2 * inter, hidden)), Linear(q(hidden, inter)), inter)
    if quantized_router:  # 8-bit, as MLX stores it
        gates = [Linear(quantize(torch.randn(n, hidden, generator=g), 8, 64)) for n in (n_exp, 1)]
    else:
        gates = [Linear(torch.randn(n, hidden, generator=g)) for n in (n_exp, 1)]
    layer = SparseMoE(gates[0], q(n_exp, 2 * inter, hidden), q(n_exp, hidden, inter), k, True, shared, gates[1])
    # fp32 activations: bf16 router logits tie often enough that the two top-k tie-breaks could pick differently
    return layer.to(DEVICE), torch.randn(T, hidden, generator=g).to(DEVICE)


@pytest.mark.parametrize("T,quantized_router,hidden,ordered", [(1, False, H, False), (1, True, H, False),
                                                                (3, True, H, False), (5, False, 64, True)])
def test_sparse_moe_triton_path_matches_its_reference_path(T, quantized_router, hidden, ordered, monkeypatch):
    """A decode batch (up to DECODE_MAX_TOKENS tokens) runs the expert GEMVs with the shared expert as an expert
    slot; `ordered`: in expert order, which takes ORDER_MIN_TOKENS tokens (lowered here: 37 tokens took the
    interpreter 98 s of CI time)."""
    if ordered:
        monkeypatch.setattr(mt, "ORDER_MIN_TOKENS", T)
    layer, x = sparse_moe(T, E, hidden, I, 3, quantized_router)
    assert layer._shared_as_expert(mt) is not None
    out = layer._forward_triton(x, mt).combine()  # called directly: forward picks it on CUDA only
    assert rel_err(out, layer._forward_reference(x)) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SparseMoE picks the kernels on CUDA only")
@pytest.mark.parametrize("T", [1, 3, 64])
def test_sparse_moe_forward_on_cuda_uses_the_kernels(T):
    from sluice.kernels.moe import triton_for

    layer, x = sparse_moe(T, 16, 256, 128, 4)
    assert triton_for(layer.gate_up, layer.down, layer.top_k) is mt
    assert rel_err(layer(x), layer._forward_reference(x)) <= 1e-2


@pytest.mark.parametrize("E", [8, 12])  # 4 experts a rank (the histogram's every bin) and 6
def test_expert_parallel_prefill_computes_its_own_experts_alone(E):
    """Expert parallel over 2 ranks (`SparseMoE.hold`): each rank's grouped GEMMs tile only its own experts (`live`),
    the slots routed to the other's read zeros; the two ranks' outputs sum to the whole layer's."""
    from sluice.layers.linear import Linear
    from sluice.layers.moe import SparseMoE
    from sluice.parallel import TensorParallel

    g = torch.Generator().manual_seed(E)
    H, I, k, T = 128, 64, 3, 8
    gu, dn = (quantize(torch.randn(*s, generator=g) * 0.05, 4, 64) for s in ((E, 2 * I, H), (E, H, I)))
    router = torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    whole = SparseMoE(Linear(router), gu, dn, k, True, None, None).to(DEVICE)
    total = 0
    for rank in range(2):
        tp = TensorParallel(rank, 2, None, expert_parallel=True)
        layer = SparseMoE(Linear(router), *tp.experts(gu, dn, I), k, True, None, None)
        layer.hold(*tp.expert_range(E))
        layer = layer.to(DEVICE)
        ids, w = mt.route(layer.gates(x), k, True)
        gate_up, down, local = layer._experts_for(ids)
        assert int((local == E // 2).sum()) > 0  # some slots are the other rank's
        total = total + mt.moe_prefill(x, local, w, gate_up, down, live=layer.live)
    assert rel_err(total, whole._forward_reference(x)) <= 1e-3


def test_expert_parallel_maps_the_shared_slots_past_its_stack():
    """`SparseMoE.hold`: a routed id held here to its place in the stack, one held elsewhere to the zero expert
    (count), the shared expert's slot ids E + i to count + 1 + i (the expert GEMVs' extra expert i)."""
    from sluice.layers.linear import Linear
    from sluice.layers.moe import SparseMoE

    gate_up, down = experts(torch.Generator().manual_seed(0), 4, 64, 64)
    layer = SparseMoE(Linear(torch.randn(E, H)), gate_up, down, 2, True, None, None)
    layer.hold(4, 4)
    ids = torch.tensor([[0, 5, E, E + 1], [7, 3, E, E + 1]], dtype=torch.int32)
    local = layer._experts_for(ids)[2]
    assert local.dtype == torch.int32 and local.tolist() == [[4, 1, 5, 6], [3, 4, 5, 6]]
