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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul_gpu import copies_for, copy_bandwidth, graph_time, qt_bytes, random_qt, rel_err  # noqa: E402

from sluice.kernels.qmatmul import reference  # noqa: E402
from sluice.kernels.qmatmul import triton as tq  # noqa: E402

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
        cands = [("qgemv", tq.qgemv, dict(block_n=bn, num_warps=w, split_k=sp, g_max=g))
                 for bn, w, sp, g in itertools.product((8, 16, 32, 64), (1, 2, 4), (None, steps), (4, 8))]
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
