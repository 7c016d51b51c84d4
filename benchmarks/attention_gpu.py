"""Decode attention on the GPU: our split-K Triton kernel on the dense bf16 cache and on the TurboQuant 4-bit cache,
against PyTorch SDPA (bf16, GQA) and against the bandwidth floor.

    python -m benchmarks run attention_gpu [--json out.json] [--sweep | --tq-sweep] [--contexts 32768,...]

(--sweep: launch options at 32k after the table; --tq-sweep: only the checks, the appends and the TurboQuant sweep.)

Shapes: Qwen3-Next's full attention (16 query heads, 2 KV heads, D = 256) and an 8-KV-head D = 128 layer (32
query heads); contexts 4k, 32k, 128k; batch 1 and 16. One query per sequence at the last position. Cold L2: the
caches rotate over enough copies to exceed L2 four times; CUDA-graph replay. Bytes counted: K and V of every
visible position (bf16: 2 D each; TurboQuant: D/2 + 4 each, plus the 64 exact recent positions), q and o. The
TurboQuant time includes rotating q and the output (`turboquant.triton.rotate`, a launch each) but not the append of
the new token; the "step" columns time a whole decode step of the layer as the caches run it (store the new key
and value, attend; TurboQuant: append + rotate q in one launch, the kernel, the output rotated back).
Correctness first, at real shapes, against fp32 attention over the same (dequantized) cache. Table printed last.
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.nn.functional as F

from .gpu import end_run, L2_BYTES, copy_bandwidth, graph_time, start_run
from sluice.cache.turboquant import RECENT
from sluice.kernels.attention.triton import decode_attention, num_splits
from sluice.kernels.turboquant import reference as tq
from sluice.kernels.turboquant.triton import decode_step_prep, rotate

SHAPES = {"qwen3-next 16q/2kv D256": (16, 2, 256), "8kv D128 (32q)": (32, 8, 128)}
CONTEXTS = [4096, 32768, 131072]
BATCHES = [1, 16]
BF16 = torch.bfloat16


def make_cache(B, Hkv, S, D, quant, g):
    if not quant:
        return dict(k=torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=BF16),
                    v=torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=BF16))
    codes = lambda: torch.randint(0, 256, (B, Hkv, S, D // 2), device="cuda", generator=g,  # noqa: E731
                                  dtype=torch.int32).to(torch.uint8)
    scales = lambda: torch.rand(B, Hkv, S, device="cuda", generator=g) * 0.2 + 0.05  # noqa: E731
    ring = lambda: torch.randn(B, Hkv, RECENT, D, device="cuda", generator=g, dtype=BF16)  # noqa: E731
    return dict(k=codes(), v=tq.interleave(codes()), k_scale=scales(), v_scale=scales(), k_recent=ring(),
                v_recent=ring())


def cold_caches(B, Hkv, S, D, quant, g):
    """One cache and enough copies of it that the copies exceed L2 four times (rotated over: cold L2)."""
    first = make_cache(B, Hkv, S, D, quant, g)
    return [first] + [make_cache(B, Hkv, S, D, quant, g) for _ in range(max(1, 4 * L2_BYTES // cache_bytes(first)))]


def cache_bytes(c):
    return sum(t.numel() * t.element_size() for t in c.values())


def ours(q, c, pos, scale, S, quant, splits=None, rotated=False, **launch):
    """Our kernel; TurboQuant: q rotated first (a launch) unless `rotated`, the output rotated back by the merge."""
    if not quant:
        return decode_attention(q, c["k"], c["v"], pos, scale, S, splits=splits, **launch)
    return decode_attention(q if rotated else rotate(q), c["k"], c["v"], pos, scale, S, splits=splits,
                            k_scale=c["k_scale"], v_scale=c["v_scale"], k_recent=c["k_recent"],
                            v_recent=c["v_recent"], unrotate=True, out_dtype=BF16, **launch)


def step(q, kv_new, c, pos, scale, S, quant):
    """A whole decode step of one layer as the caches run it: store the new key and value at slot S - 1, then
    attend (TurboQuant: one launch appends K and V and rotates q; the kernel; the output rotated back)."""
    k_new, v_new = kv_new
    if not quant:
        c["k"][:, :, S - 1] = k_new
        c["v"][:, :, S - 1] = v_new
        return decode_attention(q, c["k"], c["v"], pos, scale, S)
    qr = decode_step_prep(q, k_new, v_new, c["k"], c["v"], c["k_scale"], c["v_scale"], c["k_recent"], c["v_recent"],
                          pos)
    return decode_attention(qr, c["k"], c["v"], pos, scale, S, k_scale=c["k_scale"], v_scale=c["v_scale"],
                            k_recent=c["k_recent"], v_recent=c["v_recent"], unrotate=True, out_dtype=BF16)


def sdpa(q, c, scale):
    return F.scaled_dot_product_attention(q[:, :, None], c["k"], c["v"], scale=scale, enable_gqa=True)[:, :, 0]


def _attention_fp32(q, k, v, scale):
    """q [B, Hq, D], k, v [B, Hkv, S, D]: fp32 softmax attention, GQA by grouping q (no repeated K, V)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    p = torch.softmax(qg @ k.float().transpose(-1, -2) * scale, -1)
    return (p @ v.float()).reshape(B, Hq, D)


