"""A Gated DeltaNet layer's whole decode step between its two projections, in one Triton launch: the causal conv
update (silu), the gated delta rule on the recurrent state, and the gated output norm. What the three kernels
`conv1d.triton.causal_conv1d_update`, `triton.fused_recurrent_gated_delta_rule` and `norm.triton.gated_rms_norm`
compute one after the other, rounded where they round (the conv output and o to the activations' dtype, the norm as
`norm.reference.gated_rms_norm`).

One program per (key head, sequence): it owns the conv channels of its key head's q and k and of the value heads
that share them, so it reads each channel's old conv state and writes the new one with no other program touching it
(programs split by value head would race on the shared q/k channels). It then runs its value heads one after the
other, each head's whole [K, V] state in registers, which the norm over V needs anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.gdn.triton import MAX_HEAD_DIM, _softplus
from sluice.kernels.launch import INTERPRET, pdl, pdl_start
from sluice.kernels.norm.triton import round_to


@triton.jit
def _conv_window(x_row, s_row, w_ptr, ch, live, stride_sc, stride_sk, stride_wc, stride_wk, W: tl.constexpr,
                 WP: tl.constexpr, RNE_BF16: tl.constexpr):
    """silu(causal conv) of channels `ch` for the new token, rounded to x's dtype (fp32 values), and the channels'
    new conv state [WP, len(ch)] (the window shifted left, the token appended) to be stored once every read is
    done. As `conv1d.triton._conv1d_update_kernel`."""
    x_dtype = x_row.dtype.element_ty
    k = tl.arange(0, WP)[:, None]
    xv = tl.load(x_row + ch)[None, :]
    win = tl.load(s_row + ch[None, :] * stride_sc + k * stride_sk, mask=(k < W - 1) & live, other=0.0).to(x_dtype)
    win = tl.where(k == W - 1, xv, win).to(tl.float32)
    w = tl.load(w_ptr + ch[None, :] * stride_wc + k * stride_wk, mask=k < W, other=0.0)
    y = tl.sum(w.to(tl.float32) * win, axis=0)
    y = round_to(y * tl.sigmoid(y), x_dtype, RNE_BF16)
    ns = tl.load(s_row + ch[None, :] * stride_sc + (k + 1) * stride_sk, mask=(k < W - 2) & live,
                 other=0.0).to(x_dtype)
    return y, tl.where(k == W - 2, xv, ns)


@triton.jit
def _decode_kernel(p_ptr, cw_ptr, cs_ptr, s_ptr, alog_ptr, dtb_ptr, nw_ptr, idx_ptr, o_ptr, scale, eps,
                   stride_pb, stride_cws, stride_cwk, stride_css, stride_csc, stride_csk, stride_ss, stride_sh,
                   stride_ob, NK: tl.constexpr, NV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   W: tl.constexpr, WP: tl.constexpr, H_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (key head, sequence). The projection row is [q (NK*K) | k (NK*K) | v (NV*V) | z (NV*V) | b (NV) |
    a (NV)]; the conv covers its first 2*NK*K + NV*V channels."""
    pdl_start(PDL)
    kh = tl.program_id(0)
    n = tl.program_id(1)
    R: tl.constexpr = NV // NK
    C: tl.constexpr = 2 * NK * K + NV * V
    slot = tl.load(idx_ptr + n)
    live = (tl.zeros((WP, 1), tl.int32) + slot) >= 0  # < 0: zero states in, none written
    x_row = p_ptr + n.to(tl.int64) * stride_pb
    s_row = cs_ptr + slot.to(tl.int64) * stride_css
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    ch_q = kh * K + offs_k
    ch_k = NK * K + ch_q
    q, new_q = _conv_window(x_row, s_row, cw_ptr, ch_q, live, stride_csc, stride_csk, stride_cws, stride_cwk, W, WP,
                         RNE_BF16)
    k, new_k = _conv_window(x_row, s_row, cw_ptr, ch_k, live, stride_csc, stride_csk, stride_cws, stride_cwk, W, WP,
                         RNE_BF16)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    w_norm = tl.load(nw_ptr + offs_v).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    for r in tl.static_range(R):
        h = kh * R + r
        ch_v = 2 * NK * K + h * V + offs_v
        v, new_v = _conv_window(x_row, s_row, cw_ptr, ch_v, live, stride_csc, stride_csk, stride_cws, stride_cwk, W,
                             WP, RNE_BF16)
        tl.debug_barrier()  # every read of the head's conv channels before the writes
        tl.store(s_row + ch_v[None, :] * stride_csc + tl.arange(0, WP)[:, None] * stride_csk,
                 new_v.to(cs_ptr.dtype.element_ty), mask=(tl.arange(0, WP)[:, None] < W - 1) & live)
        a = tl.load(x_row + C + NV * V + NV + h).to(tl.float32)
        b = tl.load(x_row + C + NV * V + h).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * _softplus(a + tl.load(dtb_ptr + h).to(tl.float32))
        beta = tl.sigmoid(b)
        tile = s_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + offs_k[:, None] * V + offs_v[None, :]
        live_s = (tl.zeros((K, V), tl.int32) + slot) >= 0
        S = tl.load(tile, mask=live_s, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * delta[None, :]
        tl.store(tile, S, mask=live_s)
        o = round_to(tl.sum(S * q[:, None], axis=0), dtype, RNE_BF16)
        # the gated norm (`norm.triton._gated_rms_norm_kernel`) of the head's o and z
        normed = round_to(o * tl.rsqrt(tl.sum(o * o, axis=0) / V + eps), dtype, RNE_BF16)
        hw = round_to(w_norm * normed, H_DTYPE, RNE_BF16)
        z = tl.load(x_row + C + h * V + offs_v).to(tl.float32)
        out = round_to(hw * (z * tl.sigmoid(z)), dtype, RNE_BF16)
        tl.store(o_ptr + n.to(tl.int64) * stride_ob + h * V + offs_v, out.to(dtype))
    tl.debug_barrier()  # the q and k channels' reads (by every thread) before their writes
    rows_w = tl.arange(0, WP)[:, None]
    w_ok = (rows_w < W - 1) & live
    tl.store(s_row + ch_q[None, :] * stride_csc + rows_w * stride_csk, new_q.to(cs_ptr.dtype.element_ty), mask=w_ok)
    tl.store(s_row + ch_k[None, :] * stride_csc + rows_w * stride_csk, new_k.to(cs_ptr.dtype.element_ty), mask=w_ok)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def applies(nk: int, nv: int, dk: int, dv: int) -> bool:
    """Whether `decode_step` runs these head shapes: power-of-two head dims (a head is one register tile), value
    heads a multiple of the key heads."""
    pow2 = lambda d: d & (d - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and max(dk, dv) <= MAX_HEAD_DIM and nv % nk == 0


def decode_step(proj: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                rows: torch.Tensor, nk: int, nv: int, dk: int, dv: int, num_warps: int = 8) -> torch.Tensor:
    """One decode token of B sequences: proj [B, 2*nk*dk + 2*nv*dv + 2*nv] (the in-projection's output row, unit
    last stride), conv_weight [C, W], conv_state [slots, C, W-1] and state fp32 [slots, nv, dk, dv] (sequence b
    in slot rows[b], < 0: zero states in, none written), A_log, dt_bias [nv], norm_weight [dv] -> the gated norm's
    output [B, nv*dv] in proj's dtype, the states advanced in place."""
    what = "gdn decode_step"
    B, N = proj.shape
    C, W = conv_weight.shape
    if not applies(nk, nv, dk, dv):
        raise ValueError(f"{what}: head shapes nk={nk} nv={nv} dk={dk} dv={dv} are not supported")
    if C != 2 * nk * dk + nv * dv or N != C + nv * dv + 2 * nv or proj.stride(1) != 1:
        raise ValueError(f"{what}: proj must be [B, {2 * nk * dk + 2 * nv * dv + 2 * nv}] with a unit last stride "
                         f"and conv_weight [{2 * nk * dk + nv * dv}, W], got {tuple(proj.shape)} and {(C, W)}")
    if conv_state.shape[1:] != (C, W - 1) or state.shape[1:] != (nv, dk, dv) or state.dtype != torch.float32 \
            or state.stride(3) != 1 or state.stride(2) != dv:
        raise ValueError(f"{what}: conv_state must be [slots, {C}, {W - 1}] and state fp32 contiguous [slots, {nv}, "
                         f"{dk}, {dv}], got {tuple(conv_state.shape)} and {state.dtype} {tuple(state.shape)}")
    if rows.shape != (B,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: rows must be int32/int64 [{B}], got {rows.dtype} {tuple(rows.shape)}")
    out = torch.empty((B, nv * dv), dtype=proj.dtype, device=proj.device)
    if B == 0:
        return out
    h_dtype = _TL[torch.promote_types(norm_weight.dtype, proj.dtype)]  # `weight * normed` in torch
    _decode_kernel[(nk, B)](
        proj, conv_weight, conv_state, state, A_log, dt_bias, norm_weight, rows, out, dk ** -0.5, eps,
        proj.stride(0), conv_weight.stride(0), conv_weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), state.stride(0), state.stride(1), out.stride(0), NK=nk, NV=nv, K=dk, V=dv, W=W,
        WP=triton.next_power_of_2(W), H_DTYPE=h_dtype, RNE_BF16=INTERPRET, PDL=pdl(proj.device),
        launch_pdl=pdl(proj.device), num_warps=num_warps)
    return out
