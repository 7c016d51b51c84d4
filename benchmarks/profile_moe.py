"""A few MoE decode steps (one token, 4-bit experts, 8-bit router) at both models' shapes, for `ncu`: each
kernel's own duration, caches flushed between kernels (ncu's default), to set against the graph-replay time
of the whole layer in `moe_gpu.py` (the difference is what launches and dependencies cost):

    ncu --clock-control none --metrics gpu__time_duration.sum python benchmarks/profile_moe.py [model]

model: a key of moe_gpu.MODELS (default: all).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_gpu import MODELS, build_layers  # noqa: E402

args = sys.argv[1:]
names = [a for a in args if a in MODELS] or list(MODELS)
for name in names:
    H, E, I, k, Is = MODELS[name]
    layer = build_layers(H, E, I, k, Is)["8-bit"]
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        layer(x)
    torch.cuda.synchronize()
    print(f"# {name} done", flush=True)
