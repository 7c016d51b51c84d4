"""Quantized matmul on the GPU: our Triton kernels vs cuBLAS bf16 and vs the memory-bandwidth floor.

    python -m benchmarks run qmatmul_gpu [--json out.json] [--gemv-only]

One run: checks correctness at real shapes against the torch reference (fp32), then times
- 4-bit GEMV (M = 1, 4, 16) at Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B shapes, cold L2 (inputs rotated over
  enough copies to exceed L2 several times), under CUDA-graph replay; bandwidth counts every byte the kernel must
  read (packed weights, scales, biases, activations) and write;
- cuBLAS bf16 GEMV of the same logical shape (same rotation);
- 4-bit prefill GEMM at M = 4096 vs cuBLAS bf16 GEMM;
- the floor: measured device copy bandwidth (bytes read + written) and bf16 GEMM rate; for M = 1 also a kernel
  that only reads the GEMV's bytes, timed the same way (what launch, ramp-up and drain leave of the bandwidth at
  that size).
Table printed last; JSON with every number. --gemv-only: M = 1 only, no correctness sweep, no GEMM.
"""

from __future__ import annotations

import functools

import torch

from sluice.kernels.qmatmul import gemm, reference
from sluice.kernels.qmatmul import triton as qmm
from sluice.quant.affine import QuantizedTensor, quantize

from .gpu import (
    bf16_gemm_rate,
    copies_for,
    copy_bandwidth,
    events_time,
    graph_time,
    qt_bytes,
    random_qt,
    read_ceiling,
    rel_err,
    start_run,
)

GEMV_SHAPES = {  # name: (N, K)
    "q3next dense 16384x2048": (16384, 2048),
    "q3next qkvz 12288x2048": (12288, 2048),
    "q3next expert gate+up 1024x2048": (1024, 2048),
    "q3next expert down 2048x512": (2048, 512),
    "q3next lm_head 151936x2048": (151936, 2048),
    "q3.5 expert gate+up 2048x4096": (2048, 4096),
    "q3.5 expert down 4096x1024": (4096, 1024),
    "q3.5 lm_head 248320x4096": (248320, 4096),
}
GEMM_SHAPES = {"q3next dense 16384x2048": (16384, 2048), "q3next qkvz 12288x2048": (12288, 2048),
               "q3.5 dense 8192x4096": (8192, 4096)}
# M = 1, CUDA cores: (block_n, split_k (None = auto), num_warps, x prepared in the GEMV, PREFETCH); "default" is
# what qgemv picks. (.., False, 1): the GEMV as it was before RAW_X and PREFETCH 2 (x prep launch, first weights
# to L2).
GEMV_CONFIGS = ["default", (4, None, 1, False, 1), (8, None, 1, False, 1), (4, None, 1, False, 2),
                (8, None, 1, True, 2), (16, None, 1, True, 2), (16, None, 1, True, 1), (32, None, 1, True, 2),
                (8, None, 2, True, 2), (16, None, 2, True, 2), (4, None, 2, True, 2), (2, None, 4, True, 2),
                (4, None, 4, True, 2), (2, None, 2, True, 2), (2, None, 4, False, 1)]


def gemv_config(q, x, c):
    """qmm.qgemv with config c of GEMV_CONFIGS."""
    if c == "default":
        return qmm.qgemv(x, q)
    return qmm.qgemv(x, q, *c[:3], raw_x=c[3], prefetch=c[4])


# M = 4, 16, tensor cores with swapped operands: (block_m, block_n, block_k, num_warps, num_stages)
SMALL_M_CONFIGS = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 64, 4, 4),
                   (16, 256, 128, 8, 3)]
GEMM_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                (128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (128, 64, 128, 4, 4), (128, 256, 128, 8, 2)]


