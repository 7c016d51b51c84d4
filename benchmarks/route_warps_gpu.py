"""The router kernel's warps at decode batch sizes (Qwen3-Next: 512 experts, top-10, shared slot), graph replay.

    PYTHONPATH=src python benchmarks/route_warps_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul_gpu import graph_time  # noqa: E402

from sluice.kernels.moe import triton as mt  # noqa: E402


def main() -> None:
    for T in (1, 16, 64):
        logits = [torch.randn(2, T, 513, device="cuda") for _ in range(8)]
        row = {"T": T}
        for warps in (1, 2, 4):
            row[f"{warps} warps us"] = graph_time([lambda lg=lg, w=warps: mt.route(lg[:, :, :512], 10, True,
                                                                                 lg[:, :, 512], num_warps=w)
                                                   for lg in logits], reps=20) * 1e6
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
