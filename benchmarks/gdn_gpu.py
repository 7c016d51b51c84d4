"""Gated DeltaNet on the GPU: our Triton kernels vs FLA 0.6.0 (`fla-core`, carried as a wheel), same inputs.

    python -m benchmarks run gdn_gpu [--json out.json]

Qwen3-Next-80B-A3B's linear-attention shape: 16 key heads, 32 value heads, K = V = 128, bf16 inputs, fp32 state.
- correctness: ours and FLA's against the fp32 torch reference (relative RMS of the output and final state);
- prefill: T = 4096, 16384, 65536 (one sequence) and 8 x 4096 (packed, cu_seqlens): ours
  (`chunk_gated_delta_rule`, gates computed from the raw projections in-kernel) vs FLA's `chunk_gated_delta_rule`
  (handed g and beta precomputed, so FLA does slightly less), wall time of a call between CUDA events, median;
  both also replayed from a CUDA graph (GPU time alone: what a captured or host-overlapped model forward sees);
- decode, one token, B = 1 and 32, under CUDA-graph replay with the state rotated over enough copies to leave L2
  cold: ours (`fused_recurrent_gated_delta_rule`, state updated in place) vs FLA's
  `fused_recurrent_gated_delta_rule`; floor = state bytes read + written over the measured copy bandwidth;
- a per-kernel breakdown at T = 16384 (torch profiler), ours and FLA's;
- a sweep of our launch options (value block, warps, pipeline stages).
GDN_BENCH_SKIP_DECODE=1 leaves out the decode part, GDN_BENCH_SKIP_SWEEP=1 the launch sweep; GDN_BENCH_STAGES_1=1
adds the stages=1 sweep, which broke the CUDA context on the H100 (so it runs last). Table printed last.
"""

from __future__ import annotations

import itertools
import os
import traceback

import torch
import torch.nn.functional as F

from sluice.kernels.gdn import reference
from sluice.kernels.gdn import triton as gt

from .gpu import copy_bandwidth, end_run, events_time, graph_time, start_run

try:
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import (
        fused_recurrent_gated_delta_rule as fla_recurrent,
    )
    FLA = getattr(fla, "__version__", "?")
except Exception as e:  # noqa: BLE001 - the run goes on without the peer
    print(f"FLA not available: {type(e).__name__}: {e}", flush=True)
    FLA = None

HK, HV, D = 16, 32, 128
BF16 = torch.bfloat16
PREFILL = [("T=4096", [4096]), ("T=16384", [16384]), ("T=65536", [65536]), ("8 x 4096", [4096] * 8)]
DECODE_B = [1, 32]


def make(T, B=1, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    x = {"q": r(B, T, HK, D).to(BF16), "k": r(B, T, HK, D).to(BF16), "v": r(B, T, HV, D).to(BF16),
         "a": r(B, T, HV).to(BF16), "b": r(B, T, HV).to(BF16), "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5}
    x["g"] = -x["A_log"].exp() * F.softplus(x["a"].float() + x["dt_bias"])
    x["beta"] = x["b"].float().sigmoid().to(BF16)
    return x


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def ours_prefill(x, state, cu=None, block_v=None, warps=None, stages=None):
    return gt.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], state, x["A_log"], x["dt_bias"],
                                     cu_seqlens=cu, block_v=block_v, num_warps=warps, num_stages=stages)


def fla_prefill(x, state, cu=None):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device="cuda")
    return fla_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)


