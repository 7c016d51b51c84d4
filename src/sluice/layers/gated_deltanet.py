"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the Triton kernels of `kernels.gdn` on CUDA (the state
updated in place in the cache), the torch references elsewhere.

Projections are held in Qwen3.5's separate, non-interleaved order, fused into one matmul:
rows [q (nk*dk) | k (nk*dk) | v (nv*dv) | z (nv*dv) | b (nv) | a (nv)]. Qwen3-Next's interleaved
`in_proj_qkvz` / `in_proj_ba` are reordered into it at load time (`deinterleave_qkvz_ba`).
"""

from __future__ import annotations

import functools

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

    def forward(self, x: torch.Tensor, cache, meta) -> torch.Tensor:
        """x [B, T, hidden] of the sequences in meta's cache rows; their conv and recurrent states advance in place."""
        B, T, _ = x.shape
        nv, dv = self.nv, self.dv
        kernels = gdn_kernels(x, (self.dk, self.dv))
        proj = None  # a decode step: the in-projection and the conv in one launch where it fits
        in_proj = self.in_proj
        if kernels is not None and meta.decode and T == 1 and isinstance(in_proj, Linear) and in_proj.quantized:
            proj = kernels.projection_conv(x[:, 0], self.in_proj.qt, self.conv_weight,
                                           cache.conv(self.state_index), meta.rows)
        conv_done = proj is not None
        proj = self.in_proj(x) if proj is None else proj[:, None]
        mixed, z, b, a = proj.split([2 * self.nk * self.dk + nv * dv, nv * dv, nv, nv], dim=-1)
        z = z.reshape(B, T, nv, dv)
        # a few tokens (decode) through the recurrent kernel: the gated norm runs in the same launch
        fused_norm = kernels is not None and not meta.flat and T <= RECURRENT_MAX_TOKENS and mixed.dtype == x.dtype
        if meta.flat:  # the step's sequences, each through its own states: the cut of a piecewise graph
            o = cache.mix(functools.partial(self._mix_flat, kernels, cache), meta, mixed, b, a)
        else:
            o = self._mix(kernels, mixed, b, a, cache, meta, z if fused_norm else None, conv_done)
        if not fused_norm:
            norm = gated_rms_norm if kernels is None else kernels.gated_rms_norm
            o = norm(o.to(x.dtype), z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(B, T, nv * dv))

    def _mix_flat(self, kernels, cache, meta, mixed, b, a):
        """Conv + gated delta rule of a flat forward (`engine/batch.py`: B = 1, the decode tokens first, then the
        prompt chunks): o [1, T, nv, dv], zero for the padding tokens. On a GPU the conv of every segment in one
        launch (a decode token is a segment of one token), the decode tokens through the recurrent kernel, the
        chunks through the chunked one with their offsets, both writing into o; static (`ForwardMeta.static`): over
        all T tokens, each kernel skipping the tokens that are not its own. Elsewhere each segment alone through
        the references."""
        i = self.state_index
        conv_state, state = cache.conv(i), cache.recurrent(i)
        o = mixed.new_zeros(1, mixed.shape[1], self.nv, self.dv)
        if kernels is None:
            for t0, t1, row in meta.segments():
                o[:, t0:t1] = self._reference(mixed[:, t0:t1], b[:, t0:t1], a[:, t0:t1], conv_state[row:row + 1],
                                              state[row:row + 1])
            return o
        # the segment tables whole (padded to the step's rows): the kernels' compile-time sizes (a power of two of
        # the segments) stay those of the step's graph, where a count of prompts not seen before would compile
        # them again mid-serving, for seconds
        D, S = meta.decode_tokens, meta.chunks
        N = mixed.shape[1] if meta.static else meta.tokens
        conv = kernels.causal_conv1d(mixed[:, :N], self.conv_weight, conv_state, activation="silu",
                                     cu_seqlens=meta.cu_seqlens, state_indices=meta.rows)[0]
        q, k, v = self._split_heads(conv)
        rule = dict(A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm=True)
        decode_rows = meta.decode_index if meta.static else meta.rows[:D]  # static: every token, -1 = not a decode
        n = decode_rows.shape[0]
        if n:
            one = lambda x: x[0, :n, None]  # noqa: E731  [1, n, ...] -> [n, 1, ...]: one token per sequence
            kernels.fused_recurrent_gated_delta_rule(one(q), one(k), one(v), one(a), one(b), state,
                                                     state_indices=decode_rows, out=one(o), **rule)
        if S or meta.static:
            cu = meta.chunk_cu
            kernels.chunk_gated_delta_rule(q, k, v, a[:, :N], b[:, :N], state, state_indices=meta.chunk_rows,
                                           cu_seqlens=cu, out=o[:, :N],
                                           chunk_first=meta.once("chunk_first", lambda: kernels.chunk_offsets(cu)),
                                           **rule)
        return o

    def _mix(self, kernels, mixed, b, a, cache, meta, norm_gate=None, conv_done=False):
        """Conv + gated delta rule of the sequences in meta's rows, their states advanced in place. With norm_gate
        (z [B, T, nv, dv]; the kernels' recurrent path only): the output gated-RMS-normalised in the same launch.
        conv_done: mixed is already convolved (`projection_conv`)."""
        i = self.state_index
        conv_state, state = cache.conv(i), cache.recurrent(i)
        if kernels is not None:
            return self._kernels(kernels, mixed, b, a, conv_state, state, meta, norm_gate, conv_done)
        # one sequence at a time, as a sequence alone takes it
        rows = meta.rows_host if meta.decode else range(meta.row0, meta.row0 + mixed.shape[0])
        return torch.cat([self._reference(mixed[j:j + 1], b[j:j + 1], a[j:j + 1], conv_state[r:r + 1],
                                          state[r:r + 1]) for j, r in enumerate(rows)])

    def _split_heads(self, mixed):
        B, T = mixed.shape[:2]
        q, k, v = mixed.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        return (q.reshape(B, T, self.nk, self.dk), k.reshape(B, T, self.nk, self.dk),
                v.reshape(B, T, self.nv, self.dv))

    def _kernels(self, kernels, mixed, b, a, conv_state, state, meta, norm_gate=None, conv_done=False):
        """The Triton kernels: conv and rule read and update the states of meta's rows in place (norm_gate: as
        `_mix`)."""
        T = mixed.shape[1]
        rows = meta.rows
        if conv_done:  # by the in-projection's launch (`projection_conv`)
            pass
        elif meta.decode:  # the conv state shifted in place
            mixed = kernels.causal_conv1d_update(mixed[:, 0], self.conv_weight, conv_state, state_indices=rows)[:, None]
        else:
            mixed = kernels.causal_conv1d(mixed, self.conv_weight, conv_state, activation="silu",
                                          state_indices=rows)[0]
        if T <= RECURRENT_MAX_TOKENS:
            norm = {} if norm_gate is None else {"z": norm_gate, "norm_weight": self.norm_weight, "norm_eps": self.eps}
            return kernels.fused_recurrent_gated_delta_rule(*self._split_heads(mixed), a, b, state, self.A_log,
                                                            self.dt_bias, state_indices=rows, use_qk_l2norm=True,
                                                            **norm)
        return kernels.chunk_gated_delta_rule(*self._split_heads(mixed), a, b, state, self.A_log, self.dt_bias,
                                              state_indices=rows, use_qk_l2norm=True)

    def _reference(self, mixed, b, a, conv_state, state):
        """The torch references for one sequence; its states (views of its cache row) updated in place."""
        mixed, new_conv = causal_conv1d(mixed, self.conv_weight, conv_state, activation="silu")
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule = recurrent_gated_delta_rule if mixed.shape[1] == 1 else chunk_gated_delta_rule
        o, new_state = rule(*self._split_heads(mixed), g, beta, initial_state=state, use_qk_l2norm=True)
        conv_state.copy_(new_conv)
        state.copy_(new_state)
        return o
