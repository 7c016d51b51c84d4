"""Causal depthwise conv1d with a carried state (Gated DeltaNet's short convolution), the torch oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: str | None = "silu"):
    """x [B, T, C]; weight [C, W] (width W); state [B, C, W-1]: the W-1 inputs before x (zeros if None).

    y[t, c] = act(sum_j weight[c, j] * xs[t + j, c]) over xs = cat(state, x) in time.
    Returns (y [B, T, C] in x's dtype, new state [B, C, W-1] = the last W-1 inputs of xs)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, W):
        raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)}, expected ({C}, W)")
    if state is None:
        state = x.new_zeros(B, C, W - 1)
    elif state.shape != (B, C, W - 1):
        raise ValueError(f"causal_conv1d: state {tuple(state.shape)}, expected {(B, C, W - 1)}")
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.conv1d(xs.to(dt), weight.to(dt)[:, None, :], groups=C)  # [B, C, T]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    return y.transpose(1, 2).to(x.dtype), xs[..., xs.shape[-1] - (W - 1):].clone()
