"""Triton kernels of the sparse MoE block (softmax top-k router, SwiGLU experts, weighted sum, gated shared
expert) over stacked MLX-affine experts: gate_up [E, 2I, H] (gate rows first), down [E, H, I].

Everything stays on the device (no host synchronisation, so a decode step can be captured in a CUDA graph):
- `route` (`route.py`): logits [T, E] -> softmax (fp32) -> top-k by iterated argmax -> optional renormalisation.
- `moe_decode` (a few tokens): the T*k (token, expert) slots are rows of ONE indexed GEMV per projection
  (`qmatmul.triton.gemv_launch` with expert ids read on the device; a shared expert's slots too, ids past the
  stack read where they lie: `shared_slots`); the down GEMV takes h = silu(g) * u from the gate_up GEMV's partial
  sums itself (RAW_X with SWIGLU), or, where it cannot (`qmm.raw_x_supported`),
  `swiglu_prep` (`prep_x` in its SwiGLU mode) prepares h in a launch between them.
- `moe_prefill` (many tokens): slots sorted by expert, a table of BLOCK_M-row tiles (expert, first row) built on
  the device, ONE grouped tensor-core GEMM launch per projection (each tile's weights made in registers once for
  all its rows: `gemm.group_weights`), SwiGLU fused into the gate_up epilogue (`grouped.py`).
- `combine`: out[t] = sum_j w[t, j] * y[t*k + j] (+ sigmoid(gate[t]) * shared[t]); a gather, no atomics, so the
  result is deterministic. `expert_sum` is that sum as a device function: with `summed=False` the MoE launches stop
  before it and return `ExpertOutputs`, which the next kernel (the decoder's residual add + RMSNorm,
  `norm.triton.add_rms_norm`) sums itself: one launch fewer, the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.kernels import launch
from sluice.kernels.moe import ExpertOutputs, check_device, check_shared, grouped, mma
from sluice.kernels.moe.route import MAX_EXPERTS, MAX_TOP_K, route  # noqa: F401  (the block's kernels: `route` too)
from sluice.kernels.qmatmul import triton as qmm
from sluice.quant.affine import QuantizedTensor

DECODE_MAX_TOKENS = 128  # up to this many tokens (decode batches) the indexed GEMVs, one expert read per slot;
# beyond, the grouped GEMMs (docs/perf-log.md, 2026-11-25 "engine")
GROUPED_MIN_ROWS = 2  # a decode batch whose experts average this many rows takes the grouped GEMMs (each expert
# read once for all its rows) instead of the GEMVs (one read per slot): Moonlight's 64 experts from batch 22,
# Qwen3-Next's 512 from 103 (docs/perf-log.md, session 8: the two paths at 1.25 and 2.5 rows an expert)
MMA_MIN_ROWS = 0.7  # experts averaging this many rows up to MMA_MAX_ROWS run through the CUDA tensor-core kernel
MMA_MAX_ROWS = 24  # (`mma.py`: each hit expert read once for its rows) where it applies; fewer rows the expert
# GEMVs, more the Triton grouped GEMMs (docs/perf-log.md, session 9: Qwen3-Next's GEMVs are faster at 0.625 rows,
# Moonlight's kernel at 0.75; Moonlight's kernel at 24 rows, Triton's at 48)
ORDER_MIN_TOKENS = 32  # from this many tokens the expert GEMVs run in expert order (`slot_order`); below, few
# slots share an expert and the sort costs what it saves (docs/perf-log.md, 2026-11-25 "engine, second session")


def gemv_decode(T: int, k: int, E: int) -> bool:
    """Whether T tokens routed to k of E experts each run as the indexed expert GEMVs (`moe_decode`) rather than
    the grouped GEMMs (`moe_prefill`)."""
    return T <= DECODE_MAX_TOKENS and T * k < GROUPED_MIN_ROWS * E


def mma_rows(rows: float) -> bool:
    """Whether experts averaging `rows` rows (tokens x routed slots / routed experts) are the CUDA kernel's."""
    return MMA_MIN_ROWS <= rows <= MMA_MAX_ROWS