def case(res, what, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a benchmark run must reach the end
        msg = f"{what}: {type(e).__name__}: {e}"
        print(f"ERROR {msg}\n{traceback.format_exc(limit=4)}", flush=True)
        res["errors"].append(msg)


def check(res):
    for name, lens in (("T=1000", [1000]), ("packed 1+63+64+65+1000", [1, 63, 64, 65, 1000]), ("T=16384", [16384])):
        T = sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        x = make(T, seed=T)
        state0 = torch.randn(len(lens), HV, D, D, device="cuda") * 0.1
        row = {"case": name}
        ref_o, ref_s = [], []
        for i in range(len(lens)):
            sl = slice(cu[i], cu[i + 1])
            o, s = reference.chunk_gated_delta_rule(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["g"][:, sl],
                                                    x["b"][:, sl].float().sigmoid(), initial_state=state0[i:i + 1],
                                                    use_qk_l2norm=True)
            ref_o.append(o)
            ref_s.append(s)
        ref_o, ref_s = torch.cat(ref_o, 1), torch.cat(ref_s, 0)
        st = state0.clone()
        o = ours_prefill(x, st, cu)
        row.update(ours_o=rel(o, ref_o), ours_state=rel(st, ref_s))
        # decode chained after a prefill equals the whole sequence (first sequence only)
        if FLA:
            o_f, s_f = fla_prefill(x, state0.clone(), cu)
            row.update(fla_o=rel(o_f, ref_o), fla_state=rel(s_f, ref_s))
        row["ok"] = row["ours_o"] <= 5e-3 and row["ours_state"] <= 5e-3
        res["correctness"].append(row)
        print(f"check {name}: {row}", flush=True)
    # decode: one step, B = 32, vs the reference
    x = make(1, B=32, seed=5)
    state0 = torch.randn(32, HV, D, D, device="cuda") * 0.1
    ref_o, ref_s = reference.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["b"].float().sigmoid(),
                                                        initial_state=state0, use_qk_l2norm=True)
    st = state0.clone()
    o = gt.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], st, x["A_log"], x["dt_bias"])
    row = {"case": "decode B=32", "ours_o": rel(o, ref_o), "ours_state": rel(st, ref_s)}
    row["ok"] = row["ours_o"] <= 5e-3 and row["ours_state"] <= 5e-3
    res["correctness"].append(row)
    print(f"check decode: {row}", flush=True)


def check_head_dim_256(res):
    """bf16 inputs at K = V = 256 (the largest head dim; its own launch defaults), against the fp32 reference."""
    g = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    T, Hk, Hv, K = 300, 2, 4, 256
    q, k, v = r(1, T, Hk, K).to(BF16), r(1, T, Hk, K).to(BF16), r(1, T, Hv, K).to(BF16)
    a, b, A_log, dt_bias = r(1, T, Hv).to(BF16), r(1, T, Hv).to(BF16), r(Hv) * 0.5, r(Hv) * 0.5
    state0 = r(1, Hv, K, K) * 0.1
    g_ = -A_log.exp() * F.softplus(a.float() + dt_bias)
    ref_o, ref_s = reference.chunk_gated_delta_rule(q, k, v, g_, b.float().sigmoid(), initial_state=state0,
                                                    use_qk_l2norm=True)
    st = state0.clone()
    o = gt.chunk_gated_delta_rule(q, k, v, a, b, st, A_log, dt_bias)
    row = {"case": "K=V=256 T=300", "ours_o": rel(o, ref_o), "ours_state": rel(st, ref_s)}
    row["ok"] = row["ours_o"] <= 5e-3 and row["ours_state"] <= 5e-3
    res["correctness"].append(row)
    print(f"check {row}", flush=True)


def prefill_cases():
    for name, lens in PREFILL:
        cu = None
        if len(lens) > 1:
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
        yield name, lens, cu


def time_prefill(res):
    """Our default launch and FLA on each shape (wall time of a call, CUDA events, median); ours also replayed
    from a CUDA graph (GPU time alone, as in a captured model forward)."""
    for name, lens, cu in prefill_cases():
        prefill_row(res, name, lens, cu)


