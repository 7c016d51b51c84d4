"""Sweep launch options of the M = 1 quantized GEMV at a few shapes (cold L2, CUDA-graph replay); table last.

    python benchmarks/gemv_tune.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul_gpu import copies_for, copy_bandwidth, graph_time, qt_bytes, random_qt, rel_err  # noqa: E402

from sluice.kernels.qmatmul import reference  # noqa: E402
from sluice.kernels.qmatmul import triton as qmm  # noqa: E402



@triton.jit
def _stream_kernel(w_ptr, out_ptr, KW, stride_wn, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Read W [N, KW] int32 in GEMV order and xor it down: the read speed Triton reaches with no arithmetic."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
    for w0 in range(0, KW, BLOCK_W):
        acc ^= tl.load(w_ptr + rows[:, None] * stride_wn + w0 + tl.arange(0, BLOCK_W)[None, :])
    tl.store(out_ptr + rows, tl.xor_sum(acc, axis=1))


def stream(qt, block_n, block_w, num_warps):
    w = qt.weight.view(torch.int32)
    out = torch.empty(w.shape[0], dtype=torch.int32, device=w.device)
    _stream_kernel[(w.shape[0] // block_n,)](w, out, w.shape[1], w.stride(0), BLOCK_N=block_n, BLOCK_W=block_w,
                                             num_warps=num_warps)
    return out


SHAPES = {"q3next lm_head": (151936, 2048), "q3next dense": (16384, 2048), "q3.5 lm_head": (248320, 4096),
          "q3.5 expert gate+up": (2048, 4096)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    rows = []
    for name, (N, K) in SHAPES.items():
        base = random_qt(N, K)
        n = copies_for(qt_bytes(base))
        qts = [base] + [random_qt(N, K) for _ in range(n - 1)]
        xs = [torch.randn(1, K, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        ref = reference.qmatmul(xs[0].float(), base)
        steps = K // 64 // 8
        steps = triton.cdiv(K // 8, 128)
        cands = [("qgemv", qmm.qgemv, dict(block_n=bn, num_warps=w, split_k=sp))
                 for bn, w, sp in itertools.product((2, 4, 8, 16, 32), (1, 2, 4), (None, 1, 2, steps))]
        for kname, fn, kw in cands:
            try:
                err = rel_err(fn(xs[0], base, **kw), ref)
                t = graph_time([lambda q=q, x=x, fn=fn, kw=kw: fn(x, q, **kw) for q, x in zip(qts, xs)], reps=10)
            except Exception as e:
                print(f"{name} {kw} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            moved = qt_bytes(base) + 2 * K + 2 * N
            rows.append({"shape": name, "kernel": kname, "config": kw, "us": t * 1e6, "pct_copy": moved / t / copy_bw,
                         "rel_err": err})
        for bn, bw, w in itertools.product((16, 32), (64, 128), (2, 4)):  # read-only ceiling
            t = graph_time([lambda q=q: stream(q, bn, bw, w) for q in qts], reps=10)
            rows.append({"shape": name, "kernel": "read", "config": dict(block_n=bn, block_w=bw, num_warps=w),
                         "us": t * 1e6, "pct_copy": qt_bytes(base) / t / copy_bw, "rel_err": 0.0})
        del qts
    rows.sort(key=lambda r: (r["shape"], r["us"]))
    print(f"copy {copy_bw / 1e12:.2f} TB/s")
    for r in rows:
        print(f"{r['shape']:20s} {r['kernel']:5s} {r['us']:8.1f} us {r['pct_copy'] * 100:5.1f}% err {r['rel_err']:.1e} "
              f"{r['config']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"copy_bw": copy_bw, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
