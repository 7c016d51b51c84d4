"""Triton kernels of Gated DeltaNet's short convolution: causal depthwise conv1d (width W in 2..8) with a carried
state of the last W-1 inputs per channel, optional SiLU. The oracle is `reference.causal_conv1d`.

- `causal_conv1d` (prefill): x [B, T, C], or N packed sequences [1, total_T, C] with `cu_seqlens`. ONE launch:
  programs `[0, n_tiles)` own [BLOCK_T, BLOCK_C] tiles of the flattened token axis (a tile may cross sequence
  boundaries: each row finds its sequence by a binary search over `cu_seqlens`) and compute the rows whose W
  taps all lie inside their own sequence (position >= W-1). Programs `n_tiles + i` own sequence i: its first
  min(len, W-1) rows, the only ones that read the old state, and the new state. So the old state of a sequence
  is read by one program only, the one that overwrites it: the in-place update of a state cache
  (`state_indices`) has no race between programs, and no host synchronisation is needed (no max length).
- `causal_conv1d_update` (decode): one token per sequence, one launch; each program reads its slot's state for
  a block of channels, writes y and the state shifted by one with x appended.

Channels are the parallel axis (C = 8192 for Qwen3-Next) and x's C axis is contiguous, so loads of a tile are
coalesced along C; the W taps of a prefill tile are W shifted loads of the same rows (L1/L2 hits). Prefill tiles
of [16, 256] (4 warps) measured best on an H200 (near a plain copy of x; taller tiles were slower). Accumulation in
fp32; a state is read through x's dtype, as the reference does (it concatenates state.to(x.dtype) and x).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import pdl, pdl_start

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MIN_WIDTH, MAX_WIDTH = 2, 8
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG_N_MIN = 7  # binary-search steps over the sequences' starts at least: one compiled kernel for up to 128
# sequences a call (more steps than needed leave the search where it ends)


@triton.jit
def _find_seq(cu_ptr, rows, N, LOG_N: tl.constexpr):
    """Per row r: the sequence i with cu[i] <= r < cu[i + 1] (binary search; empty sequences never match) and
    its start cu[i]."""
    lo = tl.zeros_like(rows)
    hi = lo + N
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi) // 2  # < hi <= N: always a valid entry
        go = tl.load(cu_ptr + mid).to(tl.int32) <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo, tl.load(cu_ptr + lo).to(tl.int32)


@triton.jit
def _conv1d_body_tile(tile, offs_c, c_ok, x_ptr, w_ptr, y_ptr, cu_ptr, R, T, C, N, stride_xb, stride_xt,
                      stride_wc, stride_wk, W: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr,
                      LOG_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [tile * BLOCK_T, +BLOCK_T) of the flattened token axis whose W taps all lie inside the row's own
    sequence (position >= W-1): no state."""
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    if VARLEN:
        seq, start = _find_seq(cu_ptr, rows, N, LOG_N)
        pos = rows - start
        x_rows = rows.to(tl.int64) * stride_xt
    else:
        seq = rows // T
        pos = rows - seq * T
        x_rows = seq.to(tl.int64) * stride_xb + pos.to(tl.int64) * stride_xt
    mask = ((rows < R) & (pos >= W - 1))[:, None] & c_ok[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        xj = tl.load(x_ptr + (x_rows + (j - (W - 1)) * stride_xt)[:, None] + offs_c[None, :], mask=mask, other=0.0)
        acc += wj[None, :] * xj.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + offs_c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv1d_seq_head(s, offs_c, c_ok, x_ptr, w_ptr, y_ptr, s_ptr, ns_ptr, cu_ptr, idx_ptr, T, C, stride_xb,
                     stride_xt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk, stride_ns, stride_nc,
                     stride_nk, W: tl.constexpr, VARLEN: tl.constexpr, HAS_STATE: tl.constexpr,
                     HAS_IDX: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, HP: tl.constexpr):
    """Sequence s: its first min(len, W-1) rows (the old state feeds them), then its new state."""
    x_dtype = x_ptr.dtype.element_ty
    if VARLEN:
        start = tl.load(cu_ptr + s).to(tl.int32)
        length = tl.load(cu_ptr + s + 1).to(tl.int32) - start
        x_seq = start.to(tl.int64) * stride_xt
    else:
        start = s * T
        length = T
        x_seq = s.to(tl.int64) * stride_xb
    if HAS_IDX:
        slot = tl.load(idx_ptr + s).to(tl.int32)  # < 0: no state in, none written
    else:
        slot = s
    s_row = s_ptr + slot.to(tl.int64) * stride_ss + offs_c[None, :] * stride_sc
    hp = tl.arange(0, HP)
    live = (tl.zeros((HP,), tl.int32) + slot) >= 0  # a block: the interpreter rejects block & scalar masks
    h_ok = (hp < length) & (hp < W - 1)
    acc = tl.zeros((HP, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = hp + (j - (W - 1))  # position in the sequence; < 0: state column hp + j
        v = tl.load(x_ptr + x_seq + (src.to(tl.int64) * stride_xt)[:, None] + offs_c[None, :],
                    mask=(h_ok & (src >= 0))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            sv = tl.load(s_row + (hp + j)[:, None] * stride_sk,
                         mask=(h_ok & (src < 0) & live)[:, None] & c_ok[None, :], other=0.0)
            v += sv.to(x_dtype).to(tl.float32)  # exclusive masks: one of the two is 0
        wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += wj[None, :] * v
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (start + hp).to(tl.int64)[:, None] * C + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=h_ok[:, None] & c_ok[None, :])
    # new state column k = input W-1-k steps back from the end: x[len - (W-1) + k], or, for a sequence
    # shorter than W-1, old state column len + k
    k = tl.arange(0, HP)
    q = length - (W - 1) + k
    k_ok = k < W - 1
    ns = tl.load(x_ptr + x_seq + (q.to(tl.int64) * stride_xt)[:, None] + offs_c[None, :],
                 mask=(k_ok & (q >= 0))[:, None] & c_ok[None, :], other=0.0)
    if HAS_STATE:
        old = tl.load(s_row + (length + k)[:, None] * stride_sk,
                      mask=(k_ok & (q < 0) & live)[:, None] & c_ok[None, :], other=0.0)
        ns += old.to(x_dtype)
    # every read of this slot's old state (above, any thread of this program) before any write to it
    tl.debug_barrier()
    tl.store(ns_ptr + slot.to(tl.int64) * stride_ns + offs_c[None, :] * stride_nc + k[:, None] * stride_nk,
             ns.to(ns_ptr.dtype.element_ty), mask=(k_ok & live)[:, None] & c_ok[None, :])


# R, T, N, n_tiles change with every step's prompt chunks: not specialized (Triton would compile a kernel for each
# value that is 1 or a multiple of 16, in the middle of serving: docs/perf-log.md, session 10)
@triton.jit(do_not_specialize=["R", "T", "N", "n_tiles"])
def _conv1d_fwd_kernel(x_ptr, w_ptr, y_ptr, s_ptr, ns_ptr, cu_ptr, idx_ptr, R, T, C, N, n_tiles,
                       stride_xb, stride_xt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                       stride_ns, stride_nc, stride_nk,
                       W: tl.constexpr, VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, HAS_IDX: tl.constexpr,
                       SILU: tl.constexpr, LOG_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       HP: tl.constexpr):
    """Programs [0, n_tiles): body tiles; n_tiles + s: sequence s's head rows and new state."""
    pid = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    if pid < n_tiles:
        _conv1d_body_tile(pid, offs_c, c_ok, x_ptr, w_ptr, y_ptr, cu_ptr, R, T, C, N, stride_xb, stride_xt,
                          stride_wc, stride_wk, W, VARLEN, SILU, LOG_N, BLOCK_T, BLOCK_C)
    else:
        _conv1d_seq_head(pid - n_tiles, offs_c, c_ok, x_ptr, w_ptr, y_ptr, s_ptr, ns_ptr, cu_ptr, idx_ptr, T, C,
                         stride_xb, stride_xt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk, stride_ns,
                         stride_nc, stride_nk, W, VARLEN, HAS_STATE, HAS_IDX, SILU, BLOCK_C, HP)


@triton.jit
def conv_update_columns(xv, offs_c, c_ok, slot, w_ptr, s_ptr, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                        W: tl.constexpr, SILU: tl.constexpr):
    """One decode token's conv at channels offs_c (those c_ok) of the sequence in state slot `slot` (< 0: zero
    state in, none written): xv [BLOCK] the token's inputs in x's dtype -> y fp32 [BLOCK] = sum_k w[c, k] *
    window[k] over the window [state 0..W-2, x], summed in k order (the same bits in every kernel that calls this,
    whatever its layout), silu'd with SILU; the state shifted left by one, x appended, in place."""
    x_dtype = xv.dtype
    live = c_ok & ((tl.zeros(offs_c.shape, tl.int32) + slot) >= 0)  # a block: the interpreter rejects block & scalar
    s_row = s_ptr + slot.to(tl.int64) * stride_ss + offs_c.to(tl.int64) * stride_sc
    w_row = w_ptr + offs_c.to(tl.int64) * stride_wc
    y = tl.zeros(offs_c.shape, tl.float32)
    for k in tl.static_range(W - 1):
        state_k = tl.load(s_row + k * stride_sk, mask=live, other=0.0).to(x_dtype)
        y += tl.load(w_row + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32) * state_k.to(tl.float32)
    y += tl.load(w_row + (W - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32) * xv.to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.debug_barrier()  # all reads of the slot (any thread of this program) before the writes
    for k in tl.static_range(W - 2):  # column k <- k + 1 (read before it is itself overwritten), the last <- x
        nxt = tl.load(s_row + (k + 1) * stride_sk, mask=live, other=0.0).to(x_dtype)
        tl.store(s_row + k * stride_sk, nxt.to(s_ptr.dtype.element_ty), mask=live)
    tl.store(s_row + (W - 2) * stride_sk, xv.to(s_ptr.dtype.element_ty), mask=live)
    return y


@triton.jit
def _conv1d_update_kernel(x_ptr, w_ptr, y_ptr, s_ptr, idx_ptr, C, stride_xb, stride_wc, stride_wk,
                          stride_ss, stride_sc, stride_sk, W: tl.constexpr, HAS_IDX: tl.constexpr,
                          SILU: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    if HAS_IDX:
        slot = tl.load(idx_ptr + b).to(tl.int32)  # < 0: zero state in, none written
    else:
        slot = b
    xv = tl.load(x_ptr + b.to(tl.int64) * stride_xb + offs_c, mask=c_ok, other=0.0)
    y = conv_update_columns(xv, offs_c, c_ok, slot, w_ptr, s_ptr, stride_wc, stride_wk, stride_ss, stride_sc,
                            stride_sk, W, SILU)
    tl.store(y_ptr + b.to(tl.int64) * C + offs_c, y.to(y_ptr.dtype.element_ty), mask=c_ok)


def _check_common(x: torch.Tensor, weight: torch.Tensor, activation, what: str) -> int:
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"{what}: x must be bf16, fp16 or fp32, got {x.dtype}")
    C = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != C or not weight.is_floating_point():
        raise ValueError(f"{what}: weight must be a float [C={C}, W] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    W = weight.shape[1]
    if not MIN_WIDTH <= W <= MAX_WIDTH:
        raise ValueError(f"{what}: width W must be in [{MIN_WIDTH}, {MAX_WIDTH}], got {W}")
    if activation not in ("silu", None):
        raise ValueError(f"{what}: activation must be 'silu' or None, got {activation!r}")
    return W


def _check_index(t: torch.Tensor | None, n: int, name: str, what: str) -> None:
    if t is not None and (t.dim() != 1 or t.shape[0] != n or t.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{what}: {name} must be int32/int64 [{n}], got {t.dtype} {tuple(t.shape)}")


def _check_device(what: str, *tensors) -> None:
    tensors = [t for t in tensors if t is not None]
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"{what}: all tensors must be on the same device")
    if not (dev.type == "cuda" or INTERPRET):
        raise ValueError(f"{what}: tensors must be on a CUDA device (or set TRITON_INTERPRET=1)")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: str | None = "silu", cu_seqlens: torch.Tensor | None = None,
                  state_indices: torch.Tensor | None = None, block_t: int = 16, block_c: int = 256,
                  num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d over x [B, T, C] (bf16/fp16/fp32) with weight [C, W] -> (y [B, T, C] in x's
    dtype, new state [., C, W-1]), as `reference.causal_conv1d`.

    - `cu_seqlens` (int32/int64 [N+1], cu[0] = 0, cu[N] = total_T; not checked, that would need a host sync): x is
      [1, total_T, C], N sequences back to back, each convolved on its own; states are per sequence.
    - `state`: without `state_indices`, the W-1 inputs before each sequence, [B or N, C, W-1] (zeros if None);
      the new state is a fresh tensor in x's dtype. With `state_indices` (int32 [B or N]): `state` is a cache
      [slots, C, W-1], sequence i reads and overwrites slot state_indices[i] in place, and the cache itself is
      returned; an index < 0 skips the slot (that sequence is convolved from a zero state, no slot is touched).
    """
    what = "causal_conv1d"
    if x.dim() != 3:
        raise ValueError(f"{what}: x must be [B, T, C], got {tuple(x.shape)}")
    W = _check_common(x, weight, activation, what)
    B, T, C = x.shape
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: cu_seqlens must be int32/int64 [N+1], got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"{what}: with cu_seqlens x must be [1, total_T, C], got {tuple(x.shape)}")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    _check_index(state_indices, N, "state_indices", what)
    if state_indices is not None:
        if state is None:
            raise ValueError(f"{what}: state_indices needs the state cache [slots, C, W-1]")
        if state.dim() != 3 or state.shape[1:] != (C, W - 1):
            raise ValueError(f"{what}: state cache must be [slots, {C}, {W - 1}], got {tuple(state.shape)}")
    elif state is not None and state.shape != (N, C, W - 1):
        raise ValueError(f"{what}: state must be [{N}, {C}, {W - 1}], got {tuple(state.shape)}")
    if state is not None and not state.is_floating_point():
        raise ValueError(f"{what}: state must be a float tensor, got {state.dtype}")
    _check_device(what, x, weight, state, cu_seqlens, state_indices)

    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    new_state = state if state_indices is not None else torch.empty((N, C, W - 1), dtype=x.dtype, device=x.device)
    R = B * T
    block_t = min(block_t, max(16, triton.next_power_of_2(max(R, 1))))
    block_c = min(block_c, max(16, triton.next_power_of_2(C)))
    n_tiles = triton.cdiv(R, block_t)
    if C == 0 or n_tiles + N == 0:
        return y, new_state
    s = state if state is not None else new_state  # placeholder pointers for what is not given
    grid = (n_tiles + N, triton.cdiv(C, block_c))
    _conv1d_fwd_kernel[grid](
        x, weight, y, s, new_state, cu_seqlens if cu_seqlens is not None else y,
        state_indices if state_indices is not None else y, R, T, C, N, n_tiles,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), s.stride(0), s.stride(1), s.stride(2),
        new_state.stride(0), new_state.stride(1), new_state.stride(2),
        W=W, VARLEN=cu_seqlens is not None, HAS_STATE=state is not None, HAS_IDX=state_indices is not None,
        SILU=activation == "silu", LOG_N=max(LOG_N_MIN, (N - 1).bit_length()), BLOCK_T=block_t, BLOCK_C=block_c,
        HP=triton.next_power_of_2(W - 1), num_warps=num_warps)
    return y, new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         state_indices: torch.Tensor | None = None, activation: str | None = "silu",
                         block_c: int = 128, num_warps: int = 4) -> torch.Tensor:
    """One decode token per sequence: x [B, C], weight [C, W], conv_state [slots, C, W-1] (slots = B without
    `state_indices`; else sequence b uses slot state_indices[b], < 0 = skip: zero state in, nothing written)
    -> y [B, C] in x's dtype; conv_state is shifted left by one with x appended, in place. One launch."""
    what = "causal_conv1d_update"
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be [B, C], got {tuple(x.shape)}")
    W = _check_common(x, weight, activation, what)
    B, C = x.shape
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, W - 1) or not conv_state.is_floating_point():
        raise ValueError(f"{what}: conv_state must be a float [slots, {C}, {W - 1}] tensor, got "
                         f"{conv_state.dtype} {tuple(conv_state.shape)}")
    if state_indices is None and conv_state.shape[0] != B:
        raise ValueError(f"{what}: without state_indices conv_state must have B = {B} slots, got "
                         f"{conv_state.shape[0]}")
    _check_index(state_indices, B, "state_indices", what)
    _check_device(what, x, weight, conv_state, state_indices)

    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0 or C == 0:
        return y
    block_c = min(block_c, max(16, triton.next_power_of_2(C)))
    idx = state_indices if state_indices is not None else y  # placeholder pointer when unused
    _conv1d_update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, y, conv_state, idx, C, x.stride(0), weight.stride(0), weight.stride(1), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), W=W, HAS_IDX=state_indices is not None,
        SILU=activation == "silu", BLOCK_C=block_c, PDL=pdl(x.device),
        launch_pdl=pdl(x.device), num_warps=num_warps)
    return y