def main(argv=None) -> dict:
    a, dev, res = start_run(argv, "correctness", "gemv", "gemm", "sweep", flags=("--gemv-only",))

    # floors
    copy_bw, gemm_rate = copy_bandwidth(dev), bf16_gemm_rate(dev)
    res["copy_bandwidth_Bps"], res["bf16_gemm_flops"] = copy_bw, gemm_rate
    print(f"# {res['gpu']}: copy {copy_bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s",
          flush=True)

    # correctness at real shapes, every bits/group combination, against the fp32 reference
    for bits in () if a.gemv_only else (2, 4, 8):
        for gs in (32, 64, 128):
            w = torch.randn(4096, 2048, device=dev) * 0.02
            qt = quantize(w, bits, gs)
            for M in (1, 2, 7, 16, 33, 512):
                x = torch.randn(M, 2048, device=dev, dtype=torch.bfloat16)
                ref = reference.qmatmul(x.float(), qt)
                outs = {"qmatmul": gemm.qmatmul(x, qt)}
                if M <= 2:
                    outs["gemv split 3"] = qmm.qgemv(x, qt, split_k=3)
                for what, y in outs.items():
                    err = rel_err(y, ref)
                    res["correctness"].append({"bits": bits, "group": gs, "M": M, "path": what, "rel_err": err})
                    assert err <= 1e-2 and torch.isfinite(y).all(), (bits, gs, M, what, err)
    print(f"# correctness: {len(res['correctness'])} cases, max rel err "
          f"{max((c['rel_err'] for c in res['correctness']), default=float('nan')):.2e}", flush=True)

    for name, (N, K) in GEMV_SHAPES.items():
        base = random_qt(N, K)
        nb = qt_bytes(base)
        n = copies_for(nb)
        qts = [base] + [random_qt(N, K) for _ in range(n - 1)]
        dense_n = copies_for(N * K * 2)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16)
              for _ in range(min(dense_n, max(2, (40 << 30) // (N * K * 2))))]
        for M in (1,) if a.gemv_only else (1, 4, 16):
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(n)]
            t, cfg = None, None
            if M == 1:
                cands = [(c, lambda q, x, c=c: gemv_config(q, x, c)) for c in GEMV_CONFIGS]
            else:
                cands = [(c, lambda q, x, c=c: gemm.qgemm(x, q, c[0], c[1], c[2], c[3], c[4], swap=True))
                         for c in SMALL_M_CONFIGS] + [("gemv per row", lambda q, x: qmm.qgemv(x, q))]
            # each config's output is checked on the first copy (fp32 reference, in row chunks: lm_heads are big)
            ref = torch.cat([xs[0].float() @ base_rows.dequantize(torch.float32).T for base_rows in
                             (QuantizedTensor(base.weight[i:i + 16384], base.scales[i:i + 16384],
                                              base.biases[i:i + 16384], base.bits, base.group_size)
                              for i in range(0, N, 16384))], dim=1)
            for c, fn in cands:  # a small sweep; the best is recorded with the row
                try:
                    err = rel_err(fn(qts[0], xs[0]), ref)
                    tc = graph_time([lambda q=q, x=x, fn=fn: fn(q, x) for q, x in zip(qts, xs)], reps=10)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                    print(f"  config {c} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                res["correctness"].append({"shape": name, "M": M, "config": str(c), "rel_err": err,
                                           "ok": err <= 1e-2})
                if err > 1e-2:
                    print(f"  config {c} WRONG: rel err {err:.2e}", flush=True)
                res["sweep"].append({"shape": name, "M": M, "config": str(c), "us": tc * 1e6})
                print(f"  {name} M={M} {c}: {tc * 1e6:.2f} us", flush=True)
                if t is None or tc < t:
                    t, cfg = tc, c
            default_us = next((r["us"] for r in res["sweep"] if r["shape"] == name and r["M"] == M
                               and r["config"] == "default"), None)
            moved = nb + 2 * M * K + 2 * M * N
            t_cublas = graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w, x in zip(ws, xs)])
            dense_moved = 2 * N * K + 2 * M * K + 2 * M * N
            best_us = t * 1e6
            t = default_us * 1e-6 if default_us is not None else t  # the headline: what qgemv runs by default
            row = {"shape": name, "M": M, "N": N, "K": K, "us": t * 1e6, "bytes": moved, "config": cfg,
                   "best_us": best_us, "bandwidth_Bps": moved / t, "pct_copy_bw": moved / t / copy_bw,
                   "cublas_bf16_us": t_cublas * 1e6, "cublas_pct_copy_bw": dense_moved / t_cublas / copy_bw,
                   "speedup_vs_cublas": t_cublas / t, "default_us": default_us}
            if M == 1:
                row["read_ceiling_us"] = read_ceiling(moved, n) * 1e6
                row["read_ceiling_pct_copy_bw"] = moved / (row["read_ceiling_us"] * 1e-6) / copy_bw
            res["gemv"].append(row)
            print(f"gemv {name} M={M}: {row['us']:.1f} us, {row['pct_copy_bw'] * 100:.0f}% of copy BW, "
                  f"{row['speedup_vs_cublas']:.2f}x cuBLAS", flush=True)
        del qts, ws

    for name, (N, K) in {} if a.gemv_only else GEMM_SHAPES.items():
        M = 4096
        qt = random_qt(N, K)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        best = None
        for bm, bn, bk, warps, stages in GEMM_CONFIGS:
            try:
                t = events_time(functools.partial(gemm.qgemm, x, qt, bm, bn, bk, warps, stages), reps=10)
            except Exception as e:  # noqa: BLE001 - a config that does not fit shared memory
                print(f"  config {(bm, bn, bk, warps, stages)} failed: {type(e).__name__}", flush=True)
                continue
            res["sweep"].append({"shape": name, "M": M, "config": str((bm, bn, bk, warps, stages)), "us": t * 1e6})
            if best is None or t < best[0]:
                best = (t, (bm, bn, bk, warps, stages))
        t_deq = events_time(functools.partial(gemm.qgemm_dequant, x, qt), reps=10)
        t_cublas = events_time(lambda x=x, w=w: x @ w.T, reps=10)
        flops = 2 * M * N * K
        row = {"shape": name, "M": M, "N": N, "K": K, "us": best[0] * 1e6, "config": best[1],
               "tflops": flops / best[0] / 1e12, "cublas_tflops": flops / t_cublas / 1e12,
               "pct_cublas": t_cublas / best[0], "dequant_cublas_us": t_deq * 1e6,
               "dequant_cublas_tflops": flops / t_deq / 1e12, "dequant_pct_cublas": t_cublas / t_deq}
        res["gemm"].append(row)
        print(f"gemm {name}: fused {row['tflops']:.0f} TFLOP/s = {row['pct_cublas'] * 100:.0f}% of cuBLAS bf16 "
              f"({row['cublas_tflops']:.0f}); dequantize + cuBLAS {row['dequant_pct_cublas'] * 100:.0f}%", flush=True)

    print(f"\n{res['gpu']}; copy bandwidth {copy_bw / 1e12:.2f} TB/s; bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s")
    print(f"{'4-bit GEMV (g64, bf16); default launch':36s} {'M':>3s} {'us':>8s} {'TB/s':>6s} {'%copy':>6s} "
          f"{'read-only us':>12s} {'%copy':>6s} {'cuBLAS us':>10s} {'cuBLAS %copy':>12s} {'speedup':>8s} "
          f"{'best us':>8s}  best config")
    for r in res["gemv"]:
        print(f"{r['shape']:36s} {r['M']:3d} {r['us']:8.1f} {r['bandwidth_Bps'] / 1e12:6.2f} "
              f"{r['pct_copy_bw'] * 100:5.0f}% {r.get('read_ceiling_us', float('nan')):12.1f} "
              f"{r.get('read_ceiling_pct_copy_bw', float('nan')) * 100:5.0f}% {r['cublas_bf16_us']:10.1f} "
              f"{r['cublas_pct_copy_bw'] * 100:11.0f}% {r['speedup_vs_cublas']:7.2f}x {r.get('best_us', r['us']):8.1f}"
              f"  {r['config']}")
    wrong = [c for c in res["correctness"] if not c.get("ok", True)]
    print(f"correctness: {len(res['correctness'])} checks, {len(wrong)} over 1e-2: {wrong}")
    print(f"\n{'4-bit GEMM M=4096':36s} {'fused':>8s} {'%cuBLAS':>8s} {'deq+cuBLAS':>11s} {'%cuBLAS':>8s} "
          f"{'cuBLAS bf16':>12s}  fused config (TFLOP/s)")
    for r in res["gemm"]:
        print(f"{r['shape']:36s} {r['tflops']:8.0f} {r['pct_cublas'] * 100:7.0f}% {r['dequant_cublas_tflops']:11.0f} "
              f"{r['dequant_pct_cublas'] * 100:7.0f}% {r['cublas_tflops']:12.0f}  {r['config']}")
    return res
