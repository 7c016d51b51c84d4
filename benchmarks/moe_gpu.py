"""Sparse MoE block on the GPU: our Triton kernels vs the memory-bandwidth floor (decode) and cuBLAS bf16 (prefill).

    python -m benchmarks run moe_gpu [--json out.json] [--decode-only] [--chain-only] [--quick] [--gemv-sweep]
        [--prefill-only]

One run, at Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B shapes (4-bit g64 experts and shared expert; router and
shared-expert gate 8-bit g64 or bf16), random weights built directly in the packed layout:
- correctness against the fp32 torch reference (kernels/moe/reference.py): router ids, decode (T = 1, 4) and
  prefill (T = 4096), the experts given the reference's ids (bf16 logits tie; the router is checked on its own);
- decode, one token: the whole SparseMoE layer (router -> top-k -> expert GEMVs -> combine, shared expert and its
  gate included) under CUDA-graph replay, rotating over enough layer copies to exceed L2 ~4x: the multi-launch
  decode and variants of it that differ by one setting (each checked against the reference first); the floor is
  the bytes that must be read (k experts, shared expert, router, shared gate) over the measured copy bandwidth
  (the one-launch decode measured here until 2026-11-25 lost and was deleted; git keeps it);
- the multi-launch decode's critical path: graph time of its first n launches (with --chain-only: only this);
- --quick: the chain, the checks and the decode table only;
- --gemv-sweep: the chain and the expert GEMVs' launch sweep only;
- --prefill-only: the prefill sweep only (--prefill-tokens T1,T2,...: at these token counts): each grouped GEMM on its
  own over tile configurations, then the experts at the defaults beside every expert dequantized to bf16 then
  torch._grouped_mm, and torch._grouped_mm on bf16 weights held, and the floor (the hit experts' bytes or FLOPs,
  whichever is longer);
- (not with --decode-only) the multi-launch kernels: router and expert GEMV checks, their launch sweep;
- routed experts at T = 1, 4, 16: decode GEMVs vs prefill grouped GEMMs (where to switch);
- prefill, T = 4096: routed experts (a small block-size sweep; effective TFLOP/s vs cuBLAS bf16 GEMMs of the same
  FLOPs, [T*k, H] x [H, 2I] and [T*k, I] x [I, H]: an optimistic grouped-GEMM estimate) and the whole layer.
Each case runs in try/except: an error is printed and recorded and the run goes on. Table printed last.
"""

from __future__ import annotations

import functools
import traceback

import torch

from sluice.kernels.moe import grouped as mg
from sluice.kernels.moe import reference
from sluice.kernels.moe import triton as mt
from sluice.kernels.qmatmul import triton as qmm
from sluice.layers.linear import Linear
from sluice.layers.moe import SparseMoE, SwiGLU
from sluice.quant.affine import QuantizedTensor

from .gpu import (
    bf16_gemm_rate,
    copies_for,
    copy_bandwidth,
    events_time,
    graph_time,
    qt_bytes,
    random_qt,
    rel_err,
    start_run,
)

MODELS = {  # name: (hidden, experts, expert intermediate, top-k, shared intermediate)
    "Qwen3-Next-80B-A3B": (2048, 512, 512, 10, 512),
    "Qwen3.5-397B-A17B": (4096, 512, 1024, 10, 1024),
}
ROUTERS = ("8-bit", "bf16")
PREFILL_T = 4096
G = mg.GemmConfig  # (block_n, block_k, num_warps, num_stages, stack, prefetch)
# the --prefill-only sweep: per rows an expert averages, block_m and each GEMM's configs (the first one the
# reference of the others' results)
SWEEP_TALL = {"gate_up": [G(), G(prefetch=False), G(num_stages=4), G(128, num_warps=8, stack=True, prefetch=False)],
              "down": [G(128, num_stages=4), G(128), G(), G(128, num_warps=8)]}
SWEEP_SHORT = {"gate_up": [G(stack=True, prefetch=False), G(), G(128, stack=True, prefetch=False)],
               "down": [G(), G(prefetch=False), G(128)]}


def prefill_sweep(T, k, E):
    rows = T * k / E
    if rows >= 64:
        return [(128, g, SWEEP_TALL[g]) for g in SWEEP_TALL]
    if rows >= 24:
        return [(64, g, SWEEP_TALL[g]) for g in SWEEP_TALL]
    return [(16, g, SWEEP_SHORT[g]) for g in SWEEP_SHORT]