def slot_decode(x: torch.Tensor, k: int, E: int, gate_up, down, extras=None) -> bool:
    """Whether a batch x of tokens routed to k of E experts runs through `moe_decode` (a shared expert as more
    slots of the same launches): the expert GEMVs' sizes (`gemv_decode`), and every decode batch (up to
    DECODE_MAX_TOKENS) that the CUDA kernel takes."""
    T = x.shape[0]
    return gemv_decode(T, k, E) or (T <= DECODE_MAX_TOKENS and mma_rows(T * k / E)
                                    and mma.applies(x, gate_up, down, extras))


# ---------------------------------------------------------------------------------------------------- decode


def swiglu_prep(y: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """gate_up GEMV partials y fp32 [S, rows, 2I] -> exactly `qmm.prep_x(silu(g) * u, bits, group_size)` with
    g, u = y.sum(0).chunk(2, -1): the down projection's prepared activations, without materialising h."""
    if y.dim() != 3 or y.dtype != torch.float32 or y.shape[2] % 2 or y.stride(2) != 1:
        raise ValueError(f"moe swiglu_prep: y must be fp32 [S, rows, 2I] with unit column stride, got {y.dtype} "
                         f"{tuple(y.shape)}")
    I = y.shape[2] // 2
    if bits not in qmm.SUPPORTED_BITS or group_size not in qmm.SUPPORTED_GROUPS or I % group_size:
        raise ValueError(f"moe swiglu_prep: unsupported bits {bits} / group size {group_size} for I = {I}")
    return qmm.prep_x(y, bits, group_size, swiglu=True)


def expert_block_n(N: int, K: int, bits: int, rows: int, swiglu: bool = False) -> int:
    """Rows per program of an expert GEMV ([N, K] per expert, `rows` slots): 8, or 16 when a row is one short step
    (<= 64 packed words) or the GEMV makes its x from the gate_up partials itself (`swiglu`: each program computes
    silu(gate) * up over its K range, shared by its rows). From the H100 sweep at the decode shapes (11 slots;
    docs/perf-log.md 2026-11-25, "GEMV and MoE decode", before the down GEMV took SWIGLU): 8 rows were fastest for
    every Qwen3.5 and Qwen3-Next expert GEMV but Qwen3-Next's down (64 words a row), where 16 were; with SWIGLU,
    16 rows made Moonlight's down faster at batch 1 on an H200 (docs/perf-log.md, session 8). The grid-filling
    rule of dense GEMVs (`qmm.gemv_block_n`, which takes N and rows) picked other sizes there and made the layer
    slower."""
    return 16 if swiglu or K * bits // 32 <= 64 else 8


@dataclass(frozen=True, eq=False)
class ExtraExperts:
    """n experts of one projection stored apart from the stacked ones, which an expert GEMV reads for ids E..E+n-1
    (`shared_slots`): extra expert i is the [N, K] block of the 2-D `qt` that starts i * `words` packed words
    (i * `groups` scales and biases) after qt's first, its rows qt's row strides apart."""
    qt: QuantizedTensor
    n: int
    words: int
    groups: int

    def launch_args(self) -> tuple:
        """`qmm.gemv_launch`'s `extra`."""
        qt = self.qt
        return (qt.weight.view(torch.int32), qt.scales, qt.biases, self.words, self.groups, qt.weight.stride(0),
                qt.scales.stride(0))


def _expert_gemv(xp: torch.Tensor, qt: QuantizedTensor, ids: torch.Tensor, x_div: int,
                 extra: ExtraExperts | None = None, block_n: int | None = None, num_warps: int = 1,
                 swiglu: bool = False, order: torch.Tensor | None = None) -> torch.Tensor:
    """Partials [splits, rows, N] fp32 of row r = xp[r // x_div] @ W[ids[r]]^T: one indexed GEMV launch, right
    after the launch that prepared xp (so the ids are ready before it: the GEMV may prefetch). Ids E + i (past
    the stacked experts) stand for `extra`'s expert i. swiglu: xp is the gate_up
    GEMV's partials [S, rows, 2N'] and the GEMV takes x = silu(gate) * up from them itself (`qmm.raw_x_supported`),
    the launch right after that GEMV's. order: the rows sorted by expert (`slot_order`)."""
    rows = ids.numel()
    N, K = qt.out_features, qt.in_features
    block_n = block_n or expert_block_n(N, K, qt.bits, rows, swiglu)
    # K is split only when the rows and N-blocks alone leave multiprocessors idle
    split_k = qmm.gemv_split_k(N, K, qt.bits, rows, block_n, num_warps, device=xp.device)
    used = qmm.gemv_used_splits(K, qt.bits, split_k, num_warps)[0]
    out = torch.empty((used, rows, N), dtype=torch.float32, device=xp.device)
    qmm.gemv_launch(xp, qt.weight.view(torch.int32), qt.scales, qt.biases, out, ids, rows, N, K, qt.bits,
                   qt.group_size, split_k, x_div=x_div, block_n=block_n, num_warps=num_warps, ids_ready=True,
                   extra=None if extra is None else extra.launch_args(), raw_x=swiglu, swiglu=swiglu, order=order)
    return out


@triton.jit
def _slot_order_kernel(ids_ptr, order_ptr, n, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """order[rank of slot s] = s for this program's BLOCK slots, the rank of s counting the slots of a lower
    (expert id, slot) key: every program compares its slots with all n, CHUNK at a time (a stable counting sort,
    no atomics)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    mine = tl.load(ids_ptr + offs, mask=ok, other=0) * n + offs
    rank = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, n, CHUNK):
        offs_all = j0 + tl.arange(0, CHUNK)
        ok_all = offs_all < n
        every = tl.where(ok_all, tl.load(ids_ptr + offs_all, mask=ok_all, other=0) * n + offs_all, 0x7FFFFFFF)
        rank += tl.sum((every[None, :] < mine[:, None]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, offs, mask=ok)


def slot_order(ids: torch.Tensor) -> torch.Tensor:
    """The slots (flat indices of ids, int32 [n]) sorted by expert, stably: launched in this order, the GEMV
    programs that read one expert run side by side, and a batch reads each expert it hits about once from memory
    instead of once per slot. One launch."""
    flat = ids.contiguous().view(-1)
    n = flat.numel()
    if n * (MAX_EXPERTS + 1) >= 1 << 31:
        raise ValueError(f"moe slot_order: {n} slots are too many for int32 keys")
    order = torch.empty(n, dtype=torch.int32, device=ids.device)
    _slot_order_kernel[(triton.cdiv(n, 32),)](flat, order, n, BLOCK=32, CHUNK=min(1024, triton.next_power_of_2(n)),
                                             num_warps=4)
    return order


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantizedTensor,
               down: QuantizedTensor, shared_out: torch.Tensor | None = None,
               shared_gate_logit: torch.Tensor | None = None,
               shared_expert: tuple[ExtraExperts, ExtraExperts] | None = None,
               summed: bool = True, expert_order: bool | None = None, block_n: int | None = None,
               num_warps: int | None = None, experts: int | None = None) -> torch.Tensor | ExpertOutputs:
    """MoE output [T, H] in x's dtype for a decode batch: four launches whatever k is (three and `ExpertOutputs`
    when not `summed`; one more where the down GEMV cannot prepare its x itself; one more with `expert_order`,
    by default from ORDER_MIN_TOKENS tokens: the GEMV programs launched in expert order, the same bits). With
    `shared_expert` (`shared_slots`: gate_up's and down's `ExtraExperts`, a shared expert stored like a routed
    one, or the n slots of a shared MLP n times as wide) ids E..E+n-1 are the shared expert's n slots, run as more
    slots of the same launches: the ids and weights from `route(..., shared_gate_logit)` (one slot, gated) or the
    router's with n slots of weight 1 appended (DeepSeek's shared experts).
    block_n, num_warps: the expert GEMVs' rows and warps per program (default `expert_block_n`, one warp).
    Experts averaging `mma_rows` rows (of `experts`, the routed experts the tokens chose among; default the stack's
    size) run through the CUDA tensor-core kernel instead, where it applies (`mma.applies`)."""
    extras = _check_moe(x, ids, weights, gate_up, down, shared_out, shared_gate_logit, shared_expert)
    routed = ids.shape[1] - (0 if extras is None else extras[0].n)
    rows = x.shape[0] * routed / (experts or gate_up.weight.shape[0])
    gemv_options = block_n is not None or num_warps is not None or expert_order is not None  # (asked for the GEMVs)
    if not gemv_options and mma_rows(rows) and mma.applies(x, gate_up, down, extras):
        return _moe_mma(x, ids, weights, gate_up, down, extras, shared_out, shared_gate_logit, summed, rows)
    ids = ids.contiguous().view(-1)
    gu_extra, down_extra = extras if extras is not None else (None, None)
    if expert_order is None:
        expert_order = x.shape[0] >= ORDER_MIN_TOKENS
    order = slot_order(ids) if expert_order else None
    xp = qmm.prep_x(x.contiguous(), gate_up.bits, gate_up.group_size)
    launch = {"block_n": block_n, "num_warps": num_warps or 1, "order": order}
    y_gu = _expert_gemv(xp, gate_up, ids, x_div=weights.shape[1], extra=gu_extra, **launch)
    if qmm.raw_x_supported(down.bits, down.group_size):  # the down GEMV takes h = silu(g) * u from y_gu itself
        y = _expert_gemv(y_gu, down, ids, x_div=1, extra=down_extra, swiglu=True, **launch)
    else:
        y = _expert_gemv(swiglu_prep(y_gu, down.bits, down.group_size), down, ids, x_div=1, extra=down_extra,
                         **launch)
    return _outputs(y, weights, x.dtype, shared_out, shared_gate_logit, summed)


# ---------------------------------------------------------------------------------------------------- prefill


ORDER_SORT_SLOTS = 8192  # up to this many slots `slot_order` sorts them (all pairs compared), beyond torch.sort


def expert_order(ids: torch.Tensor) -> torch.Tensor:
    """The slots of ids sorted by expert, stably (`slot_order`, or torch's sort for many slots)."""
    flat = ids.reshape(-1)
    return slot_order(flat) if flat.numel() <= ORDER_SORT_SLOTS else torch.sort(flat, stable=True).indices


def moe_prefill(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantizedTensor,
                down: QuantizedTensor, shared_out: torch.Tensor | None = None,
                shared_gate_logit: torch.Tensor | None = None, summed: bool = True, block_m: int | None = None,
                gate_up_config: grouped.GemmConfig | None = None,
                down_config: grouped.GemmConfig | None = None, live: int | None = None,
                experts: int | None = None) -> torch.Tensor | ExpertOutputs:
    """MoE output [T, H] in x's dtype for many tokens (`ExpertOutputs` when not `summed`): grouped tensor-core
    GEMMs over the slots sorted by expert; h and the expert outputs are held in x's dtype, in slot order. block_m
    (rows per tile) and the two GEMMs' configs default to `grouped.prefill_configs`. live: only experts 0..live-1
    are computed, the slots of the others (expert parallel's zero expert, `SparseMoE.hold`) output zeros."""
    _check_moe(x, ids, weights, gate_up, down, shared_out, shared_gate_logit)
    x = x.contiguous()
    T, k = ids.shape
    E = gate_up.weight.shape[0] if live is None else live
    rows = T * k / (experts or E)
    configured = block_m is not None or gate_up_config is not None or down_config is not None
    if not configured and mma_rows(rows) and mma.applies(x, gate_up, down):
        return _moe_mma(x, ids, weights, gate_up, down, None, shared_out, shared_gate_logit, summed, rows, live)
    auto_m, auto_gu, auto_down = grouped.prefill_configs(T * k / E)
    block_m = block_m or auto_m
    table = grouped.tile_table(ids, expert_order(ids), E, block_m)  # (no tiles for ids >= E)
    h = torch.empty((T * k, down.in_features), dtype=x.dtype, device=x.device)
    grouped.grouped_gemm(x, k, gate_up, h, table, True, block_m, gate_up_config or auto_gu)
    new = torch.empty if live is None else torch.zeros  # (slots without tiles are never written)
    y = new((1, T * k, down.out_features), dtype=x.dtype, device=x.device)
    grouped.grouped_gemm(h, 1, down, y[0], table, False, block_m, down_config or auto_down)
    return _outputs(y, weights, x.dtype, shared_out, shared_gate_logit, summed)


def _moe_mma(x, ids, weights, gate_up, down, extras, shared_out, shared_gate_logit, summed, rows, live=None):
    """`moe_prefill`'s launches with the tensor-core kernel (`mma.grouped_gemm`) for the two GEMMs: tiles of
    `mma.tile_rows` rows for experts averaging `rows` rows, a shared expert's slots (extras, ids E..) tiles like the
    stacked experts'. (Under expert parallelism a decode batch's slots routed elsewhere run the rank's zero
    expert: tiles of zeros, correct and wasted.)"""
    T, k = ids.shape
    n_extra = 0 if extras is None else extras[0].n
    E = gate_up.weight.shape[0] if live is None else live
    tm = mma.tile_rows(rows)
    x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()
    order = expert_order(ids).to(torch.int32)  # (torch's sort, past ORDER_SORT_SLOTS slots, gives int64)
    table = grouped.tile_table(ids, order, E + n_extra, tm)  # (no tiles for the zero expert, `live`)
    gu_extra, down_extra = extras if extras is not None else (None, None)
    h = torch.empty((T * k, down.in_features), dtype=x.dtype, device=x.device)
    mma.grouped_gemm(x, k, gate_up, h, table, True, tm, gu_extra)
    new = torch.empty if live is None else torch.zeros  # (slots without tiles are never written)
    y = new((1, T * k, down.out_features), dtype=x.dtype, device=x.device)
    mma.grouped_gemm(h, 1, down, y[0], table, False, tm, down_extra)
    return _outputs(y, weights, x.dtype, shared_out, shared_gate_logit, summed)


# ---------------------------------------------------------------------------------------------------- combine


def _outputs(y, weights, dtype, shared_out, shared_gate_logit, summed):
    out = ExpertOutputs(y, weights.contiguous(), dtype, shared_out, shared_gate_logit)  # checked there
    return out.combine() if summed else out


@triton.jit
def expert_sum(y_ptr, w_ptr, shared_ptr, gate_ptr, rows, r_ok, offs, c_ok, S, stride_ys, stride_ym, stride_sh,
               stride_g, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr):
    """fp32 [rows, columns] of the MoE output of tokens `rows` (those r_ok) at columns `offs` (those c_ok):
    sum_j w[r, j] * sum_s y[s, r*TOP_K + j] (+ sigmoid(gate[r]) * shared[r]), summed in this order whatever the
    caller's tile, so that every kernel calling it gives the same bits. The TOP_K loads are independent: they are
    issued together (one memory round trip)."""
    mask = r_ok[:, None] & c_ok[None, :]
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = (rows * TOP_K + j).to(tl.int64)
        ptrs = y_ptr + slot[:, None] * stride_ym + offs[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, S):
            y += tl.load(ptrs + s * stride_ys, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + rows * TOP_K + j, mask=r_ok, other=0.0)[:, None] * y
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(gate_ptr + rows * stride_g, mask=r_ok, other=0.0).to(tl.float32))
        acc += gate[:, None] * tl.load(shared_ptr + rows.to(tl.int64)[:, None] * stride_sh + offs[None, :], mask=mask,
                                       other=0.0).to(tl.float32)
    return acc


