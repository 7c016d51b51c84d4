"""Triton kernels of the gated delta rule (Gated DeltaNet), checked against `reference.py`.

`fused_recurrent_gated_delta_rule` (decode, and a few tokens): one program per (sequence, value head, block of BV
value columns) holds its [K, BV] slice of the fp32 state in registers and walks the tokens:

    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)     (the gates, from the raw projections)
    q, k = l2norm(q), l2norm(k);  q *= scale
    S *= exp(g);  v' = beta * (v - S^T k);  S += k v'^T;  o = S^T q

The state lives in the cache ([slots, Hv, K, V], fp32) and is updated in place; sequence i uses slot
state_indices[i] (a negative index skips the sequence: a padded batch entry). Value head h reads key head
h // (Hv / Hk) straight from q and k: nothing is repeated in memory. Every program recomputes the l2 norms of its
q and k rows (K elements: cheaper than a launch), so a decode step is one launch whatever the batch.

`chunk_gated_delta_rule` (prefill): the chunk-parallel WY form of `reference.chunk_gated_delta_rule`, chunks of
C = 64 tokens, in four launches:
1. `_chunk_solve_kernel`, program (chunk, value head): the gates, G = the in-chunk cumsum of g, the four 16-row
   blocks of A = beta_i (k_i . k_j) exp(G_i - G_j) (i > j) and (I + A)^-1 [64, 64] (forward substitution on the
   16x16 diagonal blocks, block products below), and the l2-normalised k once per key head;
   `_chunk_wu_kernel`: u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta exp(G) k) (two launches: one holding
   k, v, u and w beside the solve spilled registers);
2. `_chunk_state_kernel`, program (value block, value head, sequence): walks the sequence's chunks with the state
   in registers, v_new = u - w S, S = exp(G_last) S + (k exp(G_last - G))^T v_new, saving S at each chunk start;
3. `_chunk_out_kernel`, program (value block, chunk, value head): o = (q exp(G)) S + tril((q k^T) exp(G_i - G_j))
   v_new, chunks independent.
Exponents are always differences of cumsums that are <= 0 where used; rows past a sequence's end are masked to
zero before any product (so exp of garbage can never make 0 * inf). Several sequences packed in one call
(cu_seqlens) never share a chunk.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the rest of a GDN layer's kernels, so that the layer finds them all here
from sluice.kernels.conv1d.triton import causal_conv1d, causal_conv1d_update  # noqa: F401
from sluice.kernels.norm.triton import gated_rms_norm  # noqa: F401

MAX_HEAD_DIM = 256
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 tl.dot is wrong (Triton 3.9): fp32 operands there


@triton.jit
def _softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, idx_ptr, o_ptr, T, scale,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh, stride_ab, stride_at, stride_bb, stride_bt,
                      stride_ss, stride_sh, stride_ob, stride_ot, stride_oh,
                      RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, HAS_IDX: tl.constexpr):
    """Program (value block, value head, sequence). RAW_GATES: a, b are the raw projections and the gates are
    computed here; otherwise a is g (log decay) and b is beta."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = n
    if HAS_IDX:
        slot = tl.load(idx_ptr + n)
    if slot >= 0:
        offs_k = tl.arange(0, BK)
        offs_v = pid_v * BV + tl.arange(0, BV)
        k_ok, v_ok = offs_k < K, offs_v < V
        kh = h // RATIO
        s_tile = (s_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + offs_k[:, None] * V + offs_v[None, :])
        s_mask = k_ok[:, None] & v_ok[None, :]
        S = tl.load(s_tile, mask=s_mask, other=0.0)
        if RAW_GATES:
            neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
            dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        q_row = q_ptr + n.to(tl.int64) * stride_qb + kh * stride_qh
        k_row = k_ptr + n.to(tl.int64) * stride_kb + kh * stride_kh
        v_row = v_ptr + n.to(tl.int64) * stride_vb + h * stride_vh
        o_row = o_ptr + n.to(tl.int64) * stride_ob + h * stride_oh
        a_row = a_ptr + n.to(tl.int64) * stride_ab + h
        b_row = b_ptr + n.to(tl.int64) * stride_bb + h
        for t in range(T):
            q = tl.load(q_row + t * stride_qt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_row + t * stride_kt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            v = tl.load(v_row + t * stride_vt + offs_v, mask=v_ok, other=0.0).to(tl.float32)
            a = tl.load(a_row + t * stride_at).to(tl.float32)
            b = tl.load(b_row + t * stride_bt).to(tl.float32)
            if RAW_GATES:
                g = neg_a * _softplus(a + dt_bias)
                beta = tl.sigmoid(b)
            else:
                g = a
                beta = b
            if L2NORM:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            q = q * scale
            S = S * tl.exp(g)
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(o_row + t * stride_ot + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        tl.store(s_tile, S, mask=s_mask)


# ---------------------------------------------------------------------------------------------------- prefill

CHUNK = 64  # tokens per chunk; four 16-row blocks in the solve


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows, ok, stride_at, stride_bt, RAW_GATES: tl.constexpr):
    """(g, beta) of `rows` for value head h, zero on rows past the end (they then change nothing)."""
    a = tl.load(a_ptr + rows * stride_at + h, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
    if RAW_GATES:
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * _softplus(a + tl.load(dtb_ptr + h).to(tl.float32))
        beta = tl.sigmoid(b)
    else:
        g = a
        beta = b
    return tl.where(ok, g, 0.0), tl.where(ok, beta, 0.0)


@triton.jit
def _load_qk(ptr, rows, ok, head, stride_t, stride_h, offs_k, k_ok, L2NORM: tl.constexpr):
    """[rows, BK] fp32 rows of q or k of one head, l2-normalised; zero rows past the end. `ptr` already points at
    the chunk's first token and `rows` are int32 offsets from it (64-bit offsets per element cost registers)."""
    x = tl.load(ptr + rows[:, None] * stride_t + head * stride_h + offs_k[None, :],
                mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _a_block(ki, kj, Gi, Gj, beta_i, DIAG: tl.constexpr, PREC: tl.constexpr):
    """A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) on a 16x16 block (strictly lower part on the diagonal)."""
    r = tl.arange(0, 16)
    diff = Gi[:, None] - Gj[None, :]
    if DIAG:
        diff = tl.where(r[:, None] > r[None, :], diff, -float("inf"))  # masked before exp: no overflow above
    return beta_i[:, None] * tl.dot(ki, tl.trans(kj), input_precision=PREC) * tl.exp(diff)


@triton.jit
def _unit_lower_inverse(a_ptr, stride_row, n):
    """(I + A)^-1 for a strictly lower 16x16 A whose rows lie at a_ptr (row stride `stride_row`; rows >= n read
    as zero), by forward substitution: row i = e_i - sum_j A[i, j] row j. Row i is read from memory, where the
    caller wrote A just before behind a barrier: one reduction across threads per step, not two."""
    r = tl.arange(0, 16)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in tl.static_range(1, 16):
        a_i = tl.load(a_ptr + i * stride_row + r, mask=r < tl.where(i < n, i, 0), other=0.0)
        row = (r == i).to(tl.float32) - tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(r[:, None] == i, row[None, :], inv)
    return inv


@triton.jit
def _dot(a, b, PREC: tl.constexpr, BF16: tl.constexpr):
    """a @ b, fp32 accumulation; BF16: bf16 operands (half the shared memory, full tensor-core rate)."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _store_rows(ptr, rows, ok, head, stride_t, stride_h, offs, offs_ok, x):
    tl.store(ptr + rows[:, None] * stride_t + head * stride_h + offs[None, :],
             x.to(ptr.dtype.element_ty), mask=ok[:, None] & offs_ok[None, :])


@triton.jit
def _chunk_solve_kernel(k_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, cstart_ptr, cend_ptr, G_ptr, kn_ptr, ai_ptr,
                        stride_kt, stride_kh, stride_at, stride_bt, stride_Gt, stride_knt, stride_knh, stride_ait,
                        stride_aih, RATIO: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                        RAW_GATES: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    """Program (chunk, value head): G (the in-chunk cumsum of g) and (I + A)^-1 [64, 64] (fp32, zero above the
    diagonal), A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for i > j: the 16x16 diagonal blocks inverted by
    forward substitution, the blocks below from X_ij = -T_ii sum_{j<=m<i} A_im X_mj. The first value head of each
    key head also stores the normalised k (kn) for the later kernels."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // RATIO
    start = tl.load(cstart_ptr + c)
    n = tl.load(cend_ptr + c) - start
    t0 = start.to(tl.int64)
    k_ptr += t0 * stride_kt
    kn_ptr += t0 * stride_knt
    a_ptr += t0 * stride_at
    b_ptr += t0 * stride_bt
    G_ptr += t0 * stride_Gt
    ai_ptr += t0 * stride_ait
    r = tl.arange(0, 16)
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < K
    rows0, rows1, rows2, rows3 = r, 16 + r, 32 + r, 48 + r
    ok0, ok1, ok2, ok3 = rows0 < n, rows1 < n, rows2 < n, rows3 < n
    k0 = _load_qk(k_ptr, rows0, ok0, kh, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
    k1 = _load_qk(k_ptr, rows1, ok1, kh, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
    k2 = _load_qk(k_ptr, rows2, ok2, kh, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
    k3 = _load_qk(k_ptr, rows3, ok3, kh, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
    if h % RATIO == 0:
        _store_rows(kn_ptr, rows0, ok0, kh, stride_knt, stride_knh, offs_k, k_ok, k0)
        _store_rows(kn_ptr, rows1, ok1, kh, stride_knt, stride_knh, offs_k, k_ok, k1)
        _store_rows(kn_ptr, rows2, ok2, kh, stride_knt, stride_knh, offs_k, k_ok, k2)
        _store_rows(kn_ptr, rows3, ok3, kh, stride_knt, stride_knh, offs_k, k_ok, k3)
    g0, beta0 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows0, ok0, stride_at, stride_bt, RAW_GATES)
    g1, beta1 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows1, ok1, stride_at, stride_bt, RAW_GATES)
    g2, beta2 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows2, ok2, stride_at, stride_bt, RAW_GATES)
    g3, beta3 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, rows3, ok3, stride_at, stride_bt, RAW_GATES)
    G0 = tl.cumsum(g0, axis=0)
    G1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    G2 = tl.cumsum(g2, axis=0) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0))
    G3 = tl.cumsum(g3, axis=0) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0))
    tl.store(G_ptr + rows0 * stride_Gt + h, G0, mask=ok0)
    tl.store(G_ptr + rows1 * stride_Gt + h, G1, mask=ok1)
    tl.store(G_ptr + rows2 * stride_Gt + h, G2, mask=ok2)
    tl.store(G_ptr + rows3 * stride_Gt + h, G3, mask=ok3)
    # the diagonal blocks of A go through memory (this chunk's rows of the output, overwritten below), so that
    # the substitutions read their rows with plain loads
    ai_h = ai_ptr + h * stride_aih
    r2 = tl.arange(0, 16)[None, :]
    tl.store(ai_h + rows0[:, None] * stride_ait + r2, _a_block(k0, k0, G0, G0, beta0, True, PREC), mask=ok0[:, None])
    tl.store(ai_h + rows1[:, None] * stride_ait + 16 + r2, _a_block(k1, k1, G1, G1, beta1, True, PREC),
             mask=ok1[:, None])
    tl.store(ai_h + rows2[:, None] * stride_ait + 32 + r2, _a_block(k2, k2, G2, G2, beta2, True, PREC),
             mask=ok2[:, None])
    tl.store(ai_h + rows3[:, None] * stride_ait + 48 + r2, _a_block(k3, k3, G3, G3, beta3, True, PREC),
             mask=ok3[:, None])
    tl.debug_barrier()
    X00 = _unit_lower_inverse(ai_h, stride_ait, n)
    X11 = _unit_lower_inverse(ai_h + 16 * stride_ait + 16, stride_ait, n - 16)
    X22 = _unit_lower_inverse(ai_h + 32 * stride_ait + 32, stride_ait, n - 32)
    X33 = _unit_lower_inverse(ai_h + 48 * stride_ait + 48, stride_ait, n - 48)
    tl.debug_barrier()  # every thread has read A before the inverse overwrites it
    A10 = _a_block(k1, k0, G1, G0, beta1, False, PREC)
    A20 = _a_block(k2, k0, G2, G0, beta2, False, PREC)
    A21 = _a_block(k2, k1, G2, G1, beta2, False, PREC)
    A30 = _a_block(k3, k0, G3, G0, beta3, False, PREC)
    A31 = _a_block(k3, k1, G3, G1, beta3, False, PREC)
    A32 = _a_block(k3, k2, G3, G2, beta3, False, PREC)
    X10 = -_dot(X11, _dot(A10, X00, PREC, False), PREC, False)
    X21 = -_dot(X22, _dot(A21, X11, PREC, False), PREC, False)
    X20 = -_dot(X22, _dot(A20, X00, PREC, False) + _dot(A21, X10, PREC, False), PREC, False)
    X32 = -_dot(X33, _dot(A32, X22, PREC, False), PREC, False)
    X31 = -_dot(X33, _dot(A31, X11, PREC, False) + _dot(A32, X21, PREC, False), PREC, False)
    X30 = -_dot(X33, _dot(A30, X00, PREC, False) + _dot(A31, X10, PREC, False) + _dot(A32, X20, PREC, False),
                PREC, False)
    zero = tl.zeros((16, 16), dtype=tl.float32)
    _store_ai_row(ai_ptr, rows0, ok0, h, stride_ait, stride_aih, X00, zero, zero, zero)
    _store_ai_row(ai_ptr, rows1, ok1, h, stride_ait, stride_aih, X10, X11, zero, zero)
    _store_ai_row(ai_ptr, rows2, ok2, h, stride_ait, stride_aih, X20, X21, X22, zero)
    _store_ai_row(ai_ptr, rows3, ok3, h, stride_ait, stride_aih, X30, X31, X32, X33)