BF16 = torch.bfloat16


def stacked_qt(E, N, K, bits=4, gs=64):
    qt = random_qt(E * N, K, bits, gs)
    return QuantizedTensor(*(t.view(E, N, -1) for t in (qt.weight, qt.scales, qt.biases)), bits, gs)


def linear_bytes(lin):
    return qt_bytes(lin.qt) if lin.quantized else lin.weight.nbytes


def build_layers(H, E, I, k, Is):
    """One layer per router kind, sharing the experts and the shared expert."""
    gate_up, down = stacked_qt(E, 2 * I, H), stacked_qt(E, H, I)
    shared = SwiGLU(Linear(random_qt(2 * Is, H)), Linear(random_qt(H, Is)), Is)
    quant = lambda N: Linear(random_qt(N, H, 8, 64))
    dense = lambda N: Linear(torch.randn(N, H, device="cuda", dtype=BF16) * 0.02)
    return {kind: SparseMoE(make(E), gate_up, down, k, True, shared, make(1))
            for kind, make in (("8-bit", quant), ("bf16", dense))}


def decode_floor_bytes(layer, k):
    E = layer.num_experts
    experts = k * (qt_bytes(layer.gate_up) + qt_bytes(layer.down)) / E
    shared = linear_bytes(layer.shared.gate_up) + linear_bytes(layer.shared.down)
    return experts + shared + sum(linear_bytes(p) for p in getattr(layer.gates, "parts", [layer.gates]))


def case(res, what, fn):
    """Run one benchmark case; an error is printed and recorded, never fatal."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a benchmark run must reach the end
        msg = f"{what}: {type(e).__name__}: {e}"
        print(f"ERROR {msg}\n{traceback.format_exc(limit=3)}", flush=True)
        res["errors"].append(msg)


def check_correctness(res, name, layer, H, E, k):
    gate_up, down = layer.gate_up, layer.down
    for T in (1, 4, PREFILL_T):
        x = torch.randn(T, H, device="cuda", dtype=BF16)
        logits = torch.randn(T, E, device="cuda")  # fp32: no ties, the router must agree exactly
        shared, gate = torch.randn(T, H, device="cuda", dtype=BF16), torch.randn(T, 1, device="cuda")
        ref = reference.moe_reference(x, logits, gate_up, down, k, True, shared, gate)
        ref_w, ref_ids = reference.route(logits, k, True)
        ids, w = mt.route(logits, k, True)
        out = mt.moe(x, ref_ids.int(), ref_w, gate_up, down, shared, gate)
        row = {"model": name, "T": T, "path": "decode" if T <= mt.DECODE_MAX_TOKENS else "prefill",
               "rel_err": rel_err(out, ref), "router_ids_equal": bool(torch.equal(ids.long(), ref_ids)),
               "router_w_max_diff": float((w - ref_w).abs().max())}
        row["ok"] = row["rel_err"] <= 1e-2 and row["router_ids_equal"]
        res["correctness"].append(row)
        print(f"check {name} T={T} ({row['path']}): rel err {row['rel_err']:.2e}, router ids equal "
              f"{row['router_ids_equal']}, {'ok' if row['ok'] else 'FAILED'}", flush=True)


def check_layer(res, name, layers, k):
    """The layer's decode path at the real shape against its reference path (fp32 x: no router near-ties)."""
    for kind in ROUTERS:
        layer = layers[kind][0]
        x = torch.randn(1, layer.gate_up.shape[2], device="cuda")
        ref = layer._forward_reference(x)
        row = {"model": name, "T": 1, "path": f"multi-launch, {kind} router", "rel_err": rel_err(layer(x), ref)}
        row["ok"] = row["rel_err"] <= 1e-2
        res["correctness"].append(row)
        print(f"check {name} multi-launch ({kind} router): rel err {row['rel_err']:.2e}, "
              f"{'ok' if row['ok'] else 'FAILED'}", flush=True)


