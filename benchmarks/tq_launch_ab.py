"""The CUDA TurboQuant decode kernel's launch variants side by side, same run, graph replay, cold L2, with our bf16
kernel and SDPA on the same shapes for the ratios:

    python benchmarks/tq_launch_ab.py [--json out.json]

Variants (`kernel`: q already rotated, the output rotated back and written in bf16, as `attention_gpu.py`'s kernel
column; `step`: a whole decode step of the layer, the append launch then the kernel, as its step column):
  no pdl        the split kernel launched plainly (it starts once the launch before has finished);
  pdl           launched with programmatic dependent launch (the default), everything read after its wait.
Earlier variants, measured and dropped (docs/PERF.md): one launch with the splits merged in thread-block clusters
(commit 54d9e20, timed by that commit's version of this script: results/attention_tq_launch_ab_h100.json); the
first blocks issued before the wait (results/attention_tq_launch_pdl_h100.json, column "pdl early").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gpu import cold_caches, ours, sdpa, step  # noqa: E402
from qmatmul_gpu import graph_time  # noqa: E402
from sluice.kernels.attention import cuda as tq_cuda  # noqa: E402
from sluice.kernels.launch import pdl  # noqa: E402

CASES = [("qwen3-next 16q/2kv D256", 16, 2, 256), ("8kv D128 (32q)", 32, 8, 128)]
SIZES = [(32768, 1), (4096, 1), (131072, 1), (32768, 16)]
VARIANTS = {"no pdl": False, "pdl": True}


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
            caches = cold_caches(B, Hkv, S, D, True, g)
            q = torch.randn(B, Hq, D, device="cuda", generator=g)  # as rotated: fp32
            qb = q.to(torch.bfloat16)
            kv_new = (torch.randn(B, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16),
                      torch.randn(B, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16))
            ref = None
            try:
                for name, launch_pdl in VARIANTS.items():
                    tq_cuda.pdl = pdl if launch_pdl else (lambda device: False)
                    out = ours(q, caches[0], pos, scale, S, True, rotated=True).float()
                    ref = out if ref is None else ref
                    row[f"{name} rel"] = float((out - ref).norm() / ref.norm())
                    row[f"kernel {name}"] = graph_time([lambda c=c: ours(q, c, pos, scale, S, True, rotated=True)
                                                       for c in caches]) * 1e6
                    row[f"step {name}"] = graph_time([lambda c=c: step(qb, kv_new, c, pos, scale, S, True)
                                                     for c in caches]) * 1e6
            finally:
                tq_cuda.pdl = pdl
            del caches
            torch.cuda.empty_cache()
            dense = cold_caches(B, Hkv, S, D, False, g)
            row["bf16"] = graph_time([lambda c=c: ours(qb, c, pos, scale, S, False) for c in dense]) * 1e6
            row["step bf16"] = graph_time([lambda c=c: step(qb, kv_new, c, pos, scale, S, False) for c in dense]) * 1e6
            row["sdpa"] = graph_time([lambda c=c: sdpa(qb, c, scale) for c in dense]) * 1e6
            del dense
            torch.cuda.empty_cache()
            res["rows"].append(row)
            print(row, flush=True)
    cols = [f"{k} {n}" for k in ("kernel", "step") for n in VARIANTS] + ["bf16", "step bf16", "sdpa"]
    print(f"\n{res['gpu']}; graph replay, cold L2; us. Ratios: bf16 kernel and SDPA over 'kernel pdl', bf16 step "
          "over 'step pdl'")
    print(f"{'shape':<24}{'ctx':>7}{'B':>3}" + "".join(f"{c:>16}" for c in cols) + "  x bf16  x sdpa  x step")
    for r in res["rows"]:
        k, s = r["kernel pdl"], r["step pdl"]
        print(f"{r['shape'][:23]:<24}{r['context']:>7}{r['batch']:>3}" + "".join(f"{r[c]:>16.1f}" for c in cols)
              + f"{r['bf16'] / k:>8.2f}{r['sdpa'] / k:>8.2f}{r['step bf16'] / s:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
