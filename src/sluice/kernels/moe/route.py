"""The sparse MoE block's router on CUDA (softmax, top-k, renormalisation; optionally the shared expert's gated slot)
in one launch a batch: `route`. `triton.py` holds the rest of the block's kernels and exposes `route` beside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import launch
from sluice.kernels.moe import check_device

MAX_TOP_K = 16
MAX_EXPERTS = 1024


@triton.jit
def _softmax_topk(logit, offs, ok, TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
                  NORM: tl.constexpr, EXACT: tl.constexpr = True):
    """(weights fp32 [KP], ids int32 [KP]) of the TOP_K best of softmax(logit) (masked entries -inf), best first;
    slots >= TOP_K hold 0. TOP_K rounds of argmax (lowest index on ties), each a single max over int64 keys
    (probability bits << 32 | BLOCK_E - 1 - index): a probability is >= 0, so its fp32 bits order like the
    value, and the low half breaks ties towards the lower index. Not EXACT: int32 keys, the index in the low
    log2(BLOCK_E) bits of the probability's (half as many shuffles per round; probabilities within ~2^-13 of
    each other count as tied: far below the rounding of bf16 router logits)."""
    p = tl.exp(logit - tl.max(logit, axis=0))
    if not NORM:
        p = p / tl.sum(p, axis=0)  # with NORM the weights are renormalised over the chosen ones anyway
    if EXACT:
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs)
    else:
        key = (p.to(tl.int32, bitcast=True) & ~(BLOCK_E - 1)) | (BLOCK_E - 1 - offs)
    key = tl.where(ok, key, -1)  # below every real key: never picked
    offs_k = tl.arange(0, KP)
    top_w = tl.zeros((KP,), dtype=tl.float32)
    top_i = tl.zeros((KP,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        idx = BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32)
        if EXACT:
            top_w = tl.where(offs_k == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_i = tl.where(offs_k == j, idx, top_i)
        key = tl.where(offs == idx, -1, key)
    if not EXACT:  # the chosen probabilities, all in one reduction
        chosen = (offs[None, :] == top_i[:, None]) & (offs_k < TOP_K)[:, None]
        top_w = tl.sum(tl.where(chosen, p[None, :], 0.0), axis=1)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_i


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, gate_ptr, E, S, stride_ls, stride_lt, stride_gs, stride_g,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                  SHARED: tl.constexpr, SPC: tl.constexpr, PDL: tl.constexpr):
    """One token per program: softmax over its E logits, then top-k (`_softmax_topk`). The logits (and gate
    logit) may come as S split-K partials, summed here, SPC at a time by one load (one memory round trip, not
    one per partial). SHARED: one more slot, expert id E (the shared expert), weighted sigmoid(gate logit)."""
    launch.pdl_start(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    sp = tl.arange(0, SPC)
    row = logits_ptr + t.to(tl.int64) * stride_lt
    logit = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s0 in range(0, S, SPC):  # split-K partials of the router matmul
        s = s0 + sp
        logit += tl.sum(tl.load(row + s[:, None] * stride_ls + offs[None, :], mask=(s < S)[:, None] & ok[None, :],
                                other=0.0).to(tl.float32), axis=0)
    logit = tl.where(ok, logit, -float("inf"))
    top_w, top_i = _softmax_topk(logit, offs, ok, TOP_K, KP, BLOCK_E, NORM)
    offs_k = tl.arange(0, KP)
    SLOTS: tl.constexpr = TOP_K + SHARED
    if SHARED:
        top_i = tl.where(offs_k == TOP_K, E, top_i)
        gate = 0.0
        for s0 in range(0, S, SPC):
            s = s0 + sp
            gate += tl.sum(tl.load(gate_ptr + s * stride_gs + t * stride_g, mask=s < S, other=0.0).to(tl.float32))
        top_w = tl.where(offs_k == TOP_K, tl.sigmoid(gate), top_w)
    k_ok = offs_k < SLOTS
    tl.store(ids_ptr + t * SLOTS + offs_k, top_i, mask=k_ok)
    tl.store(w_ptr + t * SLOTS + offs_k, top_w, mask=k_ok)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, shared_gate_logit: torch.Tensor | None = None,
          num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype), or fp32 split-K partials [S, T, E] of them -> (expert ids int32
    [T, k], weights fp32 [T, k]), best first. With the shared expert's gate logits [T] (or [T, 1]; [S, T]
    partials alongside partial logits): one more slot per token, id E weighted sigmoid(gate logit), so that
    `moe_decode` runs the shared expert as one more expert."""
    if logits.dim() not in (2, 3) or not logits.is_floating_point() or (logits.dim() == 3 and
                                                                        logits.dtype != torch.float32):
        raise ValueError(f"moe route: logits must be a float [T, E] tensor or fp32 [S, T, E] partials, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    S = logits.shape[0] if logits.dim() == 3 else 1
    logits3 = logits if logits.dim() == 3 else logits[None]
    T, E = logits3.shape[1:]
    if E > MAX_EXPERTS:
        raise ValueError(f"moe route: at most {MAX_EXPERTS} experts, got {E}")
    if not 1 <= top_k <= min(MAX_TOP_K, E):
        raise ValueError(f"moe route: top_k must be in [1, {min(MAX_TOP_K, E)}], got {top_k}")
    shared = shared_gate_logit is not None
    if shared:
        gate = shared_gate_logit.reshape(S, T)
        if not gate.is_floating_point():
            raise ValueError(f"moe route: shared_gate_logit must be float [{T}] (or the [S, T] partials beside the "
                             f"logits), got {shared_gate_logit.dtype} {tuple(shared_gate_logit.shape)}")
        check_device(logits, shared_gate_logit)
    else:
        gate = logits3[:, :, 0]
        check_device(logits)
    logits3 = logits3 if logits3.stride(-1) == 1 else logits3.contiguous()
    ids = torch.empty((T, top_k + shared), dtype=torch.int32, device=logits.device)
    weights = torch.empty((T, top_k + shared), dtype=torch.float32, device=logits.device)
    _route_kernel[(T,)](logits3, ids, weights, gate, E, S, logits3.stride(0), logits3.stride(1), gate.stride(0),
                        gate.stride(1), TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                        KP=triton.next_power_of_2(top_k + shared), NORM=norm_topk_prob, SHARED=shared,
                        SPC=min(triton.next_power_of_2(S), max(1, 4096 // triton.next_power_of_2(E))),
                        PDL=launch.pdl(logits.device), launch_pdl=launch.pdl(logits.device), num_warps=num_warps)
    return ids, weights
