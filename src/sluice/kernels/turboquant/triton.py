"""Quantize-on-append for the TurboQuant KV cache on CUDA (one launch per decode step appends K and V and rotates q:
`decode_step_prep`), checked against `reference.quantize`; `rotate` for either direction (the decode kernel's
merge rotates its output back itself); `dequantize`, a range of positions back to vectors in the rotated domain (the
prefill attention's keys and values).

Program: up to 16 vectors (sequence, KV head) of the sequences' new positions, as many as there are. y = (x *
signs) H / sqrt(d) (H the +-1 Sylvester Hadamard matrix, never stored: H_d = H_A (x) H_16, two small fp32 products
in registers); the code of each coordinate of sqrt(d) y / |y| by 15 compares against the cell boundaries; scale =
|x| / |levels[codes]|; codes packed two per byte (byte i: coordinate i low, i + d/2 high) into the cache slot
(values: four positions interleaved, reference.interleave), the scale beside them, and the exact rotated vector
into the recent ring. Sequence b's position p = positions[b] and its cache row (rows[b], or b) are read on the
device, so a CUDA graph captures the launch: slot p % capacity (p itself below the capacity; a sliding window's
ring slot), ring slot p % R. Paged (a block table, `cache/blocks.py`): the codes and scales are blocks of `page`
positions (their capacity dim), position p of cache row r at slot p % page of block table[r, p // page]; the ring
stays one per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import INTERPRET, round_to
from sluice.kernels.turboquant import reference


@triton.jit(do_not_specialize=["ring_from"])
def _append_kernel(k_ptr, v_ptr, q_ptr, qr_ptr, sign_ptr, lv_ptr, bd_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                   kr_ptr, vr_ptr, pos_ptr, rows_ptr, tab_ptr, n_vecs, n_q_rows, Hkv, cap, R, ring_from, stride_xr,
                   stride_qr, stride_tab, stride_kcb, stride_kch, stride_kct, stride_vcb, stride_vch, stride_vct,
                   stride_sb, stride_sh, stride_rb, stride_rh, stride_rt,
                   D: tl.constexpr, VECS: tl.constexpr, K_LANES: tl.constexpr, V_LANES: tl.constexpr,
                   HAS_ROWS: tl.constexpr, PAGED: tl.constexpr):
    """Job program_id(1): 0 appends the new keys (rows of k), 1 the new values, 2 rotates the queries into qr
    (fp32): a decode step's three small jobs in one launch, VECS vectors per program. LANES: positions interleaved
    in the code array (1: row by row; 4: reference.interleave)."""
    job = tl.program_id(1)
    if job == 0:
        _append_vectors(k_ptr, sign_ptr, lv_ptr, bd_ptr, kc_ptr, ks_ptr, kr_ptr, pos_ptr, rows_ptr, tab_ptr, n_vecs,
                        Hkv, cap, R, ring_from, stride_xr, stride_tab, stride_kcb, stride_kch, stride_kct, stride_sb,
                        stride_sh, stride_rb, stride_rh, stride_rt, D, VECS, K_LANES, HAS_ROWS, PAGED)
    elif job == 1:
        _append_vectors(v_ptr, sign_ptr, lv_ptr, bd_ptr, vc_ptr, vs_ptr, vr_ptr, pos_ptr, rows_ptr, tab_ptr, n_vecs,
                        Hkv, cap, R, ring_from, stride_xr, stride_tab, stride_vcb, stride_vch, stride_vct, stride_sb,
                        stride_sh, stride_rb, stride_rh, stride_rt, D, VECS, V_LANES, HAS_ROWS, PAGED)
    else:
        _rotate_rows(q_ptr, qr_ptr, sign_ptr, n_q_rows, stride_qr, D, False, VECS)


@triton.jit
def _append_vectors(x_ptr, sign_ptr, lv_ptr, bd_ptr, codes_ptr, scale_ptr, ring_ptr, pos_ptr, rows_ptr, tab_ptr,
                    n_vecs, Hkv, cap, R, ring_from, stride_xr, stride_tab, stride_cb, stride_ch, stride_ct, stride_sb,
                    stride_sh, stride_rb, stride_rh, stride_rt, D: tl.constexpr, VECS: tl.constexpr,
                    LANES: tl.constexpr, HAS_ROWS: tl.constexpr, PAGED: tl.constexpr):
    """VECS of the new vectors (vector i: sequence i // Hkv, KV head i % Hkv) into slot positions[b] % cap of the
    codes and scales and slot positions[b] % R of the ring (positions from ring_from on), in cache row rows[b]
    (HAS_ROWS) or b; PAGED: the codes and scales in block table[row, positions[b] // cap] instead."""
    vec = tl.program_id(0) * VECS + tl.arange(0, VECS)
    ok = vec < n_vecs
    d = tl.arange(0, D)
    dh = tl.arange(0, D // 2)
    x = tl.load(x_ptr + vec[:, None] * stride_xr + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    # y = (x * signs) H / sqrt(d); its two halves go to the low and the high nibbles
    y = _hadamard_rows(x * tl.load(sign_ptr + d)[None, :], D, "ieee") * (1.0 / tl.sqrt(D * 1.0))
    y_lo, y_hi = _halves(y, D)
    norm = tl.sqrt(tl.sum(y_lo * y_lo, axis=1) + tl.sum(y_hi * y_hi, axis=1))
    unit = tl.sqrt(D * 1.0) / tl.maximum(norm, 1e-30)
    c_lo, lv_lo = _nearest_level(y_lo * unit[:, None], lv_ptr, bd_ptr)
    c_hi, lv_hi = _nearest_level(y_hi * unit[:, None], lv_ptr, bd_ptr)
    scale = norm / tl.maximum(tl.sqrt(tl.sum(lv_lo * lv_lo, axis=1) + tl.sum(lv_hi * lv_hi, axis=1)), 1e-30)
    b = vec // Hkv
    hh = vec % Hkv
    p = tl.load(pos_ptr + b, mask=ok, other=0)
    if HAS_ROWS:
        cache_row = tl.load(rows_ptr + b, mask=ok, other=0).to(tl.int64)
    else:
        cache_row = b.to(tl.int64)
    slot = p % cap
    if PAGED:  # the codes' and scales' block; the ring stays the row's
        where = tl.load(tab_ptr + cache_row * stride_tab + p // cap, mask=ok, other=0).to(tl.int64)
    else:
        where = cache_row
    c_off = (slot // LANES)[:, None] * stride_ct + dh[None, :] * LANES + (slot % LANES)[:, None]
    tl.store(codes_ptr + where[:, None] * stride_cb + hh[:, None] * stride_ch + c_off,
             (c_lo | (c_hi << 4)).to(tl.uint8), mask=ok[:, None])
    tl.store(scale_ptr + where * stride_sb + hh * stride_sh + slot, scale, mask=ok)
    ring = (ring_ptr + cache_row[:, None] * stride_rb + hh[:, None] * stride_rh + (p % R)[:, None] * stride_rt
            + dh[None, :])
    in_ring = (ok & (p >= ring_from))[:, None]
    tl.store(ring, y_lo.to(ring_ptr.dtype.element_ty), mask=in_ring)
    tl.store(ring + D // 2, y_hi.to(ring_ptr.dtype.element_ty), mask=in_ring)


@triton.jit
def _sylvester(N: tl.constexpr, A: tl.constexpr):
    """[N, N] fp32 (N <= 16) with the Sylvester Hadamard matrix H_A on its diagonal blocks and zeros elsewhere
    (A = N: H_N itself), from indices: H[i, j] = (-1)^popcount(i & j)."""
    i = tl.arange(0, N)
    x = i[:, None] & i[None, :] & (A - 1)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)  # bit 0: the parity of the 4 low bits
    h = 1.0 - 2.0 * (x & 1).to(tl.float32)
    return tl.where(i[:, None] // A == i[None, :] // A, h, 0.0)


@triton.jit
def _times_sylvester(x, N: tl.constexpr, PREC: tl.constexpr):
    """x [M, N] @ H_N (N <= 16) as an fp32 product (PREC: the dot's input precision; "ieee" runs on FMAs, "tf32x3"
    on tensor cores to about fp32 accuracy): rows of N < 16 taken 16 / N at a time against 16 / N copies of H_N
    (tensor-core shapes need 16 rows and 16 columns); products summed when too few rows."""
    M: tl.constexpr = x.shape[0]
    if M * N >= 256 and N < 16:
        y = tl.dot(tl.reshape(x, (M * N // 16, 16)), _sylvester(16, N), input_precision=PREC)
        return tl.reshape(y, (M, N))
    if M >= 16 and N == 16:
        return tl.dot(x, _sylvester(16, 16), input_precision=PREC)
    return tl.sum(x[:, :, None] * _sylvester(N, N)[None, :, :], axis=1)


@triton.jit
def _hadamard_rows(x, D: tl.constexpr, PREC: tl.constexpr):
    """x [R, D] fp32 @ H_D (unnormalised), in registers: H_D = H_A (x) H_B with B = min(D, 16), A = D / B
    (coordinate i = B i1 + i0), so the product is H_B applied along i0 and H_A along i1: two small products and
    no D x D matrix read from memory."""
    R: tl.constexpr = x.shape[0]
    B: tl.constexpr = min(D, 16)
    A: tl.constexpr = D // B
    y = _times_sylvester(tl.reshape(x, (R * A, B)), B, PREC)
    if A > 1:
        y = tl.reshape(tl.permute(tl.reshape(y, (R, A, B)), (0, 2, 1)), (R * B, A))
        y = _times_sylvester(y, A, PREC)
        y = tl.permute(tl.reshape(y, (R, B, A)), (0, 2, 1))
    return tl.reshape(y, (R, D))


@triton.jit
def _halves(y, D: tl.constexpr):
    """y [R, D] -> (y[:, :D/2], y[:, D/2:])."""
    return tl.split(tl.permute(tl.reshape(y, (y.shape[0], 2, D // 2)), (0, 2, 1)))


@triton.jit
def _nearest_level(yn, lv_ptr, bd_ptr):
    """(code, level) of each coordinate: the code counts the cell boundaries below it, the level climbs by the gap
    at each one. 15 independent compares against scalars loaded up front (a binary search would chain 4 dependent
    gathers from memory)."""
    code = tl.zeros(yn.shape, dtype=tl.int32)
    level = tl.zeros(yn.shape, dtype=tl.float32) + tl.load(lv_ptr)
    for i in tl.static_range(15):
        above = yn > tl.load(bd_ptr + i)
        code += above.to(tl.int32)
        level += tl.where(above, tl.load(lv_ptr + i + 1) - tl.load(lv_ptr + i), 0.0)
    return code, level


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, sign_ptr, n_rows, stride_xr, D: tl.constexpr, INVERSE: tl.constexpr):
    _rotate_rows(x_ptr, y_ptr, sign_ptr, n_rows, stride_xr, D, INVERSE, 16)


@triton.jit
def _rotate_rows(x_ptr, y_ptr, sign_ptr, n_rows, stride_xr, D: tl.constexpr, INVERSE: tl.constexpr,
                 ROWS: tl.constexpr):
    """ROWS rows: y = (x * s) H / sqrt(d) (R x), or with INVERSE y = (x H) * s / sqrt(d) (R^T x); fp32 out."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    d = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if not INVERSE:
        x = x * tl.load(sign_ptr + d)[None, :]
    y = _hadamard_rows(x, D, "ieee") * (1.0 / tl.sqrt(D * 1.0))
    if INVERSE:
        y = y * tl.load(sign_ptr + d)[None, :]
    tl.store(y_ptr + rows[:, None] * D + d[None, :], y, mask=ok[:, None])


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, lv_ptr, out_ptr, tab_ptr, first, n, cap, Hkv, stride_cb, stride_ch,
                    stride_ct, stride_sb, stride_sh, stride_ob, stride_oh, stride_ot, stride_tab, D: tl.constexpr,
                    LANES: tl.constexpr, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr, PAGED: tl.constexpr):
    """BLOCK of positions first .. first + n - 1 (slot p % cap) of row program_id(1) // Hkv, head % Hkv: each
    coordinate scale * levels[code] (in fp32, as reference.dequantize_rotated), stored in out's dtype. PAGED: the
    row's position p in block table[row, p // cap]."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1) // Hkv
    h = tl.program_id(1) % Hkv
    ok = i < n
    slot = (first + i) % cap
    if PAGED:
        blk = tl.load(tab_ptr + b * stride_tab + (first + i) // cap, mask=ok, other=0).to(tl.int64)
        c_row = (blk * stride_cb)[:, None]
        s_row = blk * stride_sb
    else:
        c_row = b * stride_cb
        s_row = b * stride_sb
    dh = tl.arange(0, D // 2)
    c_off = (slot // LANES)[:, None] * stride_ct + dh[None, :] * LANES + (slot % LANES)[:, None]
    byte = tl.load(codes_ptr + c_row + h * stride_ch + c_off, mask=ok[:, None], other=0).to(tl.int32)
    s = tl.load(scale_ptr + s_row + h * stride_sh + slot, mask=ok, other=0.0)[:, None]
    o = out_ptr + b * stride_ob + h * stride_oh + i[:, None] * stride_ot + dh[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(o, round_to(tl.load(lv_ptr + (byte & 15)) * s, dt, RNE_BF16).to(dt), mask=ok[:, None])
    tl.store(o + D // 2, round_to(tl.load(lv_ptr + (byte >> 4)) * s, dt, RNE_BF16).to(dt), mask=ok[:, None])


_TABLES: dict = {}


def _tables(D: int, device):
    key = (D, device)
    if key not in _TABLES:
        _TABLES[key] = (reference.signs(D, device), reference.codebook(device), reference.boundaries(device))
    return _TABLES[key]


def rotate(x: torch.Tensor, inverse: bool = False, num_warps: int | None = None) -> torch.Tensor:
    """reference.rotate (or with inverse, reference.unrotate) over the last dim on the GPU, one launch: fp32 out."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    signs, _, _ = _tables(D, x.device)
    _rotate_kernel[(triton.cdiv(rows.shape[0], 16),)](rows, y, signs, rows.shape[0], rows.stride(0), D=D,
                                                      INVERSE=inverse, num_warps=num_warps or _warps(D))
    return y.reshape(x.shape)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, first: int, n: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """Positions first .. first + n - 1 (slot p % capacity) of codes [B, Hkv, cap, D/2] (or interleaved as values
    are) and scales [B, Hkv, cap] fp32 -> [B, Hkv, n, D] in `dtype` (or into `out`, unit last stride):
    reference.dequantize_rotated of them, in one launch. Paged (`table`, int32 [B, blocks] on the device: the B
    rows' table rows): codes and scales are blocks [N, Hkv, page, ...], row b's position p in block
    table[b, p // page] at slot p % page."""
    Hkv = codes.shape[1]
    B = codes.shape[0] if table is None else table.shape[0]
    D = 2 * codes.shape[3]
    (strides, lanes) = _code_layout(codes, D)
    if table is not None and (table.dtype != torch.int32 or table.dim() != 2 or table.stride(-1) != 1):
        raise ValueError("dequantize: a block table must be int32 [rows, blocks] with a unit last stride")
    if out is None:
        out = torch.empty((B, Hkv, n, D), dtype=dtype, device=codes.device)
    elif out.shape != (B, Hkv, n, D) or out.stride(-1) != 1:
        raise ValueError(f"dequantize: out must be [{B}, {Hkv}, {n}, {D}] with a unit last stride")
    if n:
        _, levels, _ = _tables(D, codes.device)
        _dequant_kernel[(triton.cdiv(n, 32), B * Hkv)](
            codes, scales, levels, out, scales if table is None else table, first, n, codes.shape[2] * lanes, Hkv,
            *strides, scales.stride(0), scales.stride(1), out.stride(0), out.stride(1), out.stride(2),
            0 if table is None else table.stride(0), D=D, LANES=lanes, BLOCK=32, RNE_BF16=INTERPRET,
            PAGED=table is not None, num_warps=4)
    return out


def quantize_append(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ring: torch.Tensor,
                    positions: torch.Tensor, rows: torch.Tensor | None = None,
                    table: torch.Tensor | None = None) -> None:
    """x [B, Hkv, D] (the keys or values of sequence b's new position positions[b]; positions int32 or int64 [B]
    on the device) -> codes, scales and ring of the cache row rows[b] (int32 or int64 [B] on the device; row b
    without `rows`), a pool of P rows: its codes at slot s = positions[b] % cap (uint8 [P, Hkv, cap, D/2], or
    interleaved [P, Hkv, cap/4, D/2, 4] as values are: reference.interleave), its scale at scales[row, :, s] (fp32
    [P, Hkv, cap]) and the rotated x at ring[row, :, positions[b] % R] ([P, Hkv, R, D]). Paged (`table`, int32
    [P, blocks] on the device): codes and scales are blocks [N, Hkv, page, ...] (cap = page), written at block
    table[row, positions[b] // page] instead of row; the ring stays the row's. Nothing is read on the host: a CUDA
    graph captures the call."""
    _launch_append(x, x, None, codes, codes, scales, scales, ring, ring, positions, rows, None, jobs=1, table=table)


def decode_step_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_codes, v_codes, k_scale, v_scale, k_ring,
                     v_ring, positions: torch.Tensor, rows: torch.Tensor | None = None,
                     num_warps: int | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for a decode step's TurboQuant bookkeeping: append the new k and v [B, Hkv, D] at positions,
    in rows (as quantize_append does, through `table` when paged; key codes row by row, value codes interleaved, the
    same capacity) and return the rotated queries q [B, Hq, D] (fp32, as `rotate`)."""
    qr = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _launch_append(k, v, q, k_codes, v_codes, k_scale, v_scale, k_ring, v_ring, positions, rows, qr, 3, num_warps,
                   table=table)
    return qr


def append_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_codes, v_codes, k_scale, v_scale, k_ring,
                 v_ring, row0: int, start: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk's bookkeeping in one launch: k, v [B, Hkv, T, D] of the sequences in cache rows row0 ..
    row0 + B - 1 at positions start .. start + T - 1, appended as `decode_step_prep` appends a decode step's (the
    ring only from the chunk's last R positions on: earlier ones would race for its slots; paged, the codes and
    scales through `table`, the whole pool's); returns q [B, Hq, T, D] rotated (fp32)."""
    B, Hkv, T, D = k.shape
    flat = lambda x: x.transpose(1, 2).reshape(B * T, Hkv, D)  # noqa: E731 vector i: (sequence, position) i // Hkv
    positions = torch.arange(start, start + T, device=k.device).repeat(B)
    rows = torch.arange(row0, row0 + B, device=k.device).repeat_interleave(T)
    qr = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _launch_append(flat(k), flat(v), q, k_codes, v_codes, k_scale, v_scale, k_ring, v_ring, positions, rows, qr, 3,
                   ring_from=start + T - k_ring.shape[2], table=table)
    return qr


def _warps(D: int) -> int:
    """These one-program launches are compute-bound: at D = 256 more warps finish the step's append + rotate sooner
    (ncu, H100; docs/perf-log.md)."""
    return 8 if D >= 128 else 4


def _launch_append(k, v, q, k_codes, v_codes, k_scale, v_scale, k_ring, v_ring, positions, rows, qr, jobs,
                   num_warps=None, ring_from=0, table=None):
    """`_append_kernel`'s jobs 0 .. jobs-1 (K, V, q); K and V scales and rings share their layouts; `table`: the
    codes and scales are blocks read through it."""
    B, Hkv, D = k.shape
    if D & (D - 1) or D < 16 or D > 256:
        raise ValueError(f"quantize_append: D = {D} must be a power of two in 16..256")
    (k_strides, k_lanes), (v_strides, v_lanes) = _code_layout(k_codes, D), _code_layout(v_codes, D)
    cap = k_codes.shape[2] * k_lanes
    if v_codes.shape[2] * v_lanes != cap:
        raise ValueError(f"quantize_append: key and value codes of different capacities, {cap} and "
                         f"{v_codes.shape[2] * v_lanes}")
    for a, b in ((k_scale, v_scale), (k_ring, v_ring)):
        if a.stride(-1) != 1 or b.stride() != a.stride():
            raise ValueError("quantize_append: cache tensors need a unit last stride and K, V the same layout")
    for name, index in (("positions", positions), ("rows", rows)):
        if index is not None and (index.shape != (B,) or index.dtype not in (torch.int32, torch.int64)
                                  or not index.is_contiguous()):
            raise ValueError(f"quantize_append: {name} must be contiguous int32 or int64 [B={B}], got {index.dtype} "
                             f"{tuple(index.shape)}")
    if rows is None and k_ring.shape[0] < B:
        raise ValueError(f"quantize_append: {B} sequences, {k_ring.shape[0]} cache rows and no `rows`")
    if table is not None and (table.dtype != torch.int32 or table.dim() != 2 or table.stride(-1) != 1):
        raise ValueError("quantize_append: a block table must be int32 [rows, blocks] with a unit last stride")
    kr, vr = k.reshape(-1, D).contiguous(), v.reshape(-1, D).contiguous()
    qrows = q.reshape(-1, D).contiguous() if q is not None else kr
    signs, levels, bounds = _tables(D, k.device)
    # vectors per program: up to 16, no more than the new keys (batch 1, 2 KV heads: 2, not 16 of which 14 are
    # padding, in the ~7000-instruction quantization of each program at D = 256)
    vecs = min(16, triton.next_power_of_2(kr.shape[0]))
    grid = (triton.cdiv(max(kr.shape[0], qrows.shape[0]), vecs), jobs)
    _append_kernel[grid](
        kr, vr, qrows, qr if qr is not None else kr, signs, levels, bounds, k_codes, v_codes, k_scale,
        v_scale, k_ring, v_ring, positions, positions if rows is None else rows,
        positions if table is None else table, kr.shape[0], qrows.shape[0], Hkv, cap, k_ring.shape[2], ring_from,
        kr.stride(0), qrows.stride(0), 0 if table is None else table.stride(0), *k_strides, *v_strides,
        k_scale.stride(0), k_scale.stride(1), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), D=D, VECS=vecs,
        K_LANES=k_lanes, V_LANES=v_lanes, HAS_ROWS=rows is not None, PAGED=table is not None,
        num_warps=num_warps or _warps(D))


def _code_layout(codes: torch.Tensor, D: int) -> tuple[tuple[int, int, int], int]:
    """((batch, head, slot-group strides), positions interleaved) of a code array: [B, Hkv, cap, D/2] (1) or
    [B, Hkv, cap/4, D/2, 4] (4, reference.interleave)."""
    lanes = 4 if codes.dim() == 5 else 1
    row = (D // 2, 4) if lanes == 4 else (D // 2,)  # the innermost dims, contiguous
    if (codes.dtype != torch.uint8 or codes.dim() not in (4, 5) or tuple(codes.shape[-len(row):]) != row
            or codes.stride(-1) != 1 or (lanes == 4 and codes.stride(-2) != 4)):
        raise ValueError(f"TurboQuant codes must be uint8 [B, Hkv, cap, {D // 2}] or [B, Hkv, cap/4, {D // 2}, 4] "
                         f"with unit innermost strides, got {codes.dtype} {tuple(codes.shape)}")
    return (codes.stride(0), codes.stride(1), codes.stride(2)), lanes