def check(res):
    """Real shapes, 4k context at batch 2 and 32k at batch 16 (the long-split launch): ours (bf16 cache) vs fp32
    attention; TurboQuant vs attention over the dequantized cache with the recent positions exact."""

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (Hq, Hkv, D) in SHAPES.items():
        for B, S in ((2, 4096), (16, 32768)):
            q = torch.randn(B, Hq, D, device="cuda", generator=g, dtype=BF16)
            pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
            scale = D ** -0.5
            c = make_cache(B, Hkv, S, D, False, g)
            ref = _attention_fp32(q, c["k"], c["v"], scale)
            row = {"case": name, "batch": B, "context": S,
                   "dense_rel": float((ours(q, c, pos, scale, S, False).float() - ref).norm() / ref.norm())}
            del c
            x = torch.randn(B, Hkv, S, D, device="cuda", generator=g)
            y = torch.randn(B, Hkv, S, D, device="cuda", generator=g)
            kc, ks = tq.quantize(x)
            vc, vs = tq.quantize(y)
            ring = lambda t: tq.rotate(t[:, :, S - RECENT:]).roll(S % RECENT, dims=2)  # noqa: E731  slot j % RECENT
            qc = dict(k=kc, v=tq.interleave(vc), k_scale=ks, v_scale=vs, k_recent=ring(x).to(BF16),
                      v_recent=ring(y).to(BF16))
            kk = torch.cat([tq.dequantize(kc, ks)[:, :, :S - RECENT], x[:, :, S - RECENT:]], 2)
            vv = torch.cat([tq.dequantize(vc, vs)[:, :, :S - RECENT], y[:, :, S - RECENT:]], 2)
            del x, y
            ref = _attention_fp32(q, kk, vv, scale)
            del kk, vv
            row["turboquant_rel"] = float((ours(q, qc, pos, scale, S, True).float() - ref).norm() / ref.norm())
            for int8 in (0, 1, 2):  # the Triton kernel's product variants (the sweep times them)
                row[f"turboquant_rel_int8_{int8}"] = float((ours(q, qc, pos, scale, S, True, cuda_kernel=False,
                                                                 int8_products=int8).float() - ref).norm()
                                                           / ref.norm())
            row["ok"] = row["dense_rel"] < 1e-2 and row["turboquant_rel"] < 1e-2
            res["correctness"].append(row)
            print(f"check {row}", flush=True)
            del qc
            torch.cuda.empty_cache()


