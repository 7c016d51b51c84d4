"""Profiling driver (not committed): a few launches of the CUDA mma kernel for ncu."""
import torch
from sluice.kernels.moe import mma, reference
from sluice.kernels.moe import triton as mt
from benchmarks.gpu import random_qt
from benchmarks.moe_gpu import stacked_qt

torch.manual_seed(0)
x16 = torch.randn(16, 2048, device="cuda").bfloat16()
qkvz = random_qt(12352, 2048)
head = random_qt(151936, 2048)
for _ in range(2):
    mma.dense(x16, qkvz)                       # planned: mt 1
    mma.dense(x16, head)                       # mt 2
H, E, I, k = 2048, 512, 512, 10
gate_up, down = stacked_qt(E, 2 * I, H), stacked_qt(E, H, I)
for T in (64, 512):
    x = torch.randn(T, H, device="cuda").bfloat16()
    w, ids = reference.route(torch.randn(T, E, device="cuda"), k, True)
    mt.MMA_MIN_ROWS, mt.MMA_MAX_ROWS = 0, 10**9
    run = mt.moe_decode if T <= mt.DECODE_MAX_TOKENS else mt.moe_prefill
    for _ in range(2):
        run(x, ids.int(), w, gate_up, down, summed=False)
torch.cuda.synchronize()
print("done")
