"""Decode batches of 5-128 tokens on the GPU: the dense 4-bit projections and the MoE experts, each path side by
side with the memory-bandwidth floor, at Qwen3-Next-80B-A3B shapes.

    python benchmarks/small_batch_gpu.py [--json out.json] [--sweep] [--moe-only]

- Dense [N, K] projections at M = 5..64 rows: today's dispatch (`qmatmul`: per-row GEMVs up to 4 rows, then the
  swapped tensor-core GEMM), per-row GEMVs, cuBLAS bf16 of the same shape (4x the bytes); floor: packed bytes / copy
  bandwidth.
- The MoE experts of one layer (route given, distinct random routings per token, shared expert as slot E) at
  T = 4..128 tokens: one GEMV row per (token, expert) slot (rows and warps per program swept), and the grouped
  tensor-core GEMMs; floor: the bytes of the experts the routing hits, once each.
- --sweep: tile sizes of the swapped dense GEMM, and M = 128-512 (unswapped tiles, dequantize + cuBLAS);
  --moe-only: the MoE section alone.
(A batch GEMV reading each W block once for R rows, dense and grouped by expert, was measured here and lost to
both paths at every size: commit b954bba, docs/PERF.md.)
Every timing: CUDA-graph replay over enough weight copies to keep L2 cold (qmatmul_gpu.graph_time); each
candidate checked against a reference first. Table printed last.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_gpu import stacked_qt  # noqa: E402
from qmatmul_gpu import copies_for, copy_bandwidth, end_run, graph_time, qt_bytes, random_qt, rel_err, start_run  # noqa: E402

from sluice.kernels.moe import grouped as mg  # noqa: E402
from sluice.kernels.moe import triton as mt  # noqa: E402
from sluice.kernels.qmatmul import gemm  # noqa: E402
from sluice.kernels.qmatmul import triton as qmm  # noqa: E402

DENSE = {"qkvz 12288x2048": (12288, 2048), "gdn out 2048x4096": (2048, 4096), "attn q 8192x2048": (8192, 2048),
         "lm_head 151936x2048": (151936, 2048)}
H, E, I, K_TOP = 2048, 512, 512, 10


# (block_m, block_n, block_k, warps, stages, split_k or None for qgemm's own): the --sweep of the swapped GEMM
SWEEP = ((16, 64, 128, 4, 4, None), (16, 64, 128, 4, 4, 2), (16, 64, 64, 4, 6, None), (16, 128, 128, 8, 4, None),
         (16, 128, 64, 4, 4, 2), (64, 64, 64, 4, 4, None), (64, 128, 64, 4, 4, None))
# from 128 rows (--sweep): the unswapped GEMM's tiles, beside dequantize + cuBLAS (`qgemm_dequant`)
SWEEP_TALL = ((64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))


def dense(res, copy_bw, sweep=False):
    for name, (N, K) in DENSE.items():
        base = random_qt(N, K)
        nb = qt_bytes(base)
        qts = [base] + [random_qt(N, K) for _ in range(copies_for(nb) - 1)]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies_for(2 * N * K), 8))]
        ref_w = base.dequantize(torch.float32) if N * K <= 1 << 26 else None
        for M in (5, 8, 16, 32, 64) + ((128, 256, 512) if sweep else ()):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in qts]
            cands = {"dispatch": lambda q, x: gemm.qmatmul(x, q)}
            if M <= 64:
                cands["gemv per row"] = lambda q, x: qmm.qgemv(x, q)
            if sweep and M > 64:
                cands["dequant + cuBLAS"] = lambda q, x: gemm.qgemm_dequant(x, q)
                for bm, bn, bk, w, st in SWEEP_TALL:
                    cands[f"gemm {bm}x{bn}x{bk} w{w} s{st}"] = functools.partial(
                        lambda q, x, **kw: gemm.qgemm(x, q, **kw), block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                        num_stages=st)
            if sweep and N * K < 1 << 26 and M <= 64:
                for bm, bn, bk, w, st, sk in SWEEP:
                    bm = max(bm, triton.next_power_of_2(M))
                    cands[f"gemm {bm}x{bn}x{bk} w{w} s{st} k{sk}"] = functools.partial(
                        lambda q, x, **kw: gemm.qgemm(x, q, swap=True, **kw), block_m=bm, block_n=bn, block_k=bk,
                        num_warps=w, num_stages=st, split_k=sk)
            row = {"shape": name, "M": M, "floor_us": nb / copy_bw * 1e6}
            for label, fn in cands.items():
                try:
                    if ref_w is not None:
                        err = rel_err(fn(qts[0], xs[0]), xs[0].float() @ ref_w.T)
                        if err > 1e-2:
                            raise AssertionError(f"rel err {err:.2e}")
                    row[label] = graph_time([lambda q=q, x=x, fn=fn: fn(q, x) for q, x in zip(qts, xs)], reps=10) * 1e6
                except Exception as e:  # a config that does not compile or is wrong: recorded, the run goes on
                    res["errors"].append(f"{name} M={M} {label}: {type(e).__name__}: {str(e)[:200]}")
                    print("ERROR", res["errors"][-1], flush=True)
            row["cublas bf16"] = graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w)
                                             for w, x in zip(ws, xs)], reps=10) * 1e6
            res["dense"].append(row)
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        del qts, ws


# (rows, warps) per expert GEMV program beside the default (8, 1); 32 and 64 rows, or 2 warps, were slower at every
# T on an H100 (docs/PERF.md, 2026-11-26)
EXPERT_LAUNCHES = ((16, 1),)
# (block_m, gate_up's config, down's): moe_prefill's own choice, and wider tiles
GROUPED = ((None, None, None), (16, mg.GemmConfig(128, stack=True, prefetch=False), mg.GemmConfig(128)))


def grouped_with_shared(x, ids, weights, gu, dn, shared, **blocks):
    """The grouped tensor-core GEMMs over the routed slots (`moe_prefill`), the shared expert through the dense
    path: what a decode batch would run if it took the prefill kernels."""
    k = ids.shape[1] - 1
    g, u = gemm.qmatmul(x, shared[0]).chunk(2, dim=-1)
    shared_out = gemm.qmatmul(torch.nn.functional.silu(g) * u, shared[1])
    out = mt.moe_prefill(x, ids[:, :k].contiguous(), weights[:, :k].contiguous(), gu, dn, summed=False, **blocks)
    return (out.combine().float() + weights[:, k:].float() * shared_out.float()).to(x.dtype)


def moe(res, copy_bw):
    layers = []
    for _ in range(4):  # 4 x 0.8 GB of experts: L2 stays cold between calls
        layers.append((stacked_qt(E, 2 * I, H), stacked_qt(E, H, I), random_qt(2 * I, H), random_qt(H, I)))
    expert_bytes = (qt_bytes(layers[0][0]) + qt_bytes(layers[0][1])) / E
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (4, 8, 16, 32, 64, 128):
        calls = []
        for gu, dn, sgu, sdn in layers:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(T, E, device="cuda", generator=g)
            ids, weights = mt.route(logits, K_TOP, True, torch.randn(T, device="cuda", generator=g))
            calls.append((x, ids, weights, gu, dn, (sgu, sdn)))
        hit = sum(torch.unique(c[1][:, :K_TOP]).numel() for c in calls) / len(calls) + 1  # + the shared expert
        row = {"T": T, "experts hit": hit, "floor_us": hit * expert_bytes / copy_bw * 1e6}
        try:
            row["per slot"] = graph_time([lambda c=c: mt.moe_decode(*c[:5], shared_expert=c[5]) for c in calls],
                                         reps=10) * 1e6
        except Exception as e:
            res["errors"].append(f"moe T={T}: {type(e).__name__}: {str(e)[:200]}")
            print("ERROR", res["errors"][-1], flush=True)
        for bn, warps in EXPERT_LAUNCHES:
            label = f"per slot {bn} rows w{warps}"
            try:
                row[label] = graph_time([lambda c=c: mt.moe_decode(*c[:5], shared_expert=c[5], block_n=bn,
                                                                   num_warps=warps) for c in calls], reps=10) * 1e6
            except Exception as e:
                res["errors"].append(f"moe T={T} {label}: {type(e).__name__}: {str(e)[:200]}")
                print("ERROR", res["errors"][-1], flush=True)
        for bm, gu_cfg, down_cfg in GROUPED:
            label = "grouped" + (f" {bm} rows, {gu_cfg.block_n}/{down_cfg.block_n} columns" if bm else "")
            try:
                fn = functools.partial(grouped_with_shared, block_m=bm, gate_up_config=gu_cfg, down_config=down_cfg)
                err = rel_err(fn(*calls[0]), mt.moe_decode(*calls[0][:5], shared_expert=calls[0][5]))
                if err > 2e-2:
                    raise AssertionError(f"rel err {err:.2e} against the per-slot GEMVs")
                row[label] = graph_time([lambda c=c: fn(*c) for c in calls], reps=10) * 1e6
            except Exception as e:
                res["errors"].append(f"moe T={T} {label}: {type(e).__name__}: {str(e)[:200]}")
                print("ERROR", res["errors"][-1], flush=True)
        res["moe"].append(row)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def main():
    a, dev, res = start_run("dense", "moe", "errors", flags=("--sweep", "--moe-only"))
    copy_bw = copy_bandwidth(dev)
    res["copy_bw"] = copy_bw
    for section in (moe,) if a.moe_only else (moe, functools.partial(dense, sweep=a.sweep)):
        try:
            section(res, copy_bw)
        except Exception as e:
            res["errors"].append(f"{getattr(section, '__name__', 'dense')}: {type(e).__name__}: {str(e)[:300]}")
            print("ERROR", res["errors"][-1], flush=True)
        torch.cuda.empty_cache()
    for key in ("moe", "dense"):
        print(f"\n{key} (us)")
        for row in res[key]:
            print("  " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    end_run(a, res)


if __name__ == "__main__":
    main()