@triton.jit
def _store_ai_row(ai_ptr, rows, ok, h, stride_ait, stride_aih, B0, B1, B2, B3):
    """16 rows of (I + A)^-1: the four 16-column blocks side by side."""
    r = tl.arange(0, 16)
    base = ai_ptr + rows[:, None] * stride_ait + h * stride_aih + r[None, :]
    tl.store(base, B0, mask=ok[:, None])
    tl.store(base + 16, B1, mask=ok[:, None])
    tl.store(base + 32, B2, mask=ok[:, None])
    tl.store(base + 48, B3, mask=ok[:, None])


@triton.jit
def _chunk_wu_kernel(kn_ptr, v_ptr, b_ptr, G_ptr, ai_ptr, cstart_ptr, cend_ptr, w_ptr, u_ptr,
                     stride_knt, stride_knh, stride_vt, stride_vh, stride_bt, stride_Gt, stride_ait, stride_aih,
                     stride_wt, stride_wh, stride_ut, stride_uh,
                     RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     C: tl.constexpr, RAW_GATES: tl.constexpr, PREC: tl.constexpr):
    """Program (chunk, value head): u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta exp(G) kn)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // RATIO
    start = tl.load(cstart_ptr + c)
    t0 = start.to(tl.int64)
    kn_ptr += t0 * stride_knt
    v_ptr += t0 * stride_vt
    b_ptr += t0 * stride_bt
    G_ptr += t0 * stride_Gt
    ai_ptr += t0 * stride_ait
    w_ptr += t0 * stride_wt
    u_ptr += t0 * stride_ut
    rows = tl.arange(0, C)
    ok = rows < tl.load(cend_ptr + c) - start
    b = tl.load(b_ptr + rows * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.where(ok, tl.sigmoid(b) if RAW_GATES else b, 0.0)
    G = tl.load(G_ptr + rows * stride_Gt + h, mask=ok, other=0.0)
    ai = tl.load(ai_ptr + rows[:, None] * stride_ait + h * stride_aih + rows[None, :], mask=ok[:, None], other=0.0)
    offs_v = tl.arange(0, BV)
    v_ok = offs_v < V
    v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    _store_rows(u_ptr, rows, ok, h, stride_ut, stride_uh, offs_v, v_ok, _dot(ai, beta[:, None] * v, PREC, False))
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < K
    kn = _load_qk(kn_ptr, rows, ok, kh, stride_knt, stride_knh, offs_k, k_ok, False)
    _store_rows(w_ptr, rows, ok, h, stride_wt, stride_wh, offs_k, k_ok,
                _dot(ai, (beta * tl.exp(G))[:, None] * kn, PREC, False))


@triton.jit
def _chunk_state_kernel(k_ptr, w_ptr, u_ptr, G_ptr, s_ptr, idx_ptr, cu_ptr, first_ptr, hs_ptr, vn_ptr,
                        stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_Gt,
                        stride_ss, stride_sh, stride_hc, stride_hh, stride_vnt, stride_vnh,
                        RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, C: tl.constexpr, HAS_IDX: tl.constexpr,
                        PREC: tl.constexpr, BF16: tl.constexpr):
    """Program (value block, value head, sequence): the state through the sequence's chunks, saved (in the
    intermediates' dtype) at each chunk's start; v_new = u - w S of every chunk; the final state in place."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = n
    if HAS_IDX:
        slot = tl.load(idx_ptr + n)
    if slot >= 0:
        kh = h // RATIO
        bos = tl.load(cu_ptr + n)
        eos = tl.load(cu_ptr + n + 1)
        first = tl.load(first_ptr + n)
        offs_k = tl.arange(0, BK)
        offs_v = pid_v * BV + tl.arange(0, BV)
        k_ok, v_ok = offs_k < K, offs_v < V
        s_tile = s_ptr + slot.to(tl.int64) * stride_ss + h * stride_sh + offs_k[:, None] * V + offs_v[None, :]
        s_mask = k_ok[:, None] & v_ok[None, :]
        S = tl.load(s_tile, mask=s_mask, other=0.0)
        offs_c = tl.arange(0, C)
        for j in range(tl.cdiv(eos - bos, C)):
            hs = hs_ptr + (first + j).to(tl.int64) * stride_hc + h * stride_hh
            tl.store(hs + offs_k[:, None] * V + offs_v[None, :], S.to(hs_ptr.dtype.element_ty), mask=s_mask)
            t0 = (bos + j * C).to(tl.int64)
            n_rows = tl.minimum(eos - bos - j * C, C)
            ok = offs_c < n_rows
            w = tl.load(w_ptr + t0 * stride_wt + offs_c[:, None] * stride_wt + h * stride_wh + offs_k[None, :],
                        mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            u = tl.load(u_ptr + t0 * stride_ut + offs_c[:, None] * stride_ut + h * stride_uh + offs_v[None, :],
                        mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            v_new = u - tl.dot(w, S, input_precision=PREC)
            _store_rows(vn_ptr + t0 * stride_vnt, offs_c, ok, h, stride_vnt, stride_vnh, offs_v, v_ok, v_new)
            G_last = tl.load(G_ptr + (t0 + n_rows - 1) * stride_Gt + h)
            G = tl.load(G_ptr + t0 * stride_Gt + offs_c * stride_Gt + h, mask=ok, other=0.0)
            k = _load_qk(k_ptr + t0 * stride_kt, offs_c, ok, kh, stride_kt, stride_kh, offs_k, k_ok, False)  # kn
            k = k * tl.where(ok, tl.exp(G_last - G), 0.0)[:, None]
            # BF16: v_new is stored in bf16 anyway; only k exp(G_last - G) is rounded beyond what is kept
            S = S * tl.exp(G_last) + _dot(tl.trans(k), v_new, PREC, BF16)
        tl.store(s_tile, S, mask=s_mask)


@triton.jit
def _chunk_out_kernel(q_ptr, k_ptr, G_ptr, hs_ptr, vn_ptr, o_ptr, cstart_ptr, cend_ptr, scale,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_Gt, stride_hc, stride_hh,
                      stride_vnt, stride_vnh, stride_ot, stride_oh,
                      RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr,
                      BV: tl.constexpr, C: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                      BF16: tl.constexpr):
    """Program (value block, chunk, value head): o = (q exp(G)) S + tril_incl((q k^T) exp(G_i - G_j)) v_new.
    K is walked in NKB blocks of BK (two [64, 256] fp32 dot operands would not fit in shared memory); k is the
    normalised kn. BF16 (bf16 inputs): bf16 dot operands, as kn, S and v_new already are."""
    pid_v = tl.program_id(0)
    c = tl.program_id(1)
    h = tl.program_id(2)
    kh = h // RATIO
    start = tl.load(cstart_ptr + c)
    t0 = start.to(tl.int64)
    q_ptr += t0 * stride_qt
    k_ptr += t0 * stride_kt
    G_ptr += t0 * stride_Gt
    vn_ptr += t0 * stride_vnt
    o_ptr += t0 * stride_ot
    offs_c = tl.arange(0, C)
    rows = offs_c
    ok = rows < tl.load(cend_ptr + c) - start
    offs_v = pid_v * BV + tl.arange(0, BV)
    v_ok = offs_v < V
    q_scale = tl.full((C,), scale, dtype=tl.float32)
    if L2NORM:
        sumsq = tl.zeros((C,), dtype=tl.float32)
        for kb in tl.static_range(NKB):
            offs_k = kb * BK + tl.arange(0, BK)
            qb = _load_qk(q_ptr, rows, ok, kh, stride_qt, stride_qh, offs_k, offs_k < K, False)
            sumsq += tl.sum(qb * qb, axis=1)
        q_scale = q_scale * tl.rsqrt(sumsq + 1e-6)
    G = tl.load(G_ptr + rows * stride_Gt + h, mask=ok, other=0.0)
    o = tl.zeros((C, BV), dtype=tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    for kb in tl.static_range(NKB):
        offs_k = kb * BK + tl.arange(0, BK)
        k_ok = offs_k < K
        qb = _load_qk(q_ptr, rows, ok, kh, stride_qt, stride_qh, offs_k, k_ok, False) * q_scale[:, None]
        kb_n = _load_qk(k_ptr, rows, ok, kh, stride_kt, stride_kh, offs_k, k_ok, False)
        S = tl.load(hs_ptr + c.to(tl.int64) * stride_hc + h * stride_hh + offs_k[:, None] * V + offs_v[None, :],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        o += _dot(qb * tl.exp(G)[:, None], S, PREC, BF16)
        qk += _dot(qb, tl.trans(kb_n), PREC, BF16)
    v_new = tl.load(vn_ptr + rows[:, None] * stride_vnt + h * stride_vnh + offs_v[None, :],
                    mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    causal = (offs_c[:, None] >= offs_c[None, :]) & ok[:, None] & ok[None, :]
    qk = qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], -float("inf")))
    o += _dot(qk, v_new, PREC, BF16)
    _store_rows(o_ptr, rows, ok, h, stride_ot, stride_oh, offs_v, v_ok, o)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B*T, ...] (a view when the batch is laid out like time, as in a projection's output)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           state: torch.Tensor, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                           cu_seqlens=None, scale: float | None = None, use_qk_l2norm: bool = True,
                           block_v: int | None = None, num_warps: tuple[int, int, int, int] | None = None
                           ) -> torch.Tensor:
    """Prefill: the chunk-parallel form, same arguments and result as `fused_recurrent_gated_delta_rule` (the
    state updated in place), plus `cu_seqlens` ([N + 1] offsets, host list or tensor; then B must be 1 and the
    T tokens hold N sequences back to back, sequence i using state slot state_indices[i] or i)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    raw = A_log is not None
    if cu_seqlens is not None:
        cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(x > y for x, y in zip(cu, cu[1:])):
            raise ValueError(f"gated delta rule: cu_seqlens must rise from 0 to T = {T} with B = 1, got B = {B}, "
                             f"{cu[:4]}...{cu[-2:]}")
    else:
        cu = [i * T for i in range(B + 1)]
    N = len(cu) - 1
    _check(q, k, v, a, b, state, A_log, dt_bias, state_indices, sequences=N)
    o = torch.empty((B, T, Hv, V), dtype=v.dtype, device=v.device)
    if B * T == 0:
        return o
    C = CHUNK
    starts = [s for i in range(N) for s in range(cu[i], cu[i + 1], C)]
    ends = [min(s + C, cu[i + 1]) for i in range(N) for s in range(cu[i], cu[i + 1], C)]
    first = [0]
    for i in range(N):
        first.append(first[-1] + -(-(cu[i + 1] - cu[i]) // C))
    dev = v.device
    table = torch.tensor([starts, ends], dtype=torch.int32).to(dev, non_blocking=True)
    cu_t = torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True)
    first_t = torch.tensor(first, dtype=torch.int32).to(dev, non_blocking=True)
    n_chunks = len(starts)
    q2, k2, v2, a2, b2, o2 = (_tokens(x) for x in (q, k, v, a, b, o))
    inter = torch.float32 if v.dtype == torch.float32 else v.dtype  # w, u, v_new and the chunk states, as FLA
    w = torch.empty((B * T, Hv, K), dtype=inter, device=dev)
    u = torch.empty((B * T, Hv, V), dtype=inter, device=dev)
    v_new = torch.empty((B * T, Hv, V), dtype=inter, device=dev)
    G = torch.empty((B * T, Hv), dtype=torch.float32, device=dev)
    kn = torch.empty((B * T, Hk, K), dtype=inter, device=dev)
    states = torch.empty((n_chunks, Hv, K, V), dtype=inter, device=dev)
    BK, BVall = triton.next_power_of_2(K), triton.next_power_of_2(V)
    prec = "ieee" if v.dtype == torch.float32 else "tf32"
    warps = 8 if max(BK, BVall) > 128 else 4
    # measured on the H200 at T = 16384: the solve's 16-step substitutions are reductions across threads,
    # cheapest with 2 warps (0.75 ms; 1.1 ms with 4, 2.4 ms with 8); the others best with 4
    w_solve, w_wu, w_state, w_out = num_warps or (warps // 2, warps, warps, warps)
    ainv = torch.empty((B * T, Hv, C), dtype=torch.float32, device=dev)  # fp32: it multiplies twice
    _chunk_solve_kernel[(n_chunks, Hv)](
        k2, a2, b2, A_log if raw else a2, dt_bias if raw else a2, table[0], table[1], G, kn, ainv,
        k2.stride(0), k2.stride(1), a2.stride(0), b2.stride(0), G.stride(0), kn.stride(0), kn.stride(1),
        ainv.stride(0), ainv.stride(1),
        RATIO=Hv // Hk, K=K, BK=BK, RAW_GATES=raw, L2NORM=use_qk_l2norm, PREC=prec, num_warps=w_solve)
    _chunk_wu_kernel[(n_chunks, Hv)](
        kn, v2, b2, G, ainv, table[0], table[1], w, u,
        kn.stride(0), kn.stride(1), v2.stride(0), v2.stride(1), b2.stride(0), G.stride(0), ainv.stride(0),
        ainv.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        RATIO=Hv // Hk, K=K, V=V, BK=BK, BV=BVall, C=C, RAW_GATES=raw, PREC=prec, num_warps=w_wu)
    bv = block_v or min(32, BVall)  # measured best on the H200 (16: more programs, but each chunk step costs more)
    idx = state_indices if state_indices is not None else cu_t
    _chunk_state_kernel[(triton.cdiv(V, bv), Hv, N)](
        kn, w, u, G, state, idx, cu_t, first_t, states, v_new,
        kn.stride(0), kn.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), G.stride(0),
        state.stride(0), state.stride(1), states.stride(0), states.stride(1), v_new.stride(0), v_new.stride(1),
        RATIO=Hv // Hk, K=K, V=V, BK=BK, BV=bv, C=C, HAS_IDX=state_indices is not None,
        PREC=prec, BF16=inter == torch.bfloat16 and not INTERPRET, num_warps=w_state, num_stages=1 if inter == torch.float32 and BK > 128 else 3)  # shared memory
    bvo = min(64, BVall)
    _chunk_out_kernel[(triton.cdiv(V, bvo), n_chunks, Hv)](
        q2, kn, G, states, v_new, o2, table[0], table[1], K ** -0.5 if scale is None else scale,
        q2.stride(0), q2.stride(1), kn.stride(0), kn.stride(1), G.stride(0), states.stride(0), states.stride(1),
        v_new.stride(0), v_new.stride(1), o2.stride(0), o2.stride(1),
        RATIO=Hv // Hk, K=K, V=V, BK=min(BK, 128), NKB=triton.cdiv(BK, 128), BV=bvo, C=C, L2NORM=use_qk_l2norm,
        PREC=prec, BF16=inter == torch.bfloat16 and not INTERPRET, num_warps=w_out)
    return o


def _value_block(V: int, programs_per_block: int, device) -> int:
    """Value columns per decode program: 64, halved (down to 16) while that leaves most multiprocessors idle
    (measured on the H200: 64 is best at batch 32, 16 at batch 1)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    bv = min(64, triton.next_power_of_2(V))
    while bv > 16 and programs_per_block * triton.cdiv(V, bv) < 2 * sms:
        bv //= 2
    return bv


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                     b: torch.Tensor, state: torch.Tensor, A_log: torch.Tensor | None = None,
                                     dt_bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                                     scale: float | None = None, use_qk_l2norm: bool = True,
                                     block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Run T tokens of B sequences through the recurrence, the state updated in place; returns o [B, T, Hv, V]
    in v's dtype.

    q, k [B, T, Hk, K]; v [B, T, Hv, V] (any strides with a unit last one: views into the projection output);
    with A_log and dt_bias [Hv]: a, b [B, T, Hv] are the raw gate projections (g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b)); without them a is g (log decay, <= 0) and b is beta. state: fp32 [slots, Hv, K,
    V], sequence i using slot state_indices[i] (default i; negative: skipped, its output left unwritten)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    raw = A_log is not None
    _check(q, k, v, a, b, state, A_log, dt_bias, state_indices)
    o = torch.empty((B, T, Hv, V), dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return o
    bv = block_v or _value_block(V, B * Hv, v.device)
    idx = state_indices if state_indices is not None else q  # a placeholder pointer when unused
    _recurrent_kernel[(triton.cdiv(V, bv), Hv, B)](
        q, k, v, a, b, A_log if raw else a, dt_bias if raw else a, state, idx, o, T,
        K ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        state.stride(0), state.stride(1), o.stride(0), o.stride(1), o.stride(2),
        RATIO=Hv // Hk, K=K, V=V, BK=triton.next_power_of_2(K), BV=bv, RAW_GATES=raw, L2NORM=use_qk_l2norm,
        HAS_IDX=state_indices is not None, num_warps=num_warps or (4 if bv * triton.next_power_of_2(K) >= 4096 else 2))
    return o


def _check(q, k, v, a, b, state, A_log, dt_bias, state_indices, sequences=None) -> None:
    """Clear errors before any launch: a wrong state would be silently misread otherwise."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"gated delta rule: q, k must be [B, T, Hk, K] and v [B, T, Hv, V], got q{tuple(q.shape)} "
                         f"k{tuple(k.shape)} v{tuple(v.shape)}")
    B, T, Hk, K = q.shape
    Hv, V = v.shape[-2:]
    N = B if sequences is None else sequences
    if Hv % Hk:
        raise ValueError(f"gated delta rule: {Hv} value heads is not a multiple of {Hk} key heads")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"gated delta rule: head dims up to {MAX_HEAD_DIM} are supported, got K={K}, V={V}")
    for name, x in (("a", a), ("b", b)):
        if x.shape != (B, T, Hv) or x.stride(2) != 1:
            raise ValueError(f"gated delta rule: {name} must be [B, T, Hv] = {(B, T, Hv)} with a unit last stride, "
                             f"got {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(3) != 1 or not x.is_floating_point():
            raise ValueError(f"gated delta rule: {name} must be a float tensor with a unit last stride")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("gated delta rule: pass A_log and dt_bias together (raw gates) or neither (g and beta)")
    if A_log is not None and (A_log.shape != (Hv,) or dt_bias.shape != (Hv,)):
        raise ValueError(f"gated delta rule: A_log and dt_bias must be [{Hv}], got {tuple(A_log.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    if (state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (Hv, K, V)
            or state.stride(3) != 1 or state.stride(2) != V):
        raise ValueError(f"gated delta rule: the state must be a contiguous fp32 [slots, {Hv}, {K}, {V}] tensor, got "
                         f"{state.dtype} {tuple(state.shape)}")
    if state_indices is None:
        if state.shape[0] < N:
            raise ValueError(f"gated delta rule: {N} sequences but the state has {state.shape[0]} slots")
    elif state_indices.shape != (N,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gated delta rule: state_indices must be int32/int64 [{N}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    tensors = [q, k, v, a, b, state] + [x for x in (A_log, dt_bias, state_indices) if x is not None]
    if any(x.device != v.device for x in tensors):
        raise ValueError("gated delta rule: all tensors must be on the same device")