def time_decode(res, name, layers, k, copy_bw):
    """The whole layer for one token, each call on its own layer copy (cold L2): the multi-launch decode (the
    variants it was measured against, commit 0fab2e5, are in docs/PERF.md)."""
    for kind in ROUTERS:
        rot = layers[kind]
        xs = [torch.randn(1, rot[0].gate_up.shape[2], device="cuda", dtype=BF16) for _ in rot]
        calls = [lambda m=m, x=x: m(x) for m, x in zip(rot, xs)]
        nbytes = decode_floor_bytes(rot[0], k)
        floor = nbytes / copy_bw
        row = {"model": name, "router": kind, "floor_bytes": nbytes, "floor_us": floor * 1e6, "copies": len(rot)}
        row["multi-launch us"] = graph_time(calls) * 1e6
        res["decode"].append(row)
        print(f"decode {name} router {kind}: floor {row['floor_us']:.1f} us; " + "; ".join(
            f"{key} {v:.1f} ({floor * 1e6 / v * 100:.0f}%)" for key, v in row.items() if key.endswith(" us")),
            flush=True)


CHAIN = ["router GEMV (x prepared in it)", "route (top-k)", "x prep (4-bit)", "gate_up GEMV", "SwiGLU prep",
         "down GEMV", "combine"]


def chain_prefix(m, x, k, n):
    """The first n launches of the multi-launch decode of layer m (8-bit router), as SparseMoE runs them."""
    g = m.gates.qt
    logits = qmm.qgemv_partials(x, g)
    if n == 1:
        return
    E = m.num_experts
    ids, w = mt.route(logits[..., :E], k, True, logits[..., E])
    if n == 2:
        return
    extra = m._shared_as_expert(mt)
    xp = qmm.prep_x(x, m.gate_up.bits, m.gate_up.group_size)
    if n == 3:
        return
    y_gu = mt._expert_gemv(xp, m.gate_up, ids.view(-1), k + 1, extra[0])
    if n == 4:
        return
    hp = mt.swiglu_prep(y_gu, m.down.bits, m.down.group_size)
    if n == 5:
        return
    y = mt._expert_gemv(hp, m.down, ids.view(-1), 1, extra[1])
    if n == 6:
        return
    mt.combine(y, w, x.dtype)


def chain_ablation(res, name, layers, k):
    """Where the multi-launch decode's time goes: graph time of its first n launches, n = 1..8 (cold L2, PDL as
    in the layer); the increments are each launch's cost on the critical path."""
    rot = layers["8-bit"]
    xs = [torch.randn(1, rot[0].gate_up.shape[2], device="cuda", dtype=BF16) for _ in rot]
    prev = 0.0
    for n in range(1, len(CHAIN) + 1):
        calls = [lambda m=m, x=x, n=n: chain_prefix(m, x, k, n) for m, x in zip(rot, xs)]
        row = {"model": name, "launches": n, "last": CHAIN[n - 1]}
        case(res, f"{name} chain {n}", lambda row=row, calls=calls: row.update(us=graph_time(calls) * 1e6))
        row["added_us"] = row.get("us", float("nan")) - prev
        prev = row.get("us", prev)
        res["chain"].append(row)
        print(f"chain {name} {n} launches (+ {row['last']}): {row.get('us', float('nan')):.1f} us "
              f"(+{row['added_us']:.1f})", flush=True)
    full = graph_time([lambda m=m, x=x: m(x) for m, x in zip(rot, xs)]) * 1e6
    res["chain"].append({"model": name, "launches": "layer", "us": full})
    print(f"chain {name} the layer itself: {full:.1f} us", flush=True)


# expert GEMV launches swept: (block_n, num_warps)
EXPERT_GEMV_CONFIGS = [(bn, w) for bn in (4, 8, 16) for w in (1, 2)]