@triton.jit
def _combine_kernel(y_ptr, w_ptr, shared_ptr, gate_ptr, out_ptr, T, H, S, stride_ys, stride_ym, stride_sh, stride_g,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program (token, column block)."""
    launch.pdl_start(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok, c_ok = rows < T, offs < H
    acc = expert_sum(y_ptr, w_ptr, shared_ptr, gate_ptr, rows, r_ok, offs, c_ok, S, stride_ys, stride_ym, stride_sh,
                     stride_g, TOP_K, HAS_SHARED)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + offs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, shared_out: torch.Tensor | None = None,
            shared_gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] (dtype) = sum_j weights[t, j] * y[:, t*k + j].sum(0) (+ sigmoid(gate[t]) * shared_out[t]).
    y [S, T*k, H]: the S split-K partials (or S = 1) of the expert outputs, slot t*k + j = token t's j-th expert."""
    parts = _outputs(y, weights, dtype, shared_out, shared_gate_logit, summed=False)
    T, H = weights.shape[0], y.shape[2]
    out = torch.empty((T, H), dtype=dtype, device=y.device)
    block_h = min(256, triton.next_power_of_2(H))
    y, w, shared, gate, S, *strides, k, has_shared = parts.args()
    _combine_kernel[(T, triton.cdiv(H, block_h))](
        y, w, shared, gate, out, T, H, S, *strides, TOP_K=k, HAS_SHARED=has_shared, BLOCK_H=block_h,
        PDL=launch.pdl(y.device), launch_pdl=launch.pdl(y.device), num_warps=4)
    return out


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantizedTensor, down: QuantizedTensor,
        shared_out: torch.Tensor | None = None, shared_gate_logit: torch.Tensor | None = None,
        summed: bool = True, live: int | None = None, experts: int | None = None) -> torch.Tensor | ExpertOutputs:
    """The MoE output [T, H] in x's dtype: x [T, H] (bf16/fp16/fp32), ids int32 [T, k] in [0, E) and weights
    fp32 [T, k] (from `route`; the ids are not checked, that would take a sync), stacked quantized experts; the
    shared expert's output [T, H] and gate logit [T] (or [T, 1]) when there is one. experts: the routed experts
    the tokens chose among (`gemv_decode`'s E: the stack may be an expert cache's slots or a rank's share; default
    the stack's size)."""
    if gemv_decode(x.shape[0], ids.shape[1], experts or gate_up.weight.shape[0]):
        return moe_decode(x, ids, weights, gate_up, down, shared_out, shared_gate_logit, summed=summed,
                          experts=experts)
    return moe_prefill(x, ids, weights, gate_up, down, shared_out, shared_gate_logit, summed=summed, live=live,
                       experts=experts)


