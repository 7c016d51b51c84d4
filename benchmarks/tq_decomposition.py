"""Where the TurboQuant decode kernel's time goes: the CUDA split kernel (`kernels/attention/tq_decode.cu`) timed
next to copies of itself with one part taken out, split + merge, same run, graph replay, cold L2.

    python benchmarks/tq_decomposition.py [--json out.json]

Variants (text edits of the kernel's source; their outputs are wrong on purpose, only their times count):
  skip_compute  the 32-position loop waits for its copies and does nothing else (what reading costs, with the
                prologue, the epilogue and the merge around it);
  skip_epilogue no last flush, no warp merge, no rotation, no partials written (the merge still runs);
  const_q       q is a constant, not loaded (the prologue's load latency).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gpu import cold_caches, ours  # noqa: E402
from qmatmul_gpu import graph_time  # noqa: E402
from sluice.kernels.attention import cuda as tq_cuda  # noqa: E402

CASES = [("Qwen3-Next 16q/2kv D256", 16, 2, 256, 32768, 1), ("8kv D128 (32q)", 32, 8, 128, 32768, 1),
         ("Qwen3-Next 16q/2kv D256", 16, 2, 256, 4096, 1), ("Qwen3-Next 16q/2kv D256", 16, 2, 256, 32768, 16)]
EPILOGUE = "    __syncthreads();\n    // the warps' partials into the split's"
LAST_FLUSH = "            flush(Ow, ch, cl, psh, psl, vmax * level_step * (1.f / 65535.f), 1.f, 1.f, g, t, wrote);\n"
LOOP_TOP = "                const int pb = (blk0 + warp + i * W) * BLK;\n"
Q_LOAD = "qx[j][hf] = *(const float4*)(qrow + g * sqh + hf * DH + 4 * (WPT * t + s));"


def _edit(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise SystemExit(f"tq_decode.cu changed: the anchor {old.strip()[:60]!r} is not there once; update this script")
    return src.replace(old, new)


def variants(src: str) -> dict[str, str]:
    return {
        "kernel": src,
        "skip_compute": _edit(src, LOOP_TOP, LOOP_TOP + "                if (pb >= 0) { since++; continue; }\n"),
        "skip_epilogue": _edit(_edit(src, LAST_FLUSH, ""), EPILOGUE, "    if (p >= 0) return;\n" + EPILOGUE),
        "const_q": _edit(src, Q_LOAD, "qx[j][hf] = make_float4(0.5f, 0.25f, -0.5f, 1.f);"),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    source = tq_cuda.SOURCE
    tmp = Path(tempfile.mkdtemp())
    paths = {}
    for name, text in variants(source.read_text()).items():
        paths[name] = tmp / f"{name}.cu"
        paths[name].write_text(text)
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    try:
        for shape, Hq, Hkv, D, S, B in CASES:
            caches = cold_caches(B, Hkv, S, D, True, g)
            q = torch.randn(B, Hq, D, device="cuda", generator=g)  # fp32, as rotated: the CUDA kernel's input
            pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
            row = {"shape": shape, "context": S, "batch": B}
            for name, path in paths.items():
                tq_cuda.SOURCE, tq_cuda._kernels = path, {}
                row[name] = graph_time([lambda c=c: ours(q, c, pos, D ** -0.5, S, True, rotated=True)
                                        for c in caches]) * 1e6
            res["rows"].append(row)
            print(row, flush=True)
            del caches
            torch.cuda.empty_cache()
    finally:
        tq_cuda.SOURCE, tq_cuda._kernels = source, {}
    print(f"\n{res['gpu']}; split + merge, graph replay, cold L2; us")
    print(f"{'shape':<26}{'ctx':>7}{'B':>4}" + "".join(f"{n:>15}" for n in paths))
    for r in res["rows"]:
        print(f"{r['shape']:<26}{r['context']:>7}{r['batch']:>4}" + "".join(f"{r[n]:>15.1f}" for n in paths))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
