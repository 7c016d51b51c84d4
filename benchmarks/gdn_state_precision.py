"""Issue #43's question: may a Gated DeltaNet decode keep its state in bf16 at large batches (half the state
traffic)? The recurrence token by token at Qwen3-Next's head shape (K = V = 128), the state rounded to bf16 after
every step (what a decode kernel storing it in bf16 would do; the math in fp32), to nearest or stochastically,
against the fp32 state, both against fp64; the rounding of the output itself to bf16 as the yardstick.

    python -m benchmarks run gdn_state_precision [--tokens 4096] [--heads 16]

Inputs: q, k l2-normalised (q times K^-1/2), v ~ N(0, 1), beta = sigmoid(N(0, 1)), and the decay
g = -A softplus(a + dt_bias), a ~ N(0, 0.25), with A from 1 to 16 and dt from 1e-3 to 1e-1 across the heads (HF's
initialisation ranges; head 0 the slowest decay, the longest memory). Error: relative L2 of o over the last 512
tokens, per head.
"""

from __future__ import annotations

import argparse
import math

import torch


def _round_stochastic(S: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16 -> fp32, rounded stochastically (random low 16 bits added, then cut)."""
    noise = torch.randint(0, 1 << 16, S.shape, generator=gen, dtype=torch.int32)
    return ((S.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32)


def _decode(T: int, H: int, K: int, dtype: torch.dtype, store: str | None) -> torch.Tensor:
    """o [T, H, K] of T decode steps (the same inputs for every call); store: None (the state in dtype), "nearest" or
    "stochastic" (rounded to bf16 after each step)."""
    A = torch.linspace(1, 16, H, dtype=torch.float64)
    dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), H, dtype=torch.float64))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1
    gen, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(7)
    S = torch.zeros(H, K, K, dtype=dtype)
    out = []
    for _ in range(T):
        q = torch.nn.functional.normalize(torch.randn(H, K, generator=gen, dtype=torch.float64), dim=-1) * K ** -0.5
        k = torch.nn.functional.normalize(torch.randn(H, K, generator=gen, dtype=torch.float64), dim=-1)
        v = torch.randn(H, K, generator=gen, dtype=torch.float64)
        beta = torch.sigmoid(torch.randn(H, generator=gen, dtype=torch.float64))
        g = -A * torch.nn.functional.softplus(torch.randn(H, generator=gen, dtype=torch.float64) * 0.5 + dt_bias)
        q, k, v, beta, g = (x.to(dtype) for x in (q, k, v, beta, g))
        S = S * g.exp()[:, None, None]
        S = S + k[:, :, None] * ((v - torch.einsum("hkv,hk->hv", S, k)) * beta[:, None])[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q).double())
        if store == "nearest":
            S = S.bfloat16().float()
        elif store == "stochastic":
            S = _round_stochastic(S, noise)
    return torch.stack(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)
    T, H, K = args.tokens, args.heads, 128
    ref = _decode(T, H, K, torch.float64, None)
    last = slice(max(0, T - 512), T)

    def rel(o):  # per head
        return ((o[last] - ref[last]).norm(dim=(0, 2)) / ref[last].norm(dim=(0, 2))).tolist()

    figures = {"tokens": T, "heads": H, "K": K,
               "fp32_state": rel(_decode(T, H, K, torch.float32, None)),
               "bf16_state_nearest": rel(_decode(T, H, K, torch.float32, "nearest")),
               "bf16_state_stochastic": rel(_decode(T, H, K, torch.float32, "stochastic")),
               "o_in_bf16": float((ref[last].bfloat16().double() - ref[last]).norm() / ref[last].norm())}
    print(f"{T} decode steps, relative error of o over the last {last.stop - last.start} tokens, per head "
          "(slowest decay first):")
    for key in ("fp32_state", "bf16_state_nearest", "bf16_state_stochastic"):
        print(f"  {key:22s} " + " ".join(f"{e:.1e}" for e in figures[key]))
    print(f"  o rounded to bf16 (the yardstick): {figures['o_in_bf16']:.1e}")
    return figures