# ---------------------------------------------------------------------------------------------------- checks


def supports(gate_up, down, top_k: int) -> bool:
    """Whether these kernels run a block with these stacked expert weights and this top-k."""
    quantized = all(isinstance(qt, QuantizedTensor) and qt.weight.dim() == 3 and qt.bits in qmm.SUPPORTED_BITS
                    and qt.group_size in qmm.SUPPORTED_GROUPS for qt in (gate_up, down))
    return quantized and gate_up.weight.shape[0] <= MAX_EXPERTS and top_k <= min(MAX_TOP_K, gate_up.weight.shape[0])


def shared_slots(gate_up: QuantizedTensor, down: QuantizedTensor, shared_gate_up, shared_down,
                 n: int = 1) -> tuple[ExtraExperts, ExtraExperts] | None:
    """A shared MLP of intermediate n*I as n slots shaped like the stacked routed experts (gate_up [E, 2I, H], down
    [E, H, I]), which the expert GEMVs read as ids E..E+n-1 where they lie, no copy: its gate_up [2nI, H] with rows
    in slot order [g0 | u0 | g1 | u1 | ...] (I rows each; n = 1: [gate | up], `layers.moe.swiglu` with `slots`),
    slot i gate_up rows 2iI..2(i+1)I-1 and down [H, nI] columns iI..(i+1)I-1. (gate_up's, down's) `ExtraExperts`,
    or None where the GEMVs cannot read them so: quantized unlike the routed experts (bits, group size, scales
    dtype), other shapes, I not whole groups, columns not contiguous, scales and biases strided unlike."""
    if n < 1 or not all(isinstance(qt, QuantizedTensor) for qt in (gate_up, down, shared_gate_up, shared_down)):
        return None
    if gate_up.weight.dim() != 3 or down.weight.dim() != 3 or gate_up.shape[1] % 2:
        return None
    I, H = gate_up.shape[1] // 2, gate_up.shape[2]
    if tuple(shared_gate_up.shape) != (2 * n * I, H) or tuple(shared_down.shape) != (down.shape[1], n * I):
        return None
    for qt, stacked in ((shared_gate_up, gate_up), (shared_down, down)):
        groups = (qt.weight.shape[0], qt.in_features // qt.group_size)
        if ((qt.bits, qt.group_size, qt.scales.dtype) != (stacked.bits, stacked.group_size, stacked.scales.dtype)
                or qt.weight.dim() != 2 or tuple(qt.scales.shape) != groups or qt.biases.shape != qt.scales.shape
                or qt.weight.stride(1) != 1 or qt.scales.stride(1) != 1 or qt.scales.stride() != qt.biases.stride()
                or qt.in_features % qt.group_size):
            return None
    if I % down.group_size:
        return None
    gu, dn = shared_gate_up, shared_down
    return (ExtraExperts(gu, n, 2 * I * gu.weight.stride(0), 2 * I * gu.scales.stride(0)),
            ExtraExperts(dn, n, I * dn.bits // 32, I // dn.group_size))


def _check_moe(x, ids, weights, gate_up, down, shared_out, shared_gate_logit, shared_expert=None):
    """Clear errors before any launch (the kernels would read out of bounds instead). The shared expert's
    (gate_up, down) `ExtraExperts` (`moe_decode`'s shared_expert checked against these stacks), or None."""
    for name, qt in (("gate_up", gate_up), ("down", down)):
        if not isinstance(qt, QuantizedTensor) or qt.weight.dim() != 3:
            raise ValueError(f"moe: {name} must be a stacked QuantizedTensor [E, N, K*bits/32]")
        if qt.bits not in qmm.SUPPORTED_BITS or qt.group_size not in qmm.SUPPORTED_GROUPS:
            raise ValueError(f"moe: {name} is {qt.bits}-bit with group size {qt.group_size}; supported: bits "
                             f"{qmm.SUPPORTED_BITS}, group sizes {qmm.SUPPORTED_GROUPS}")
        groups = (*qt.weight.shape[:2], qt.in_features // qt.group_size)
        if tuple(qt.scales.shape) != groups or qt.scales.stride() != qt.biases.stride():
            raise ValueError(f"moe: {name} scales and biases must both be {groups} with the same strides")
        if qt.weight.stride(-1) != 1 or qt.scales.stride(-1) != 1:
            raise ValueError(f"moe: {name} rows must be contiguous")
    E, I2, H = gate_up.shape
    if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
        raise ValueError(f"moe: down must be [E, H, I] = {(E, H, I2 // 2)} for gate_up {tuple(gate_up.shape)}, "
                         f"got {tuple(down.shape)}")
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"moe: x must be [T, {H}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe: x must be bf16, fp16 or fp32, got {x.dtype}")
    extras = None
    if shared_expert is not None:
        if shared_out is not None:
            raise ValueError("moe: the shared expert comes either as an expert slot or as shared_out, not both")
        if not all(isinstance(e, ExtraExperts) for e in shared_expert) or shared_expert[0].n != shared_expert[1].n:
            raise ValueError("moe: shared_expert must be the (gate_up, down) `ExtraExperts` of `shared_slots`")
        n = shared_expert[0].n
        extras = shared_slots(gate_up, down, shared_expert[0].qt, shared_expert[1].qt, n)  # (checked against these)
        if extras is None:
            raise ValueError(f"moe: the shared expert's gate_up and down must be stored like one routed expert "
                             f"({tuple(gate_up.shape[1:])}, {tuple(down.shape[1:])}, {gate_up.bits}-bit, group "
                             f"{gate_up.group_size}), or a shared MLP n times as wide as n such slots "
                             f"(`shared_slots`; n = {n})")
    slots = MAX_TOP_K + (0 if extras is None else extras[0].n)
    if ids.dtype != torch.int32 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or not 1 <= ids.shape[1] <= slots:
        raise ValueError(f"moe: ids must be int32 [{x.shape[0]}, k <= {slots}], got {ids.dtype} {tuple(ids.shape)}")
    if weights.dtype != torch.float32 or weights.shape != ids.shape:
        raise ValueError(f"moe: weights must be fp32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    check_shared(x.shape[0], H, shared_out, shared_gate_logit)
    if shared_out is not None:
        check_device(shared_out, shared_gate_logit)
    check_device(x, ids, weights, gate_up.weight, gate_up.scales, gate_up.biases, down.weight, down.scales,
                  down.biases, *(t for e in extras or () for t in (e.qt.weight, e.qt.scales, e.qt.biases)))
    return extras