def time_case(res, copy_bw, name, Hq, Hkv, D, S, B):
    g = torch.Generator(device="cuda").manual_seed(S + B)
    scale = D ** -0.5
    q = torch.randn(B, Hq, D, device="cuda", generator=g, dtype=BF16)
    pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
    row = {"shape": name, "context": S, "batch": B}
    for label, quant in (("bf16", False), ("turboquant4", True)):
        one = make_cache(B, Hkv, S, D, quant, g)
        nbytes = cache_bytes(one) + 2 * q.numel() * 2
        n = max(1, math.ceil(4 * L2_BYTES / nbytes))
        caches = [one] + [make_cache(B, Hkv, S, D, quant, g) for _ in range(n - 1)]
        row[f"{label}_bytes"] = nbytes
        row[f"{label}_floor_us"] = nbytes / copy_bw * 1e6
        row[f"ours_{label}_us"] = graph_time([lambda c=c: ours(q, c, pos, scale, S, quant) for c in caches]) * 1e6
        row[f"ours_{label}_legacy_timing_us"] = graph_time([lambda c=c: ours(q, c, pos, scale, S, quant)
                                                            for c in caches], legacy=True) * 1e6
        kv_new = (torch.randn(B, Hkv, D, device="cuda", generator=g, dtype=BF16),
                  torch.randn(B, Hkv, D, device="cuda", generator=g, dtype=BF16))
        row[f"step_{label}_us"] = graph_time([lambda c=c: step(q, kv_new, c, pos, scale, S, quant)
                                              for c in caches]) * 1e6
        if quant:  # the kernel alone: q already rotated (a decode step rotates it in the append launch)
            qr = rotate(q)
            row["kernel_turboquant4_us"] = graph_time([lambda c=c: ours(qr, c, pos, scale, S, quant, rotated=True)
                                                       for c in caches]) * 1e6
            row["kernel_turboquant4_triton_us"] = graph_time(  # the Triton split kernel, same merge (A/B)
                [lambda c=c: ours(qr, c, pos, scale, S, quant, rotated=True, cuda_kernel=False) for c in caches]) * 1e6
        else:
            try:
                row["sdpa_bf16_us"] = graph_time([lambda c=c: sdpa(q, c, scale) for c in caches]) * 1e6
            except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is reported, not fatal
                row["sdpa_error"] = f"{type(e).__name__}: {e}"
            for splits in (1, 8, 32, 128):
                row[f"ours_bf16_splits{splits}_us"] = graph_time(
                    [lambda c=c: ours(q, c, pos, scale, S, False, splits) for c in caches]) * 1e6
        del caches, one
        torch.cuda.empty_cache()
    row["bf16_pct_copy"] = row["bf16_floor_us"] / row["ours_bf16_us"]
    row["turboquant_pct_copy"] = row["turboquant4_floor_us"] / row["ours_turboquant4_us"]
    row["turboquant_vs_ours_bf16"] = row["ours_bf16_us"] / row["ours_turboquant4_us"]
    row["turboquant_step_vs_bf16_step"] = row["step_bf16_us"] / row["step_turboquant4_us"]
    if "sdpa_bf16_us" in row:
        row["turboquant_vs_sdpa"] = row["sdpa_bf16_us"] / row["ours_turboquant4_us"]
    res["timings"].append(row)
    print(f"time {row}", flush=True)


SWEEP_DENSE = [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (32, 64, 128) for w in (4, 8)
               for st in (2, 3, 4)]