def prefill_row(res, name, lens, cu):
    """`time_prefill` at one shape; its inputs are freed when it returns, before the next shape's are made."""
    T = sum(lens)
    x = make(T, seed=1)
    state = torch.zeros(len(lens), HV, D, D, device="cuda")
    row = {"case": name, "T": T}
    res["prefill"].append(row)
    case(res, f"prefill ours {name}", lambda: row.update(ours_ms=events_time(lambda: ours_prefill(x, state, cu),
                                                                              reps=10) * 1e3))
    if cu is None:
        case(res, f"prefill ours graph {name}", lambda: row.update(
            ours_graph_ms=graph_time([lambda: ours_prefill(x, state)], reps=10) * 1e3))
    if FLA:
        case(res, f"prefill fla {name}", lambda: row.update(fla_ms=events_time(lambda: fla_prefill(x, state, cu),
                                                                                reps=10) * 1e3))
        if cu is None:
            case(res, f"prefill fla graph {name}", lambda: row.update(
                fla_graph_ms=graph_time([lambda: fla_prefill(x, state)], reps=10) * 1e3))
    if "fla_ms" in row and "ours_ms" in row:
        row["speedup"] = row["fla_ms"] / row["ours_ms"]
    if "fla_graph_ms" in row and "ours_graph_ms" in row:
        row["graph_speedup"] = row["fla_graph_ms"] / row["ours_graph_ms"]
    print(f"prefill {row}", flush=True)


SWEEP = [("s2", {"stages": 2}), ("bv64", {"block_v": 64}), ("bv16", {"block_v": 16}), ("w84", {"warps": (8, 4)})]
# run last: block_v 16 with stages 1 once broke the CUDA context (illegal address; H100, Triton 3.6)
SWEEP_LAST = [("s1", {"stages": 1}), ("bv16s1", {"block_v": 16, "stages": 1})]


def sweep_prefill(res, variants):
    for name, lens, cu in prefill_cases():
        sweep_row(res, variants, name, lens, cu)


def sweep_row(res, variants, name, lens, cu):
    """`sweep_prefill` at one shape; its inputs are freed when it returns, before the next shape's are made."""
    x = make(sum(lens), seed=1)
    state = torch.zeros(len(lens), HV, D, D, device="cuda")
    row = next(r for r in res["prefill"] if r["case"] == name)
    for label, kw in variants:
        case(res, f"prefill ours {name} {label}", lambda label=label, kw=kw: row.update(
            {f"ours_{label}_ms": events_time(lambda: ours_prefill(x, state, cu, **kw), reps=5) * 1e3}))
    print(f"sweep {row}", flush=True)


def time_decode(res, copy_bw):
    for B in DECODE_B:
        decode_row(res, B, copy_bw)


def decode_row(res, B, copy_bw):
    """`time_decode` at one batch size; its state copies are freed when it returns, before the next size's are
    made."""
    state_bytes = B * HV * D * D * 4
    n = max(2, min(64, (4 * 60 << 20) // state_bytes))
    xs = [make(1, B=B, seed=10 + i) for i in range(min(n, 8))]
    states = [torch.randn(B, HV, D, D, device="cuda") * 0.1 for _ in range(n)]
    pairs = list(zip(states, itertools.cycle(xs)))  # each state copy with its inputs
    row = {"B": B, "floor_us": 2 * state_bytes / copy_bw * 1e6, "copies": n}
    res["decode"].append(row)

    def ours(bv=None, warps=None):
        return [lambda s=s, x=x: gt.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], x["a"], x["b"], s, x["A_log"], x["dt_bias"], block_v=bv, num_warps=warps)
            for s, x in pairs]

    case(res, f"decode ours B={B}", lambda: row.update(ours_us=graph_time(ours()) * 1e6))
    for bv, warps in ((16, 2), (16, 4), (32, 4), (64, 4), (64, 8), (128, 8)):
        case(res, f"decode ours B={B} bv{bv}", lambda bv=bv, warps=warps: row.update(
            {f"ours_bv{bv}w{warps}_us": graph_time(ours(bv, warps)) * 1e6}))
    if FLA:
        calls = [lambda s=s, x=x: fla_recurrent(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=s, output_final_state=True,
            use_qk_l2norm_in_kernel=True) for s, x in pairs]
        case(res, f"decode fla B={B}", lambda: row.update(fla_us=graph_time(calls) * 1e6))
    if "fla_us" in row and "ours_us" in row:
        row["speedup"] = row["fla_us"] / row["ours_us"]
    print(f"decode {row}", flush=True)


