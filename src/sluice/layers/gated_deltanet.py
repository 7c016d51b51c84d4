"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the Triton kernels of `kernels.gdn` on CUDA (the state
updated in place in the cache), the torch references elsewhere.

Projections are held in Qwen3.5's separate, non-interleaved order, fused into one matmul:
rows [q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | b (nv) | a (nv)]. Qwen3-Next's interleaved
`in_proj_qkvz` / `in_proj_ba` are reordered into it at load time (`deinterleave_qkvz_ba`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sluice.kernels.conv1d.reference import causal_conv1d
from sluice.kernels.gdn import triton_for as gdn_kernels
from sluice.kernels.gdn.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from sluice.kernels.norm.reference import gated_rms_norm
from sluice.layers.linear import Linear

RECURRENT_MAX_TOKENS = 8  # on the GPU, up to this many tokens step through the recurrence; more, the chunked form


def qkvz_rows(nk: int, dk: int, nv: int, dv: int) -> torch.Tensor:
    """Row order turning Qwen3-Next's interleaved in_proj_qkvz (per k-group g: [q_g | k_g | v_g | z_g]) into
    [q | k | v | z]: out[i] = interleaved[rows[i]]."""
    r = nv // nk
    per = 2 * dk + 2 * r * dv
    base = torch.arange(nk)[:, None] * per
    q = (base + torch.arange(dk)).reshape(-1)
    k = (base + dk + torch.arange(dk)).reshape(-1)
    v = (base + 2 * dk + torch.arange(r * dv)).reshape(-1)
    z = (base + 2 * dk + r * dv + torch.arange(r * dv)).reshape(-1)
    return torch.cat([q, k, v, z])


def ba_rows(nk: int, nv: int) -> torch.Tensor:
    """Row order turning in_proj_ba (per k-group g: [b_g (r) | a_g (r)]) into [b | a]."""
    r = nv // nk
    base = torch.arange(nk)[:, None] * 2 * r
    return torch.cat([(base + torch.arange(r)).reshape(-1), (base + r + torch.arange(r)).reshape(-1)])


class GatedDeltaNet(nn.Module):
    def __init__(self, in_proj: nn.Module, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 norm_weight: torch.Tensor, out_proj: Linear, nk: int, nv: int, dk: int, dv: int, eps: float,
                 state_index: int):
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.register_buffer("conv_weight", conv_weight)  # [C, W], C = 2*nk*dk + nv*dv
        self.register_buffer("A_log", A_log)
        self.register_buffer("dt_bias", dt_bias)
        self.register_buffer("norm_weight", norm_weight)
        self.nk, self.nv, self.dk, self.dv, self.eps = nk, nv, dk, dv, eps
        self.state_index = state_index

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        B, T, _ = x.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        kd, vd = nk * dk, nv * dv
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([2 * kd + vd, vd, nv, nv], dim=-1)
        i = self.state_index
        conv_state = cache.conv[i] if cache is not None else None
        kernels = gdn_kernels(x, (dk, dv))
        if kernels is None:
            mixed, new_conv = causal_conv1d(mixed, self.conv_weight, conv_state, activation="silu")
        elif T == 1 and conv_state is not None:  # decode: the conv state shifted in place
            mixed = kernels.causal_conv1d_update(mixed[:, 0], self.conv_weight, conv_state)[:, None]
            new_conv = conv_state
        else:
            mixed, new_conv = kernels.causal_conv1d(mixed, self.conv_weight, conv_state, activation="silu")
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        q, k, v = q.reshape(B, T, nk, dk), k.reshape(B, T, nk, dk), v.reshape(B, T, nv, dv)
        state = cache.recurrent[i] if cache is not None else None
        if kernels is not None:  # the state is updated in place, the gates computed in the kernels
            if state is None:
                state = torch.zeros(B, nv, dk, dv, dtype=torch.float32, device=x.device)
            rule = (kernels.fused_recurrent_gated_delta_rule if T <= RECURRENT_MAX_TOKENS
                    else kernels.chunk_gated_delta_rule)
            o = rule(q, k, v, a, b, state, self.A_log, self.dt_bias, use_qk_l2norm=True)
            new_state = state
        else:
            beta = b.sigmoid()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            rule = recurrent_gated_delta_rule if T == 1 and state is not None else chunk_gated_delta_rule
            o, new_state = rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True)
        if cache is not None:
            cache.conv[i], cache.recurrent[i] = new_conv, new_state.float()
        norm = gated_rms_norm if kernels is None else kernels.gated_rms_norm
        o = norm(o.to(x.dtype), z.reshape(B, T, nv, dv), self.norm_weight, self.eps)
        return self.out_proj(o.reshape(B, T, vd))