SWEEP_TQ = [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
SWEEP_TQ_INT8 = (2,)  # the product variants the sweep times (1 and 2 compared in the 2026-11-25 runs)


def sweep(res, copy_bw, dense=True, contexts=None):
    """Launch options, split counts and (TurboQuant) the int8 product variants at 32k context (TurboQuant: also
    4k): the time of each (TurboQuant: the kernel alone, q rotated beforehand), so the defaults can be checked."""

    for name, (Hq, Hkv, D) in SHAPES.items():
        for B, S in [(B, S) for B in BATCHES for S in contexts or ((32768,) if dense else (4096, 32768))]:
            g = torch.Generator(device="cuda").manual_seed(7)
            q = torch.randn(B, Hq, D, device="cuda", generator=g, dtype=BF16)
            pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
            for quant, configs in ((False, SWEEP_DENSE), (True, SWEEP_TQ))[0 if dense else 1:]:
                one = make_cache(B, Hkv, S, D, quant, g)
                n = max(1, math.ceil(4 * L2_BYTES / cache_bytes(one)))
                caches = [one] + [make_cache(B, Hkv, S, D, quant, g) for _ in range(n - 1)]
                auto = num_splits(B * Hkv, S, q.device)
                if quant:  # the defaults (splits None), then each launch with split counts around the default's
                    auto = num_splits(B * Hkv, S, q.device, per_sm=3 if D <= 128 else 2, one_wave=True)
                    counts = sorted({max(1, auto // 2), auto, 3 * auto // 2, 2 * auto, 4 * auto})
                    runs = [({}, None)] + [(launch, ns) for launch in configs for ns in counts]
                else:
                    runs = [(launch, auto) for launch in configs] + [({}, max(1, auto // 2)), ({}, 2 * auto)]
                qq = rotate(q) if quant else q
                for int8 in (SWEEP_TQ_INT8 if quant else (None,)):
                    products = {} if int8 is None else {"int8_products": int8}
                    for launch, ns in runs:
                        try:
                            t = graph_time([lambda c=c: ours(qq, c, pos, D ** -0.5, S, quant, ns, rotated=quant,
                                                             **launch, **products) for c in caches]) * 1e6
                        except Exception as e:  # noqa: BLE001 - a launch that does not fit is reported
                            res["errors"].append(f"sweep {name} B={B} {launch} splits={ns} int8={int8}: "
                                                 f"{type(e).__name__}: {e}")
                            continue
                        row = dict(shape=name, batch=B, context=S, quant=quant, int8=int8, splits=ns, us=t, **launch)
                        res["sweep"].append(row)
                        print(f"sweep {row}", flush=True)
                del caches, one
                torch.cuda.empty_cache()


def append_time(res):
    """Quantize-on-append of one decode step's K (or V): [B, Hkv, D] into the cache, per launch."""
    from sluice.kernels.turboquant.triton import quantize_append

    for name, (Hq, Hkv, D) in SHAPES.items():
        for B in BATCHES:
            x = torch.randn(B, Hkv, D, device="cuda", dtype=BF16)
            codes = torch.zeros(B, Hkv, 4096, D // 2, dtype=torch.uint8, device="cuda")
            sc = torch.zeros(B, Hkv, 4096, device="cuda")
            ring = torch.zeros(B, Hkv, RECENT, D, device="cuda", dtype=BF16)
            at100 = torch.full((B,), 100, dtype=torch.int32, device="cuda")  # slot 100, ring slot 36
            t = graph_time([lambda: quantize_append(x, codes, sc, ring, at100)]) * 1e6
            res["append"].append(dict(shape=name, batch=B, us=t))
            print(f"append {res['append'][-1]}", flush=True)


def main(argv=None) -> dict:
    a, dev, res = start_run(argv, "correctness", "timings", "errors", "sweep", "append",
                            flags=("--sweep", "--tq-sweep"), values=("--contexts",))
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else CONTEXTS
    copy_bw = copy_bandwidth(dev)
    res["copy_bandwidth_Bps"] = copy_bw
    print(f"# {res['gpu']}, copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    try:
        check(res)
        append_time(res)
        for name, (Hq, Hkv, D) in SHAPES.items() if not a.tq_sweep else ():
            for S in contexts:
                for B in BATCHES:
                    try:
                        time_case(res, copy_bw, name, Hq, Hkv, D, S, B)
                    except Exception as e:  # noqa: BLE001 - out of memory at the largest shapes, say
                        res["errors"].append(f"{name} S={S} B={B}: {type(e).__name__}: {e}")
                        print(traceback.format_exc(limit=3), flush=True)
                        torch.cuda.empty_cache()
        if a.sweep or a.tq_sweep:
            sweep(res, copy_bw, dense=not a.tq_sweep, contexts=a.contexts and contexts)
    finally:
        best = {}
        for r in res["sweep"]:
            key = (r["shape"], r["batch"], r.get("context"), r["quant"], r["int8"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        for r in best.values():
            print(f"best {r}")
        print(f"\n{res['gpu']}; copy {copy_bw / 1e12:.2f} TB/s; CUDA-graph replay, cold L2; times in us")
        print(f"{'shape':24s} {'ctx':>6s} {'B':>3s} {'ours bf16':>9s} {'%copy':>6s} {'SDPA':>8s} {'TQ4':>8s} "
              f"{'%copy':>6s} {'TQ/bf16':>7s} {'TQ/SDPA':>7s} {'TQ kern':>7s} {'kern/bf16':>9s} {'Triton':>7s} "
              f"{'step bf16':>9s} {'step TQ':>8s}")
        for r in res["timings"]:
            print(f"{r['shape']:24s} {r['context']:6d} {r['batch']:3d} {r['ours_bf16_us']:9.1f} "
                  f"{100 * r['bf16_pct_copy']:5.0f}% {r.get('sdpa_bf16_us', float('nan')):8.1f} "
                  f"{r['ours_turboquant4_us']:8.1f} {100 * r['turboquant_pct_copy']:5.0f}% "
                  f"{r['turboquant_vs_ours_bf16']:6.2f}x {r.get('turboquant_vs_sdpa', float('nan')):6.2f}x "
                  f"{r.get('kernel_turboquant4_us', float('nan')):7.1f} "
                  f"{r['ours_bf16_us'] / r.get('kernel_turboquant4_us', float('nan')):8.2f}x "
                  f"{r.get('kernel_turboquant4_triton_us', float('nan')):7.1f} "
                  f"{r['step_bf16_us']:9.1f} {r['step_turboquant4_us']:8.1f}")
        end_run(res)
    return res