def sweep_decode_launches(res, name, layers, k, route_too=True):
    """Launch options of the decode kernels at this model's shape (one token, k experts + the shared one):
    the two expert GEMVs (rows per program x warps) and the router kernel (warps). Each GEMV timing is also given
    as % of copy bandwidth for its bytes."""
    rot = layers["8-bit"]
    xs = [torch.randn(1, rot[0].gate_up.shape[2], device="cuda", dtype=BF16) for _ in rot]
    routed = [m._route_with_shared_slot(x, mt) for m, x in zip(rot, xs)]
    extras = [m._shared_as_expert(mt) for m in rot]
    xps = [qmm.prep_x(x, m.gate_up.bits, m.gate_up.group_size) for m, x in zip(rot, xs)]
    ys = [mt._expert_gemv(xp, m.gate_up, r[0].view(-1), k + 1, e[0]) for m, xp, r, e in zip(rot, xps, routed, extras)]
    hps = [mt.swiglu_prep(y, m.down.bits, m.down.group_size) for m, y in zip(rot, ys)]
    copy_bw = res.get("copy_bandwidth_Bps")
    for proj, xin, x_div in (("gate_up", xps, k + 1), ("down", hps, 1)):
        nbytes = (k + 1) * qt_bytes(getattr(rot[0], proj)) / rot[0].num_experts
        for bn, w in EXPERT_GEMV_CONFIGS:
            calls = [lambda m=m, xp=xp, r=r, e=e, bn=bn, w=w, proj=proj, x_div=x_div:
                     mt._expert_gemv(xp, getattr(m, proj), r[0].view(-1), x_div, e[0 if proj == "gate_up" else 1],
                                     block_n=bn, num_warps=w)
                     for m, xp, r, e in zip(rot, xin, routed, extras)]
            row = {"model": name, "kernel": f"{proj} GEMV", "block_n": bn, "num_warps": w, "bytes": nbytes}
            case(res, f"{name} sweep {row}", lambda row=row, calls=calls: row.update(us=graph_time(calls) * 1e6))
            if "us" in row and copy_bw:
                row["pct_copy"] = nbytes / (row["us"] * 1e-6) / copy_bw * 100
            res["sweep"].append(row)
            print(f"sweep {row}", flush=True)
    if not route_too:
        return
    logits = [torch.randn(1, rot[0].num_experts, device="cuda") for _ in rot]
    for w in (1, 2, 4, 8):
        calls = [lambda lg=lg, w=w: mt.route(lg, k, True, lg[:, 0], num_warps=w) for lg in logits]
        row = {"model": name, "kernel": "route", "num_warps": w}
        case(res, f"{name} sweep {row}", lambda row=row, calls=calls: row.update(us=graph_time(calls) * 1e6))
        res["sweep"].append(row)


def time_crossover(res, name, layers, H, E, k):
    rot = layers["8-bit"]
    for T in (1, 4, 16):
        xs = [torch.randn(T, H, device="cuda", dtype=BF16) for _ in rot]
        routed = [mt.route(torch.randn(T, E, device="cuda"), k, True) for _ in rot]
        row = {"model": name, "T": T, "decode_us": float("nan"), "prefill_us": float("nan")}
        res["crossover"].append(row)
        for path, fn in (("decode", mt.moe_decode), ("prefill", mt.moe_prefill)):
            calls = [lambda m=m, x=x, r=r, fn=fn: fn(x, *r, m.gate_up, m.down) for m, x, r in zip(rot, xs, routed)]
            case(res, f"{name} experts T={T} {path}",
                 lambda row=row, path=path, calls=calls: row.update({f"{path}_us": graph_time(calls) * 1e6}))
        print(f"experts {name} T={T}: decode GEMVs {row['decode_us']:.1f} us, grouped GEMMs "
              f"{row['prefill_us']:.1f} us", flush=True)


def dequantize_stacked(qt) -> torch.Tensor:
    """Stacked experts [E, N, K] 4-bit -> bf16 [E, N, K], one dequantize launch."""
    E, N = qt.weight.shape[:2]
    flat = QuantizedTensor(qt.weight.reshape(E * N, -1), qt.scales.reshape(E * N, -1), qt.biases.reshape(E * N, -1),
                           qt.bits, qt.group_size)
    return qmm.dequantize(flat, BF16).view(E, N, -1)


def grouped_mm_experts(x, ids, w, gate_up, down):
    """The routed experts through torch._grouped_mm (CUTLASS on sm_90) on bf16 weights gate_up [E, 2I, H] and
    down [E, H, I]: slots sorted by expert on the device, SwiGLU, weighted scatter-add; the alternative #29 asks to
    compare."""
    T, k = ids.shape
    E = gate_up.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=ids.device, dtype=sorted_ids.dtype),
                              out_int32=True)
    tok = order // k
    h = torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(g) * u, down.transpose(1, 2), offs=offs)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    return out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None]).to(x.dtype)


