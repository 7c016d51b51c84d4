"""The DeepSeek (MLA) decode chain's glue in few Triton launches, each with its torch oracle in the layers' own code
(`layers/mla.py`, `layers/deepseek_moe.py`, `models/deepseek_v3.py`), every rounding where those round:

* `add_rms_norm`: a block's residual add and the next Llama-style RMSNorm (`norm.reference.rms_norm`: normalised in
  fp32, rounded to x's dtype, then times the weight, rounded again) in one launch. The delta added may be a
  tensor, the split-K partials of a GEMV (`Partials`: summed in fp32, rounded to h's dtype, as `qgemv` sums them)
  or an MoE block's unsummed `ExpertOutputs` (summed as `combine` sums them); optionally the normed rows in fp32
  too (the router's input: one cast fewer).
* `mla_prep`: a decode step's attention input from the q and [latent | k_pe] projections (tensors or their split-K
  partials): the latent RMS-normalised (kv_a_layernorm) and k_pe roped, both stored into the latent cache at each
  sequence's row and position (paged too); q_pe roped; q_nope folded through W_UK per head (q_lat = W_UK^T q_nope,
  the products in the cache's dtype with fp32 sums, as the bf16 einsum). One launch for what was ~25.
* `uv_out`: the attention's latent output through W_UV per head, written as o_proj's input [B, H * v] (the einsum
  and the reshape's copy).

`kernels/mla/chain.py` chooses between these and the torch paths (and imports no Triton).
"""

from __future__ import annotations

import os
import torch
import triton
import triton.language as tl

from sluice.kernels.launch import num_sms, pdl, pdl_start, round_to
from sluice.kernels.mla.chain import Partials
from sluice.kernels.moe import ExpertOutputs
from sluice.kernels.moe.triton import expert_sum

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK_B = 16  # sequences a program of `mla_prep` / `uv_out` takes (the M of their dots: >= 16)


# ------------------------------------------------------------------------------------------ residual add + norm


