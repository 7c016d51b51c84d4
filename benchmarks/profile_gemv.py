"""One M = 1 GEMV launch at an lm_head shape, for `ncu` (see docs/PERF.md):

    ncu --clock-control none -k regex:_gemv_kernel --set full python benchmarks/profile_gemv.py [N K block_n warps]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul_gpu import random_qt  # noqa: E402

from sluice.kernels.qmatmul import triton as qmm  # noqa: E402

N, K, block_n, warps = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (151936, 2048, 8, 1)
qt = random_qt(N, K)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    qmm.qgemv(x, qt, block_n=block_n, num_warps=warps)
torch.cuda.synchronize()