def time_alternatives(res, row, x, ids, w, layer):
    """Beside the grouped GEMM: dequantize every expert to bf16 then torch._grouped_mm (the dequantization timed
    too: the weights live in 4 bits), and torch._grouped_mm alone on bf16 weights held (4x the memory; a bound).
    Both also check moe_prefill's result."""
    ref = mt.moe_prefill(x, ids, w, layer.gate_up, layer.down).float()
    gu, dn = dequantize_stacked(layer.gate_up), dequantize_stacked(layer.down)
    err = rel_err(grouped_mm_experts(x, ids, w, gu, dn).float(), ref)
    row["rel_err_vs_grouped_mm"] = err
    if err > 1e-2:
        raise AssertionError(f"torch._grouped_mm experts: rel err {err:.2e} against moe_prefill")
    row["dequant_grouped_mm_us"] = events_time(lambda: grouped_mm_experts(
        x, ids, w, dequantize_stacked(layer.gate_up), dequantize_stacked(layer.down)), reps=5, lead=True) * 1e6
    row["grouped_mm_bf16_us"] = events_time(lambda: grouped_mm_experts(x, ids, w, gu, dn), reps=5, lead=True) * 1e6
    print(f"  T={row['T']} dequantize + torch._grouped_mm {row['dequant_grouped_mm_us']:.0f} us, "
          f"torch._grouped_mm on bf16 weights {row['grouped_mm_bf16_us']:.0f} us (rel err {err:.1e})", flush=True)


def gemm_floor_us(res, qt, rows, hit, E):
    """One grouped GEMM's floor: its hit experts' bytes at copy bandwidth, or its FLOPs at the bf16 GEMM rate."""
    flops = 2 * rows * qt.out_features * qt.in_features
    return 1e6 * max(hit * qt_bytes(qt) / E / res["copy_bandwidth_Bps"], flops / res["bf16_gemm_flops"])