@triton.jit
def _add_norm_kernel(h_ptr, d_ptr, w_ptr, s_ptr, y_ptr, y32_ptr, R, D, stride_h, stride_ds, stride_d, S, eps,
                     ey_ptr, ew_ptr, es_ptr, eg_ptr, ES, stride_eys, stride_eym, stride_esh, stride_eg,
                     DELTA: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, Y_DTYPE: tl.constexpr,
                     OUT32: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    """s = h + delta (DELTA 0: none; 1: a tensor; 2: S split-K partials, summed in fp32 and rounded to h's dtype;
    3: an MoE block's unsummed outputs, `expert_sum` rounded to h's dtype), rounded to h's dtype;
    y = w * round(s * rsqrt(mean(s^2) + eps)) rounded to Y_DTYPE (`reference.rms_norm`); OUT32: y in fp32 too."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK_D)
    r_ok = rows < R
    d_ok = offs < D
    mask = r_ok[:, None] & d_ok[None, :]
    hdt = h_ptr.dtype.element_ty
    x = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    out = rows.to(tl.int64)[:, None] * D + offs[None, :]
    if DELTA == 1:
        x += tl.load(d_ptr + rows.to(tl.int64)[:, None] * stride_d + offs[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    if DELTA == 2:
        ptrs = d_ptr + rows.to(tl.int64)[:, None] * stride_d + offs[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, S):
            acc += tl.load(ptrs + s * stride_ds, mask=mask, other=0.0).to(tl.float32)
        x += round_to(acc, hdt, RNE_BF16)
    if DELTA == 3:
        x += round_to(expert_sum(ey_ptr, ew_ptr, es_ptr, eg_ptr, rows, r_ok, offs, d_ok, ES, stride_eys, stride_eym,
                                 stride_esh, stride_eg, TOP_K, HAS_SHARED), hdt, RNE_BF16)
    if DELTA != 0:
        x = round_to(x, hdt, RNE_BF16)
        tl.store(s_ptr + out, x.to(hdt), mask=mask)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    n = round_to(x * inv[:, None], hdt, RNE_BF16)
    w = tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)
    y = round_to(w[None, :] * n, Y_DTYPE, RNE_BF16)
    tl.store(y_ptr + out, y.to(Y_DTYPE), mask=mask)
    if OUT32:
        tl.store(y32_ptr + out, y, mask=mask)


def add_rms_norm(h: torch.Tensor, delta, weight: torch.Tensor, eps: float, out32: bool = False,
                 block_elems: int = 2048, num_warps: int | None = None):
    """(s, y, y32): s = h + delta in h's dtype (h itself when delta is None), y = `norm.reference.rms_norm(s, weight,
    eps)` (its dtype: weight's and h's promoted), y32 = y in fp32 (None unless out32), in one launch. h [..., D]
    with a unit last stride and rows a fixed stride apart; delta: None, a tensor of h's shape and dtype,
    `Partials` of [.., rows, D], or `ExpertOutputs` (the rows of h its tokens)."""
    what = "deepseek add_rms_norm"
    D = h.shape[-1]
    if h.dtype not in FLOAT_DTYPES or weight.shape != (D,) or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: h float [..., D] and weight [D], got {h.dtype} {tuple(h.shape)} and "
                         f"{weight.dtype} {tuple(weight.shape)}")
    R = h.numel() // max(D, 1)
    h2 = _rows(h, R, D)
    y_dtype = torch.promote_types(weight.dtype, h.dtype)
    y = torch.empty(h.shape, dtype=y_dtype, device=h.device)
    y32 = torch.empty(h.shape, dtype=torch.float32, device=h.device) if out32 else None
    experts = delta if isinstance(delta, ExpertOutputs) else None
    kind, d2, stride_ds, S = 0, h2, 0, 1
    if experts is not None:
        if experts.dtype != h.dtype or experts.y.shape[2] != D or experts.weights.shape[0] != R:
            raise ValueError(f"{what}: expert outputs of {experts.weights.shape[0]} tokens x {experts.y.shape[2]} "
                             f"({experts.dtype}) for h {h.dtype} {tuple(h.shape)}")
        kind = 3
    elif isinstance(delta, Partials):
        p = delta.y
        if p.dim() != 3 or p.shape[1:] != (R, D) or p.stride(2) != 1 or delta.dtype != h.dtype:
            raise ValueError(f"{what}: partials [S, {R}, {D}] with unit last stride in h's dtype, got "
                             f"{tuple(p.shape)} ({delta.dtype})")
        kind, d2, stride_ds, S = 2, p[0], p.stride(0), p.shape[0]
    elif delta is not None:
        if delta.shape != h.shape or delta.dtype != h.dtype:
            raise ValueError(f"{what}: delta {delta.dtype} {tuple(delta.shape)} for h {h.dtype} {tuple(h.shape)}")
        kind, d2 = 1, _rows(delta, R, D)
    s = h if kind == 0 else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if R == 0:
        return s, y, y32
    block_d = triton.next_power_of_2(D)
    block_r = max(1, block_elems // block_d)
    ey, ew, es, eg, ES, *e_strides, top_k, has_shared = (experts.args() if experts is not None else
                                                         (h2, weight, h2, weight, 1, 0, 0, 0, 0, 1, False))
    if num_warps is None:
        num_warps = 16 if experts is not None else 4
    use_pdl = pdl(h.device)
    _add_norm_kernel[(triton.cdiv(R, block_r),)](
        h2, d2, weight, s, y, y32 if out32 else y, R, D, h2.stride(0), stride_ds, d2.stride(0), S, eps,
        ey, ew, es, eg, ES, *e_strides, DELTA=kind, TOP_K=top_k, HAS_SHARED=has_shared, Y_DTYPE=_TL[y_dtype],
        OUT32=out32, RNE_BF16=INTERPRET, BLOCK_R=block_r, BLOCK_D=block_d, PDL=use_pdl, launch_pdl=use_pdl,
        num_warps=num_warps)
    return s, y, y32


def _rows(t: torch.Tensor, R: int, D: int) -> torch.Tensor:
    """t [..., D] as [R, D] rows a fixed stride apart with a unit last stride (a copy only where no view is)."""
    if t.stride(-1) == 1:
        try:
            return t.view(R, D)
        except RuntimeError:
            pass
        if t.dim() >= 2 and all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2)):
            return t.as_strided((R, D), (t.stride(-2) if t.dim() >= 2 else D, 1))
    return t.contiguous().view(R, D)


# ----------------------------------------------------------------------------- MLA: the attention's input


@triton.jit
def _load_sum(ptr, offs, mask, S, stride_s, X_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """sum over s < S of ptr[s * stride_s + offs] in fp32, rounded to X_DTYPE (a GEMV's output from its partials)."""
    acc = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in range(1, S):
        acc += tl.load(ptr + s * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(acc, X_DTYPE, RNE_BF16)


@triton.jit
def _rope(x, xq, c, s, half, offs, X_DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """`reference.apply_rope` of a row tile x (its partner tile xq, x's element i +- half), every product and the
    sum rounded to X_DTYPE as torch's elementwise ops round."""
    sign = tl.where(offs < half, -1.0, 1.0)[None, :]
    return round_to(round_to(x * c, X_DTYPE, RNE_BF16) + sign * round_to(xq * s, X_DTYPE, RNE_BF16), X_DTYPE,
                    RNE_BF16)


@triton.jit
def _dot(a, b, dt: tl.constexpr, TC: tl.constexpr):
    """a @ b, both taken in dtype dt, fp32 sums: on a GPU (TC) bf16/fp16 tensor cores (an fp32 dt in full fp32);
    under the interpreter in fp32, whose bf16 dot is wrong (the values are dt's either way)."""
    if TC:
        if dt == tl.float32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a.to(dt), b.to(dt))
    return tl.dot(a.to(tl.float32), b.to(dt).to(tl.float32), input_precision="ieee")


@triton.jit
def _mla_prep_kernel(q_ptr, kv_ptr, cos_ptr, sin_ptr, nw_ptr, wuk_ptr, ql_ptr, qp_ptr, cache_ptr, pos_ptr, rows_ptr,
                     tab_ptr, B, H, Sq, Skv, stride_qs, stride_qb, stride_kvs, stride_kvb, stride_cb, stride_wh,
                     stride_wn, stride_lb, stride_lh, stride_pb, stride_ph, stride_cr, stride_ct, cap, page,
                     stride_tab, eps,
                     NOPE: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BNOPE: tl.constexpr, BP: tl.constexpr,
                     BR: tl.constexpr, BRB: tl.constexpr, NRB: tl.constexpr, BB: tl.constexpr,
                     X_DTYPE: tl.constexpr, N_DTYPE: tl.constexpr, PAGED: tl.constexpr, TC: tl.constexpr,
                     RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BB sequences, j): j < H * NRB: head j // NRB, latent columns (j % NRB) * BRB.. of q_lat
    (and, for the first column block, the head's roped q_pe); j = H * NRB: the sequences' latents normed and keys
    roped, stored into the cache."""
    pdl_start(PDL)
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    b_ok = b < B
    j = tl.program_id(1)
    cdt = cache_ptr.dtype.element_ty
    e = tl.arange(0, BP)
    e_ok = e < P
    half = P // 2
    partner = tl.where(e < half, e + half, e - half)
    pe_mask = b_ok[:, None] & e_ok[None, :]
    c_off = b.to(tl.int64)[:, None] * stride_cb + e[None, :]
    cs = tl.load(cos_ptr + c_off, mask=pe_mask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + c_off, mask=pe_mask, other=0.0).to(tl.float32)
    if j < H * NRB:
        h = j // NRB
        rb = j % NRB
        q_row = q_ptr + b.to(tl.int64)[:, None] * stride_qb + h * (NOPE + P)
        n = tl.arange(0, BNOPE)
        qn = _load_sum(q_row, n[None, :], b_ok[:, None] & (n < NOPE)[None, :], Sq, stride_qs, X_DTYPE, RNE_BF16)
        r = rb * BRB + tl.arange(0, BRB)
        w = tl.load(wuk_ptr + h * stride_wh + n[:, None] * stride_wn + r[None, :],
                    mask=(n < NOPE)[:, None] & (r < R)[None, :], other=0.0)  # [BNOPE, BRB] in the cache's dtype
        qn = round_to(qn, cdt, RNE_BF16)
        ql = _dot(qn, w, cdt, TC)
        tl.store(ql_ptr + b.to(tl.int64)[:, None] * stride_lb + h * stride_lh + r[None, :],
                 round_to(ql, cdt, RNE_BF16).to(cdt), mask=b_ok[:, None] & (r < R)[None, :])
        if rb == 0:
            x = _load_sum(q_row + NOPE, e[None, :], pe_mask, Sq, stride_qs, X_DTYPE, RNE_BF16)
            xq = _load_sum(q_row + NOPE, partner[None, :], pe_mask, Sq, stride_qs, X_DTYPE, RNE_BF16)
            y = round_to(_rope(x, xq, cs, sn, half, e, X_DTYPE, RNE_BF16), cdt, RNE_BF16)
            tl.store(qp_ptr + b.to(tl.int64)[:, None] * stride_pb + h * stride_ph + e[None, :], y.to(cdt),
                     mask=pe_mask)
    else:
        kv_row = kv_ptr + b.to(tl.int64)[:, None] * stride_kvb
        lat = tl.arange(0, BR)  # not `r`: a name both branches bind must have one type, [BRB] there, [BR] here
        lat_ok = lat < R
        c = _load_sum(kv_row, lat[None, :], b_ok[:, None] & lat_ok[None, :], Skv, stride_kvs, X_DTYPE, RNE_BF16)
        inv = tl.math.rsqrt(tl.sum(c * c, axis=1) / R + eps)
        nw = tl.load(nw_ptr + lat, mask=lat_ok, other=0.0).to(tl.float32)
        cn = round_to(nw[None, :] * round_to(c * inv[:, None], X_DTYPE, RNE_BF16), N_DTYPE, RNE_BF16)
        x = _load_sum(kv_row + R, e[None, :], pe_mask, Skv, stride_kvs, X_DTYPE, RNE_BF16)
        xq = _load_sum(kv_row + R, partner[None, :], pe_mask, Skv, stride_kvs, X_DTYPE, RNE_BF16)
        kp = _rope(x, xq, cs, sn, half, e, X_DTYPE, RNE_BF16)
        pos = tl.load(pos_ptr + b, mask=b_ok, other=0)
        row = tl.load(rows_ptr + b, mask=b_ok, other=0).to(tl.int64)
        ok = b_ok & (pos < cap) & (pos >= 0)
        if PAGED:
            blk = tl.load(tab_ptr + row * stride_tab + pos // page, mask=ok, other=0).to(tl.int64)
            at = blk * stride_cr + (pos % page).to(tl.int64) * stride_ct
        else:
            at = row * stride_cr + pos.to(tl.int64) * stride_ct
        tl.store(cache_ptr + at[:, None] + lat[None, :], round_to(cn, cdt, RNE_BF16).to(cdt),
                 mask=ok[:, None] & lat_ok[None, :])
        tl.store(cache_ptr + at[:, None] + R + e[None, :], round_to(kp, cdt, RNE_BF16).to(cdt),
                 mask=ok[:, None] & e_ok[None, :])


def mla_prep(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
             eps: float, w_uk: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
             table: torch.Tensor | None, x_dtype: torch.dtype, block_r: int | None = None, num_warps: int = 4):
    """A decode step's MLA input in one launch: q [Sq, B, H * (nope + P)] and kv [Skv, B, R + P] (the projections'
    outputs as S split-K partials, or S = 1 and the outputs themselves; unit last strides), rounded to x_dtype (the
    model's) as the summed GEMV output is; cos, sin [B, P] (unit last stride); norm_weight [R] (kv_a_layernorm);
    w_uk [H, nope, R] (unit last stride); cache [rows, capacity, R + P] (one layer of the latent cache; paged:
    blocks [N, page, R + P] through table int32 [rows, blocks]); rows, positions int [B] on the device.
    Stores [rms_norm(latent) | rope(k_pe)] at each sequence's row and position and returns (q_lat [B, H, R],
    q_pe [B, H, P]) in the cache's dtype: q_lat = W_UK^T q_nope per head, q_pe = rope(q's rope part)."""
    what = "mla_prep"
    H, NOPE, R = w_uk.shape
    B = q.shape[1]
    P = cache.shape[-1] - R
    if (q.dim() != 3 or kv.dim() != 3 or q.shape[2] != H * (NOPE + P) or kv.shape[1:] != (B, R + P)
            or q.stride(2) != 1 or kv.stride(2) != 1 or P < 2 or P % 2):
        raise ValueError(f"{what}: q [S, B, {H} * ({NOPE} + P)] and kv [S, B, {R} + P] with unit last strides "
                         f"(P = {P}, even), got {tuple(q.shape)} and {tuple(kv.shape)}")
    if cos.shape != (B, P) or sin.shape != (B, P) or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"{what}: cos, sin must be [{B}, {P}] alike with a unit last stride, got {tuple(cos.shape)}")
    if norm_weight.shape != (R,) or w_uk.stride(2) != 1 or cache.stride(-1) != 1 or cache.dim() != 3:
        raise ValueError(f"{what}: norm weight [{R}], W_UK and the cache with unit last strides")
    for name, index in (("rows", rows), ("positions", positions)):
        if index.shape != (B,) or index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous int32/int64 [{B}]")
    if table is not None and (table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1):
        raise ValueError(f"{what}: a block table must be int32 [rows, blocks] with a unit last stride")
    dev = cache.device
    q_lat = torch.empty((B, H, R), dtype=cache.dtype, device=dev)
    q_pe = torch.empty((B, H, P), dtype=cache.dtype, device=dev)
    if B == 0:
        return q_lat, q_pe
    page = cache.shape[1]
    cap = page if table is None else page * table.shape[1]
    if block_r is None:  # latent columns a program: the widest (fewest W_UK reads) that still fills the GPU
        block_r = next((br for br in (128, 64) if triton.cdiv(B, BLOCK_B) * (H * triton.cdiv(R, br) + 1)
                        >= num_sms(dev)), 32)
    brb = min(block_r, triton.next_power_of_2(R))
    nrb = triton.cdiv(R, brb)
    n_dtype = torch.promote_types(norm_weight.dtype, x_dtype)
    use_pdl = pdl(dev)
    _mla_prep_kernel[(triton.cdiv(B, BLOCK_B), H * nrb + 1)](
        q, kv, cos, sin, norm_weight, w_uk, q_lat, q_pe, cache, positions, rows,
        positions if table is None else table, B, H, q.shape[0], kv.shape[0], q.stride(0), q.stride(1),
        kv.stride(0), kv.stride(1), cos.stride(0), w_uk.stride(0), w_uk.stride(1), q_lat.stride(0),
        q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1), cap, page,
        0 if table is None else table.stride(0), eps,
        NOPE=NOPE, P=P, R=R, BNOPE=max(16, triton.next_power_of_2(NOPE)), BP=max(16, triton.next_power_of_2(P)),
        BR=triton.next_power_of_2(R), BRB=max(16, brb), NRB=nrb, BB=BLOCK_B, X_DTYPE=_TL[x_dtype],
        N_DTYPE=_TL[n_dtype], PAGED=table is not None, TC=not INTERPRET, RNE_BF16=INTERPRET, PDL=use_pdl,
        launch_pdl=use_pdl, num_warps=num_warps)
    return q_lat, q_pe


# ----------------------------------------------------------------------------- MLA: the attention's output


@triton.jit
def _uv_kernel(ol_ptr, w_ptr, o_ptr, B, H, V, stride_lb, stride_lh, stride_wh, stride_wv, stride_ob,
               R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr, TC: tl.constexpr,
               RNE_BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BB sequences, head, BV value columns): o[b, h * V + v] = sum_r o_lat[b, h, r] W_UV[h, v, r],
    fp32 sums of products in the latents' dtype, rounded to it, then to o's dtype."""
    pdl_start(PDL)
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    h = tl.program_id(1)
    v = tl.program_id(2) * BV + tl.arange(0, BV)
    b_ok = b < B
    v_ok = v < V
    ldt = ol_ptr.dtype.element_ty
    acc = tl.zeros((BB, BV), dtype=tl.float32)
    for k0 in tl.static_range(0, R, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < R
        a = tl.load(ol_ptr + b.to(tl.int64)[:, None] * stride_lb + h * stride_lh + k[None, :],
                    mask=b_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + k[:, None],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)  # [BK, BV] = W_UV[h]^T
        acc += _dot(a, w, ldt, TC)
    odt = o_ptr.dtype.element_ty
    out = round_to(round_to(acc, ldt, RNE_BF16), odt, RNE_BF16)
    tl.store(o_ptr + b.to(tl.int64)[:, None] * stride_ob + h * V + v[None, :], out.to(odt),
             mask=b_ok[:, None] & v_ok[None, :])


def uv_out(o_lat: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype, block_v: int | None = None,
           block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """o_lat [B, H, R] (unit last stride), w_uv [H, v, R] (unit last stride) -> [B, H * v] in out_dtype:
    `reference.absorbed_attention`'s last einsum (in o_lat's dtype), laid out as o_proj's input. A program loads
    its whole latent width at once where its programs are few and narrow (block_k 512 with <= 32 value columns: a
    loop of dependent steps is a latency chain there, docs/perf-log.md session 7), else steps of 128."""
    B, H, R = o_lat.shape
    V = w_uv.shape[1]
    if w_uv.shape != (H, V, R) or w_uv.stride(2) != 1 or o_lat.stride(2) != 1:
        raise ValueError(f"uv_out: o_lat [B, H, R] and w_uv [H, v, R] with unit last strides, got "
                         f"{tuple(o_lat.shape)} and {tuple(w_uv.shape)}")
    o = torch.empty((B, H * V), dtype=out_dtype, device=o_lat.device)
    if B == 0:
        return o
    if block_v is None:  # value columns a program: the widest that still fills the GPU (batch 1: 16 heads x 8)
        block_v = next((bv for bv in (64, 32) if triton.cdiv(B, BLOCK_B) * H * triton.cdiv(V, bv)
                        >= num_sms(o_lat.device)), 16)
    bv = max(16, min(block_v, triton.next_power_of_2(V)))
    block_k = block_k or (512 if bv <= 32 else 128)
    use_pdl = pdl(o.device)
    _uv_kernel[(triton.cdiv(B, BLOCK_B), H, triton.cdiv(V, bv))](
        o_lat, w_uv, o, B, H, V, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), o.stride(0),
        R=R, BK=max(16, min(block_k, triton.next_power_of_2(R))), BV=bv, BB=BLOCK_B, TC=not INTERPRET,
        RNE_BF16=INTERPRET, PDL=use_pdl, launch_pdl=use_pdl, num_warps=num_warps)
    return o
