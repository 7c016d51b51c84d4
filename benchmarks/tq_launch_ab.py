"""The CUDA TurboQuant decode kernel's launch variants side by side, same run, graph replay, cold L2, with our bf16
kernel and SDPA on the same shapes for the ratios:

    python benchmarks/tq_launch_ab.py [--json out.json]

Variants (q already rotated, output rotated back and written in bf16, as `attention_gpu.py`'s kernel column):
  split+merge        the split kernel, then the merge kernel, no PDL on the split kernel;
  split+merge pdl    the same, the split kernel launched with programmatic dependent launch;
  one launch cN      splits merged in thread-block clusters of N, the last cluster of a head writes the output;
  ahead              a warp's two blocks both in flight, each refilled after its compute (ISSUE_AHEAD);
  default policy     the clusters placed by the default scheduling policy rather than spread.
Each row also prints the plans and the clusters the GPU holds at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gpu import make_cache, ours, sdpa  # noqa: E402
from qmatmul_gpu import L2_BYTES, graph_time  # noqa: E402
from sluice.kernels import nvrtc  # noqa: E402
from sluice.kernels.attention import cuda as tq_cuda  # noqa: E402
from sluice.kernels.qmatmul.triton import pdl  # noqa: E402

CASES = [("qwen3-next 16q/2kv D256", 16, 2, 256), ("8kv D128 (32q)", 32, 8, 128)]
SIZES = [(32768, 1), (4096, 1), (32768, 16)]
VARIANTS = {"split+merge": dict(fused=False, pdl=False), "split+merge pdl": dict(fused=False, pdl=True),
            "pdl ahead": dict(fused=False, pdl=True, ahead=True),
            "one launch c8": dict(fused=True, pdl=True, cluster=8),
            "c8 ahead": dict(fused=True, pdl=True, cluster=8, ahead=True),
            "c8 default policy": dict(fused=True, pdl=True, cluster=8, policy=0),
            "c4 ahead": dict(fused=True, pdl=True, cluster=4, ahead=True)}


def caches_for(B, Hkv, S, D, quant, g):
    first = make_cache(B, Hkv, S, D, quant, g)
    per = sum(t.numel() * t.element_size() for t in first.values())
    return [first] + [make_cache(B, Hkv, S, D, quant, g) for _ in range(max(1, 4 * L2_BYTES // per))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for S, B in SIZES:
        for shape, Hq, Hkv, D in CASES:
            row = {"shape": shape, "context": S, "batch": B}
            scale = D ** -0.5
            pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
            caches = caches_for(B, Hkv, S, D, True, g)
            q = torch.randn(B, Hq, D, device="cuda", generator=g)  # as rotated: fp32
            ref = None
            plan_args = (B * Hkv, S, 64, D, Hq // Hkv, torch.bfloat16, torch.int32, q.device)
            unfused_plan = tq_cuda.plan(*plan_args)
            row["plan split+merge"] = unfused_plan
            try:
                for name, v in VARIANTS.items():
                    tq_cuda.FUSED, tq_cuda.CLUSTER = v["fused"], v.get("cluster", 8)
                    tq_cuda.ISSUE_AHEAD, nvrtc.CLUSTER_POLICY = v.get("ahead", False), v.get("policy", 1)
                    tq_cuda.pdl = pdl if v["pdl"] else (lambda device: False)
                    splits = unfused_plan[0] if v.get("same_plan") else None
                    if v["fused"]:
                        kern = tq_cuda.kernel(D, Hq // Hkv, torch.bfloat16, torch.int32, q.device, fused=True)
                        row[f"clusters {name}"] = kern.max_active_clusters(128, tq_cuda.smem_bytes(D, Hq // Hkv),
                                                                           tq_cuda.CLUSTER)
                        row[f"plan {name}"] = tq_cuda.plan(*plan_args, splits=splits, fused=True)
                    out = ours(q, caches[0], pos, scale, S, True, splits, rotated=True).float()
                    ref = out if ref is None else ref
                    row[f"{name} rel"] = float((out - ref).norm() / ref.norm())
                    row[name] = graph_time([lambda c=c: ours(q, c, pos, scale, S, True, splits, rotated=True)
                                            for c in caches]) * 1e6
            finally:
                tq_cuda.FUSED, tq_cuda.CLUSTER, tq_cuda.pdl = True, 8, pdl
                tq_cuda.ISSUE_AHEAD, nvrtc.CLUSTER_POLICY = False, 1
            del caches
            torch.cuda.empty_cache()
            dense = caches_for(B, Hkv, S, D, False, g)
            qb = q.to(torch.bfloat16)
            row["bf16"] = graph_time([lambda c=c: ours(qb, c, pos, scale, S, False) for c in dense]) * 1e6
            row["sdpa"] = graph_time([lambda c=c: sdpa(qb, c, scale) for c in dense]) * 1e6
            del dense
            torch.cuda.empty_cache()
            res["rows"].append(row)
            print(row, flush=True)
    names = list(VARIANTS)
    best = lambda r: min(r[n] for n in names)  # noqa: E731
    print(f"\n{res['gpu']}; graph replay, cold L2; us (ratios: bf16 kernel / best, SDPA / best)")
    print(f"{'shape':<26}{'ctx':>7}{'B':>4}" + "".join(f"{n:>17}" for n in names + ["bf16", "sdpa"])
          + f"{'x bf16':>8}{'x sdpa':>8}")
    for r in res["rows"]:
        print(f"{r['shape']:<26}{r['context']:>7}{r['batch']:>4}" + "".join(f"{r[n]:>19.1f}" for n in names)
              + f"{r['bf16']:>19.1f}{r['sdpa']:>19.1f}{r['bf16'] / best(r):>8.2f}{r['sdpa'] / best(r):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