def kernel_breakdown(res, name, fn):
    """Per-kernel GPU time of one call (torch profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            rows.append({"kernel": e.key[:60], "us": us, "calls": e.count})
    rows.sort(key=lambda r: -r["us"])
    res["breakdown"].append({"case": name, "kernels": rows[:12]})
    print(f"breakdown {name}: " + "; ".join(f"{r['kernel']} {r['us']:.0f} us" for r in rows[:8]), flush=True)


def profile_prefill(res):
    x = make(16384, seed=2)
    state = torch.zeros(1, HV, D, D, device="cuda")
    case(res, "breakdown ours", lambda: kernel_breakdown(res, "ours T=16384", lambda: ours_prefill(x, state)))
    for label, kw in (("stages 2", {"stages": 2}),):
        case(res, f"breakdown ours {label}", lambda label=label, kw=kw: kernel_breakdown(
            res, f"ours T=16384 {label}", lambda: ours_prefill(x, state, **kw)))
    if FLA:
        case(res, "breakdown fla", lambda: kernel_breakdown(res, "FLA T=16384", lambda: fla_prefill(x, state)))


def main(argv=None) -> dict:
    _, dev, res = start_run(argv, "correctness", "prefill", "decode", "breakdown", "errors")
    res["fla"] = FLA
    copy_bw = copy_bandwidth(dev)
    res["copy_bandwidth_Bps"] = copy_bw
    print(f"# {res['gpu']}, FLA {FLA}, copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    try:
        case(res, "correctness", lambda: check(res))
        if not os.environ.get("GDN_BENCH_SKIP_DECODE"):  # the decode sweep, when only prefill changed
            case(res, "decode", lambda: time_decode(res, copy_bw))
        case(res, "prefill", lambda: time_prefill(res))
        case(res, "breakdown", lambda: profile_prefill(res))
        if not os.environ.get("GDN_BENCH_SKIP_SWEEP"):
            case(res, "sweep", lambda: sweep_prefill(res, SWEEP))
        case(res, "head dim 256", lambda: check_head_dim_256(res))
        if os.environ.get("GDN_BENCH_STAGES_1"):  # known to break the CUDA context: nothing runs after it
            case(res, "sweep", lambda: sweep_prefill(res, SWEEP_LAST))
    finally:
        print(f"\n{res['gpu']}; FLA {FLA}; copy {copy_bw / 1e12:.2f} TB/s; Hk={HK} Hv={HV} K=V={D}, bf16")
        print(f"{'prefill':12s} {'ours ms':>8s} {'FLA ms':>8s} {'speedup':>8s} {'graph ms':>8s} {'FLA graph':>9s} "
              f"{'speedup':>8s}   sweep (ms)")
        for r in res["prefill"]:
            sweep = " ".join(f"{k[5:-3]}={v:.3f}" for k, v in r.items()
                             if k.startswith("ours_") and k not in ("ours_ms", "ours_graph_ms"))
            nan = float("nan")
            print(f"{r['case']:12s} {r.get('ours_ms', nan):8.3f} {r.get('fla_ms', nan):8.3f} "
                  f"{r.get('speedup', nan):7.2f}x {r.get('ours_graph_ms', nan):8.3f} {r.get('fla_graph_ms', nan):9.3f} "
                  f"{r.get('graph_speedup', nan):7.2f}x   {sweep}")
        print(f"\n{'decode':12s} {'ours us':>8s} {'FLA us':>8s} {'speedup':>8s} {'floor us':>9s}   block_v sweep (us)")
        for r in res["decode"]:
            sweep = " ".join(f"{k[5:-3]}={v:.1f}" for k, v in r.items() if k.startswith("ours_bv"))
            print(f"{'B=' + str(r['B']):12s} {r.get('ours_us', float('nan')):8.1f} "
                  f"{r.get('fla_us', float('nan')):8.1f} {r.get('speedup', float('nan')):7.2f}x {r['floor_us']:9.1f}   "
                  f"{sweep}")
        for bd in res["breakdown"]:
            print(f"{bd['case']}: " + "; ".join(f"{r['kernel'].replace('_chunk_', '')} {r['us']:.0f}"
                                                for r in bd["kernels"][:6]))
        end_run(res)
    return res
