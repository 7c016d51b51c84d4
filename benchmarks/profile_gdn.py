"""Our Gated DeltaNet prefill (the prep and scan launches) at Qwen3-Next's shape, for `ncu`:

    ncu --clock-control none -k regex:_chunk_ --set full python benchmarks/profile_gdn.py [T]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_gpu import HV, D, make, ours_prefill  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
x = make(T)
state = torch.zeros(1, HV, D, D, device="cuda")
for _ in range(2):
    ours_prefill(x, state)
torch.cuda.synchronize()
print(f"# T={T} done", flush=True)
