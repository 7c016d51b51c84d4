"""The router's top-k as device functions, launched by no kernel of their own: `route_token` is the body of
`moe.triton.route`'s kernel and the epilogue of a router GEMV whose last program routes the token
(`qmatmul.triton._gemv_kernel` with ROUTE_K). Apart from `moe.triton` so that the GEMV can call it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_topk(logit, offs, ok, TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
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
def route_token(logits_ptr, ids_ptr, w_ptr, gate_ptr, t, E, S, stride_ls, stride_lt, stride_gs, stride_g,
                TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                SHARED: tl.constexpr, SPC: tl.constexpr):
    """Token t: softmax over its E logits, then top-k (`softmax_topk`); ids and weights [t, TOP_K (+ 1)] stored.
    The logits (and gate logit) may come as S split-K partials, summed here, SPC at a time by one load (one
    memory round trip, not one per partial), past L1 (other programs of the same launch may have written them).
    SHARED: one more slot, expert id E (the shared expert), weighted sigmoid(gate logit)."""
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    sp = tl.arange(0, SPC)
    row = logits_ptr + t.to(tl.int64) * stride_lt
    logit = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s0 in range(0, S, SPC):  # split-K partials of the router matmul
        s = s0 + sp
        logit += tl.sum(tl.load(row + s[:, None] * stride_ls + offs[None, :], mask=(s < S)[:, None] & ok[None, :],
                                other=0.0, cache_modifier=".cg").to(tl.float32), axis=0)
    logit = tl.where(ok, logit, -float("inf"))
    top_w, top_i = softmax_topk(logit, offs, ok, TOP_K, KP, BLOCK_E, NORM)
    offs_k = tl.arange(0, KP)
    SLOTS: tl.constexpr = TOP_K + SHARED
    if SHARED:
        top_i = tl.where(offs_k == TOP_K, E, top_i)
        gate = 0.0
        for s0 in range(0, S, SPC):
            s = s0 + sp
            gate += tl.sum(tl.load(gate_ptr + s * stride_gs + t * stride_g, mask=s < S, other=0.0,
                                   cache_modifier=".cg").to(tl.float32))
        top_w = tl.where(offs_k == TOP_K, tl.sigmoid(gate), top_w)
    k_ok = offs_k < SLOTS
    tl.store(ids_ptr + t * SLOTS + offs_k, top_i, mask=k_ok)
    tl.store(w_ptr + t * SLOTS + offs_k, top_w, mask=k_ok)