def sweep_gemms(res, name, layer, x, ids, T, sweep):
    """Each grouped GEMM on its own, GPU time (events behind a lead), per block_m and config; every result checked
    against the first config's."""
    E, k = layer.gate_up.weight.shape[0], ids.shape[1]
    hit = torch.unique(ids).numel()
    h = torch.empty((T * k, layer.down.in_features), dtype=BF16, device="cuda")
    y = torch.empty((T * k, layer.down.out_features), dtype=BF16, device="cuda")
    for block_m, gemm, configs in sweep:
        table = mg.tile_table(ids, mt.expert_order(ids), E, block_m)
        qt, a, a_div, c, swiglu = ((layer.gate_up, x, k, h, True) if gemm == "gate_up" else
                                   (layer.down, torch.randn_like(h) * 0.1, 1, y, False))
        floor = gemm_floor_us(res, qt, T * k, hit, E)
        ref = None
        for cfg in configs:
            try:
                c.fill_(float("nan"))
                run = functools.partial(mg.grouped_gemm, a, a_div, qt, c, table, swiglu, block_m, cfg)
                run()
                ref = c.float().clone() if ref is None else ref
                err = rel_err(c, ref)
                if not err < 1e-2:
                    raise AssertionError(f"rel err {err:.2e} against the first config")
                t = events_time(run, reps=10, lead=True)
            except Exception as e:  # noqa: BLE001 - e.g. a config that does not fit shared memory
                print(f"  {gemm} T={T} block_m {block_m} {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
                continue
            row = {"model": name, "T": T, "gemm": gemm, "block_m": block_m, "config": tuple(cfg), "us": t * 1e6,
                   "floor_us": floor, "rel_err": err}
            res["prefill_sweep"].append(row)
            print(f"  {gemm} T={T} block_m {block_m} {tuple(cfg)}: {t * 1e6:.0f} us ({floor / t / 1e6:.0%} of its "
                  f"floor {floor:.0f} us)", flush=True)


def cublas_experts_time(T, H, I, k):
    """GPU time of cuBLAS bf16 GEMMs of the routed experts' FLOPs, [T*k, H] x [H, 2I] and [T*k, I] x [I, H] (an
    optimistic grouped-GEMM estimate); their operands are freed on return."""
    a, b = torch.randn(T * k, H, device="cuda", dtype=BF16), torch.randn(T * k, I, device="cuda", dtype=BF16)
    w_gu, w_down = torch.randn(2 * I, H, device="cuda", dtype=BF16), torch.randn(H, I, device="cuda", dtype=BF16)
    return events_time(lambda: (a @ w_gu.T, b @ w_down.T), reps=10, lead=True)


def time_prefill(res, name, layer, H, E, I, k, T=PREFILL_T, sweep=()):
    x = torch.randn(T, H, device="cuda", dtype=BF16)
    ids, w = mt.route(torch.randn(T, E, device="cuda"), k, True)
    if sweep:
        case(res, f"{name} T={T} sweep", lambda: sweep_gemms(res, name, layer, x, ids, T, sweep))
    flops = 6 * T * k * H * I  # gate_up 2*(2I)*H and down 2*H*I per slot
    t = events_time(lambda: mt.moe_prefill(x, ids, w, layer.gate_up, layer.down), reps=10, lead=True)
    t_cublas = cublas_experts_time(T, H, I, k)
    t_layer = events_time(lambda: layer(x), reps=10, lead=True)
    hit = torch.unique(ids).numel()  # the floor (#29): the hit experts' bytes at copy bandwidth, or their FLOPs
    expert_bytes = sum(qt_bytes(qt) for qt in (layer.gate_up, layer.down)) / E
    row = {"model": name, "T": T, "flops": flops, "cublas_tflops": flops / t_cublas / 1e12, "layer_us": t_layer * 1e6,
           "experts_us": t * 1e6, "config": str(mg.prefill_configs(T * k / E)), "tflops": flops / t / 1e12,
           "pct_cublas": t_cublas / t, "hit": hit,
           "floor_us": 1e6 * max(hit * expert_bytes / res["copy_bandwidth_Bps"], flops / res["bf16_gemm_flops"])}
    case(res, f"{name} T={T} alternatives", lambda: time_alternatives(res, row, x, ids, w, layer))
    res["prefill"].append(row)
    print(f"prefill {name} T={T}: experts {t * 1e6:.0f} us, {row['floor_us'] / t / 1e6:.0%} of the floor "
          f"({row['floor_us']:.0f} us); {row['tflops']:.0f} TFLOP/s = {row['pct_cublas']:.0%} of cuBLAS bf16 "
          f"({row['cublas_tflops']:.0f}); layer {row['layer_us']:.0f} us", flush=True)


def print_tables(res):
    print(f"\n{res['gpu']}; copy bandwidth {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; "
          f"bf16 GEMM {res['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s")
    print(f"{'MoE decode, 1 token (4-bit g64)':30s} {'router':>6s} {'floor us':>8s}  us (% of floor)")
    for r in res["decode"]:
        print(f"{r['model']:30s} {r['router']:>6s} {r['floor_us']:8.1f}  " + "; ".join(
            f"{key[:-3]} {v:.1f} ({r['floor_us'] / v * 100:.0f}%)" for key, v in r.items() if key.endswith(" us")
            and key != "floor_us"))
    print(f"\n{'decode launch sweep':30s} {'kernel':>18s} {'block_n/words':>13s} {'warps':>5s} {'per SM':>6s} "
          f"{'router rows':>11s} {'us':>7s} {'% copy':>6s}")
    for r in sorted(res["sweep"], key=lambda r: (r["model"], r["kernel"], r.get("us", 1e9))):
        print(f"{r['model']:30s} {r['kernel']:>18s} {r.get('block_n', r.get('item_words', '-'))!s:>13s} "
              f"{r['num_warps']:5d} {r.get('per_sm', '-')!s:>6s} {r.get('router_rows', '-')!s:>11s} "
              f"{r.get('us', float('nan')):7.1f} {r.get('pct_copy', float('nan')):5.0f}%")
    print(f"\n{'routed experts':30s} {'T':>5s} {'GEMVs us':>9s} {'grouped us':>11s}")
    for r in res["crossover"]:
        print(f"{r['model']:30s} {r['T']:5d} {r['decode_us']:9.1f} {r['prefill_us']:11.1f}")
    print(f"\n{'MoE prefill, routed experts':30s} {'T':>5s} {'us':>7s} {'floor':>6s} {'%floor':>6s} "
          f"{'deq+gmm':>8s} {'bf16 gmm':>8s} {'TFLOP/s':>8s} {'layer us':>9s}")
    for r in res["prefill"]:
        print(f"{r['model']:30s} {r['T']:5d} {r['experts_us']:7.0f} {r['floor_us']:6.0f} "
              f"{r['floor_us'] / r['experts_us']:6.0%} {r.get('dequant_grouped_mm_us', float('nan')):8.0f} "
              f"{r.get('grouped_mm_bf16_us', float('nan')):8.0f} {r['tflops']:8.0f} {r['layer_us']:9.0f}")
    best = {}
    for r in res["prefill_sweep"]:
        key = (r["model"], r["T"], r["gemm"])
        best[key] = min(best.get(key, r), r, key=lambda r: r["us"])
    print(f"\n{'grouped GEMM sweep, best':30s} {'T':>5s} {'gemm':>8s} {'us':>7s} {'%floor':>6s}  block_m, config")
    for (model, T, gemm), r in sorted(best.items()):
        print(f"{model:30s} {T:5d} {gemm:>8s} {r['us']:7.0f} {r['floor_us'] / r['us']:6.0%}  {r['block_m']}, "
              f"{r['config']}")
    print(f"\n{'multi-launch chain (8-bit router)':30s} {'launches':>8s} {'us':>7s} {'added':>7s}  last launch")
    for r in res["chain"]:
        print(f"{r['model']:30s} {r['launches']!s:>8s} {r.get('us', float('nan')):7.1f} "
              f"{r.get('added_us', float('nan')):7.1f}  {r.get('last', '')}")
    bad = [c for c in res["correctness"] if not c["ok"]]
    print(f"\ncorrectness: {len(res['correctness'])} checks, {len(bad)} failed; "
          f"max rel err {max((c['rel_err'] for c in res['correctness']), default=float('nan')):.2e}")
    for msg in res["errors"]:
        print(f"ERROR {msg}")


def main(argv=None) -> dict:
    a, dev, res = start_run(argv, "correctness", "decode", "sweep", "crossover", "prefill", "prefill_sweep", "errors",
                            "timeline", "chain",
                            flags=("--decode-only", "--chain-only", "--quick", "--gemv-sweep", "--prefill-only"),
                            values=("--prefill-tokens",))
    copy_bw = copy_bandwidth(dev)
    res["copy_bandwidth_Bps"], res["bf16_gemm_flops"] = copy_bw, bf16_gemm_rate(dev)
    print(f"# {res['gpu']}: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 GEMM "
          f"{res['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    try:
        for name, (H, E, I, k, Is) in MODELS.items():
            run_model(res, a, name, H, E, I, k, Is, copy_bw)
            torch.cuda.empty_cache()  # the model's layers went with run_model
    finally:
        print_tables(res)
    return res


def run_model(res, a, name, H, E, I, k, Is, copy_bw):
    """Every case `a` asks for at one model's shape, on layers that are freed when it returns."""
    layers = {kind: [] for kind in ROUTERS}
    if a.prefill_only:
        layer = build_layers(H, E, I, k, Is)["8-bit"]
        for T in (int(t) for t in (a.prefill_tokens or str(PREFILL_T)).split(",")):
            case(res, f"{name} prefill T={T}", lambda T=T: time_prefill(
                res, name, layer, H, E, I, k, T, prefill_sweep(T, k, E)))
        return

    def build():
        first = build_layers(H, E, I, k, Is)
        n = copies_for(int(decode_floor_bytes(first["8-bit"], k)))
        for copy in [first] + [build_layers(H, E, I, k, Is) for _ in range(n - 1)]:
            for kind in ROUTERS:
                layers[kind].append(copy[kind])

    case(res, f"{name} build", build)
    if not layers["8-bit"]:
        return
    case(res, f"{name} multi-launch chain", lambda: chain_ablation(res, name, layers, k))
    if a.chain_only:
        return
    if a.gemv_sweep:
        case(res, f"{name} expert GEMV sweep", lambda: sweep_decode_launches(res, name, layers, k, route_too=False))
        return
    case(res, f"{name} layer correctness", lambda: check_layer(res, name, layers, k))
    case(res, f"{name} decode", lambda: time_decode(res, name, layers, k, copy_bw))
    if a.quick:
        return
    if not a.decode_only:
        case(res, f"{name} correctness", lambda: check_correctness(res, name, layers["8-bit"][0], H, E, k))
        case(res, f"{name} launch sweep", lambda: sweep_decode_launches(res, name, layers, k))
        case(res, f"{name} crossover", lambda: time_crossover(res, name, layers, H, E, k))
        case(res, f"{name} prefill", lambda: time_prefill(res, name, layers["8-bit"][0], H, E, I, k))
