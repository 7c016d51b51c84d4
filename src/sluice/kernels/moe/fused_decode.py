"""The sparse MoE block for ONE token in ONE launch: router GEMV, softmax top-k, the experts' gate_up GEMVs with
SwiGLU, their down GEMVs and the weighted combine (shared expert included as one more slot).

Why one launch: decode of this block is a chain of small dependent steps (the experts are known only once the
router has run). As separate launches each step costs a few µs under graph replay, more than the whole memory
floor of Qwen3-Next's layer (~5-7 µs); here the launch boundaries become counters in device memory.

Programs: one or two per multiprocessor (PER_SM). They wait for each other, so all must be resident at once: two
programs of at most 4 warps fit one multiprocessor whatever their register count (2 x 128 threads x 255 registers
< 64K), and nothing else can hold a multiprocessor forever (a PDL-launched successor starts only once every
program of this launch runs). In order:
  1. Before the PDL wait for the previous kernel: weights that depend on nothing (router rows, a share of the
     shared expert) are asked of L2.
  2. The first programs compute the router rows (RBN each: E logits, then the shared expert's gate logit) and
     bump a counter; every program prepares x for the integer GEMV (`qmatmul.triton._prep_groups`).
  3. Items of about ITEM_WORDS packed words, handed out by a ticket counter: the gate_up row blocks of the slots
     (shared expert first: it needs no routing), then their down row blocks. A static deal measured programs
     finishing up to a third of the layer apart (uneven speeds, not uneven work); tickets even that out. Each
     program takes its next ticket and asks L2 for that item's weights before computing the current one.
     A program computes softmax + top-k itself when it first meets a routed slot (after waiting for the router
     counter: the logits are 2 KB in L2, cheaper than waiting for one program's answer). gate_up items write
     h = silu(g) * u (fp32); before its first down item a program says it is past its gate_up items and waits
     until every program is, then prepares h of the item's slot (on a change of slot) while the item's weights
     are in flight; down items write y[slot] rows.
  4. Every program says it is past its down items; the first H/DBN programs each sum one n-block's slot rows
     in slot order (deterministic, no float atomics) into the output.
The last program out returns every counter to zero by subtracting what this launch added (commutative with
increments still in flight), so the next launch finds zeros. Under the interpreter (programs run one after
another) the grid is one program, which meets every wait itself.

The workspace (counters, logits, h, y, scratch rows) is shared by every layer of a device: launches on one
stream run one after another, and each returns the counters to zero. Do not run two on different streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import launch
from sluice.kernels.moe import triton as mt
from sluice.kernels.qmatmul import triton as tq
from sluice.quant.affine import QuantizedTensor

ITEM_WORDS = 8192  # packed words per item (gate and up tiles together): sets the row blocks GBN and DBN
NUM_WARPS = 4
PER_SM = 2  # programs per multiprocessor
ROUTER_ROWS = 4  # router rows per item
# SparseMoE takes this path for one token only when ENABLED. Off: on an H100 it measured 22.7 / 51.3 us per layer
# (Qwen3-Next / Qwen3.5 shapes, best launch options) against 22.2 / 47.3 us for the multi-launch `moe_decode`
# (docs/PERF.md, 2026-11-24 (MoE)). Turn it on when it wins.
ENABLED = False

@triton.jit
def _wait_at_least(ptr, target):
    """Spin until the counter at ptr reaches target (acquire: what its producers wrote before bumping it is
    visible afterwards)."""
    n = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while n < target:
        n = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _bump(ptr):
    """Counter += 1 after every thread of the program has written its results (barrier, then release)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _item(t, TOP_K: tl.constexpr, SHARED: tl.constexpr, IPS: tl.constexpr, NB: tl.constexpr):
    """Ticket t -> (down item?, slot, row block): first the gate_up items of the slots in the order [shared,
    0, ..., TOP_K - 1] (IPS row blocks each), then their down items in the same order (NB n-blocks each)."""
    SLOTS: tl.constexpr = TOP_K + SHARED
    down = t >= SLOTS * IPS
    i = tl.maximum(t - SLOTS * IPS, 0)  # divisions by constants (powers of two): shifts, not a division routine
    o = tl.where(down, i // NB, t // IPS)
    return down, tl.where(o < SHARED, TOP_K, o - SHARED), tl.where(down, i % NB, t % IPS)


@triton.jit
def _prefetch_rows(w_ptr, s_ptr, b_ptr, rows, stride_wn, stride_sn, K: tl.constexpr, BITS: tl.constexpr,
                   GS: tl.constexpr, PREFETCH: tl.constexpr):
    """Ask L2 for rows' packed words (one address per 128-byte line), scales and biases."""
    if PREFETCH:
        KW: tl.constexpr = K // (32 // BITS)
        LINES: tl.constexpr = (KW + 31) // 32
        rows = rows.to(tl.int64)
        launch.prefetch_l2(w_ptr + rows[:, None] * stride_wn + tl.arange(0, LINES)[None, :] * 32, True)
        launch.prefetch_l2(s_ptr + rows * stride_sn, True)
        launch.prefetch_l2(b_ptr + rows * stride_sn, True)


@triton.jit
def _expert(e, E, w_ptr, s_ptr, b_ptr, xw_ptr, xs_ptr, xb_ptr, stride_we, stride_se):
    """Base pointers of expert e of a stacked projection; id E is the shared expert, stored apart."""
    e = e.to(tl.int64)
    w, s, b = w_ptr + e * stride_we, s_ptr + e * stride_se, b_ptr + e * stride_se
    if e == E:
        w, s, b = xw_ptr, xs_ptr, xb_ptr
    return w, s, b


@triton.jit
def _dense_rows_dot(x_ptr, w_ptr, rows, stride_wn, K: tl.constexpr):
    """[len(rows)] fp32 = W[rows] . x for a dense (float) W."""
    offs = tl.arange(0, K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs[None, :]).to(tl.float32)
    return tl.sum(w * tl.load(x_ptr + offs).to(tl.float32)[None, :], axis=1)


@triton.jit
def _item_rows(down, slot, blk, ids_row, E, gw_ptr, gs_ptr, gb_ptr, dw_ptr, ds_ptr, db_ptr,
               sgw_ptr, sgs_ptr, sgb_ptr, sdw_ptr, sds_ptr, sdb_ptr, stride_ge, stride_gse, stride_de, stride_dse,
               GBN: tl.constexpr, DBN: tl.constexpr):
    """Base pointers and first row of an item: its slot's expert (ids_row[slot], this program's copy of the
    routing; id E the shared expert) in the gate_up or the down projection."""
    e = tl.load(ids_row + slot)
    if down:
        w, s, b = _expert(e, E, dw_ptr, ds_ptr, db_ptr, sdw_ptr, sds_ptr, sdb_ptr, stride_de, stride_dse)
        r0 = blk * DBN
    else:
        w, s, b = _expert(e, E, gw_ptr, gs_ptr, gb_ptr, sgw_ptr, sgs_ptr, sgb_ptr, stride_ge, stride_gse)
        r0 = blk * GBN
    return w, s, b, r0


@triton.jit
def _route(routed, top_w, ids_row, offs_k, logit_ptr, cnt_ptr, n_router_programs, E, ts_ptr, TOP_K: tl.constexpr,
           BLOCK_E: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, TIMELINE: tl.constexpr):
    """Once per program, when it first needs them: wait for the router rows, then softmax + top-k (every program
    computes them itself: the logits are 2 KB in L2, cheaper than waiting for one program's answer) and the
    shared expert's weight sigmoid(gate logit) in slot TOP_K. The expert ids go to the program's ids row (read
    back one scalar at a time: picking from a register vector is a block-wide reduction); its slot TOP_K holds
    the shared expert's id E from the start."""
    if routed == 0:
        _wait_at_least(cnt_ptr, n_router_programs)
        offs_e = tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        logit = tl.load(logit_ptr + offs_e, mask=e_ok, other=-float("inf"), cache_modifier=".cg")
        w, i = mt._softmax_topk(logit, offs_e, e_ok, TOP_K, offs_k.shape[0], BLOCK_E, NORM, False)
        routed_slot = offs_k < TOP_K
        tl.store(ids_row + offs_k, i, mask=routed_slot)
        top_w = tl.where(routed_slot, w, top_w)
        if SHARED:
            gate = tl.load(logit_ptr + E + offs_k * 0, cache_modifier=".cg")
            top_w = tl.where(offs_k == TOP_K, tl.sigmoid(gate), top_w)
        routed = 1
        tl.debug_barrier()  # the ids stored by every thread
        _stamp(ts_ptr, 4, TIMELINE)
    return routed, top_w


@triton.jit
def _prep_h(h_ptr, hp_row, slot, I: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr):
    """h[slot] (written by other programs) prepared for the down GEMV into this program's scratch row."""
    tl.debug_barrier()  # every thread is done reading the previous contents
    offs = tl.arange(0, I // GS)
    tq._prep_groups(h_ptr + slot * I, hp_row, offs, offs < I // GS, I, 1, 0, BITS, GS, False, True)
    tl.debug_barrier()


@triton.jit
def _stamp(ts_ptr, j: tl.constexpr, TIMELINE: tl.constexpr):
    """Debug timeline (benchmarks only): the global timer (ns) at point j of this program."""
    if TIMELINE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                      is_pure=False, pack=1)
        tl.store(ts_ptr + tl.program_id(0) * 16 + j, t)


# counters (int32, in the workspace): router programs done, programs out, programs past their gate_up items,
# programs past their down items, the next ticket
_ROUTER, _EXIT, _GU_PASSED, _DOWN_PASSED, _TICKET = (tl.constexpr(i) for i in range(5))
_N_COUNTERS = tl.constexpr(8)


@triton.jit
def _fused_decode_kernel(x_ptr, out_ptr, rw_ptr, rs_ptr, rb_ptr, gw_ptr, gs_ptr, gb_ptr, dw_ptr, ds_ptr, db_ptr,
                         sgw_ptr, sgs_ptr, sgb_ptr, sdw_ptr, sds_ptr, sdb_ptr,
                         xp_ptr, hp_ptr, ids_ptr, logit_ptr, h_ptr, y_ptr, cnt_ptr, ts_ptr,
                         stride_rn, stride_rsn, stride_ge, stride_gn, stride_gse, stride_gsn,
                         stride_de, stride_dn, stride_dse, stride_dsn, stride_xp, stride_hp,
                         E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                         BLOCK_E: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
                         RBITS: tl.constexpr, RGS: tl.constexpr, RDENSE: tl.constexpr, R_OWN_X: tl.constexpr,
                         BITS: tl.constexpr, GS: tl.constexpr, RBN: tl.constexpr, GBN: tl.constexpr,
                         DBN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         TIMELINE: tl.constexpr):
    NR: tl.constexpr = E + SHARED  # router rows: E logits (+ the shared expert's gate logit)
    N_ROUTER: tl.constexpr = (NR + RBN - 1) // RBN
    SLOTS: tl.constexpr = TOP_K + SHARED
    IPS: tl.constexpr = I // GBN  # gate_up items per slot
    NB: tl.constexpr = H // DBN  # down items per slot (n-blocks of the output)
    N_ITEMS: tl.constexpr = SLOTS * (IPS + NB)
    G = tl.num_programs(0)
    pid = tl.program_id(0)
    n_router_programs = tl.minimum(G, N_ROUTER)
    _stamp(ts_ptr, 0, TIMELINE)
    offs_k = tl.arange(0, KP)
    xp_row = xp_ptr + pid.to(tl.int64) * stride_xp
    xr_row = xp_row
    if R_OWN_X:  # the router's own x layout
        xr_row = xp_row + H // 2 + 2 * (H // GS)
    hp_row = hp_ptr + pid.to(tl.int64) * stride_hp

    # weights that depend on nothing are asked of L2 before the wait for the previous kernel: this program's
    # router rows, and a 1/G share of the shared expert (whoever takes those items later finds them there)
    if PREFETCH:
        if not RDENSE:
            for r in range(pid, N_ROUTER, G):
                _prefetch_rows(rw_ptr, rs_ptr, rb_ptr, tl.minimum(r * RBN + tl.arange(0, RBN), NR - 1), stride_rn,
                               stride_rsn, H, RBITS, RGS, PREFETCH)
        if SHARED:
            for i in range(pid, IPS, G):
                rows = i * GBN + tl.arange(0, GBN)
                _prefetch_rows(sgw_ptr, sgs_ptr, sgb_ptr, rows, stride_gn, stride_gsn, H, BITS, GS, PREFETCH)
                _prefetch_rows(sgw_ptr, sgs_ptr, sgb_ptr, rows + I, stride_gn, stride_gsn, H, BITS, GS, PREFETCH)
            for i in range(pid, NB, G):
                _prefetch_rows(sdw_ptr, sds_ptr, sdb_ptr, i * DBN + tl.arange(0, DBN), stride_dn, stride_dsn, I, BITS,
                               GS, PREFETCH)
    launch.pdl_start(PDL)
    _stamp(ts_ptr, 1, TIMELINE)

    # the router rows, by the first programs, as early as possible: everything routed waits for them
    if pid < N_ROUTER:
        if not RDENSE:
            offs_rg = tl.arange(0, H // RGS)
            tq._prep_groups(x_ptr, xr_row, offs_rg, offs_rg < H // RGS, H, 1, 0, RBITS, RGS, False, False)
            tl.debug_barrier()
        for r in range(pid, N_ROUTER, G):
            rows = r * RBN + tl.arange(0, RBN)
            rows_c = tl.minimum(rows, NR - 1)
            if RDENSE:
                logit = _dense_rows_dot(x_ptr, rw_ptr, rows_c, stride_rn, H)
            else:
                logit = tq._rows_dot(xr_row, rw_ptr, rs_ptr, rb_ptr, rows_c, stride_rn, stride_rsn, H, RBITS, RGS,
                                     RBN, ASM)
            tl.store(logit_ptr + rows, logit, mask=rows < NR)
        _bump(cnt_ptr + _ROUTER)
    _stamp(ts_ptr, 2, TIMELINE)
    if RDENSE or R_OWN_X or pid >= N_ROUTER:  # x for the experts (the router's prepared x when it is the same)
        offs_g = tl.arange(0, H // GS)
        tq._prep_groups(x_ptr, xp_row, offs_g, offs_g < H // GS, H, 1, 0, BITS, GS, False, False)
        tl.debug_barrier()
    _stamp(ts_ptr, 3, TIMELINE)

    # the items, handed out by a ticket counter (programs run at uneven speeds: a static deal left some idle
    # for up to a third of the time). The next ticket is taken, and its weights asked of L2, before the current
    # item is computed. Down items need every gate_up item done: a program that reaches its first one says it
    # is past its own gate_up items and waits until every program is.
    routed = pid * 0
    top_w = tl.zeros((KP,), dtype=tl.float32)
    ids_row = ids_ptr + pid * KP
    tl.store(ids_row + offs_k, tl.where(offs_k == TOP_K, E, 0))
    tl.debug_barrier()
    gu_open = pid * 0 + 1
    prepared = pid * 0 - 1
    t = tl.atomic_add(cnt_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
    while t < N_ITEMS:
        nxt = tl.atomic_add(cnt_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
        down, slot, blk = _item(t, TOP_K, SHARED, IPS, NB)
        if slot < TOP_K:
            routed, top_w = _route(routed, top_w, ids_row, offs_k, logit_ptr, cnt_ptr, n_router_programs, E,
                                   ts_ptr, TOP_K, BLOCK_E, NORM, SHARED, TIMELINE)
        if PREFETCH:
            if nxt < N_ITEMS:
                n_down, n_slot, n_blk = _item(nxt, TOP_K, SHARED, IPS, NB)
                if n_slot < TOP_K:
                    routed, top_w = _route(routed, top_w, ids_row, offs_k, logit_ptr, cnt_ptr,
                                           n_router_programs, E, ts_ptr, TOP_K, BLOCK_E, NORM, SHARED, TIMELINE)
                w, s, b, r0 = _item_rows(n_down, n_slot, n_blk, ids_row, E, gw_ptr, gs_ptr, gb_ptr, dw_ptr,
                                         ds_ptr, db_ptr, sgw_ptr, sgs_ptr, sgb_ptr, sdw_ptr, sds_ptr, sdb_ptr,
                                         stride_ge, stride_gse, stride_de, stride_dse, GBN, DBN)
                if n_down:
                    _prefetch_rows(w, s, b, r0 + tl.arange(0, DBN), stride_dn, stride_dsn, I, BITS, GS, PREFETCH)
                else:
                    p_rows = r0 + tl.arange(0, GBN)
                    _prefetch_rows(w, s, b, p_rows, stride_gn, stride_gsn, H, BITS, GS, PREFETCH)
                    _prefetch_rows(w, s, b, p_rows + I, stride_gn, stride_gsn, H, BITS, GS, PREFETCH)
        w, s, b, r0 = _item_rows(down, slot, blk, ids_row, E, gw_ptr, gs_ptr, gb_ptr, dw_ptr, ds_ptr, db_ptr,
                                 sgw_ptr, sgs_ptr, sgb_ptr, sdw_ptr, sds_ptr, sdb_ptr, stride_ge, stride_gse,
                                 stride_de, stride_dse, GBN, DBN)
        if down:
            d_rows = r0 + tl.arange(0, DBN)
            words, sc, bi = tq._rows_load(w, s, b, d_rows, stride_dn, stride_dsn, I, BITS, GS)  # in flight meanwhile
            if gu_open:
                _bump(cnt_ptr + _GU_PASSED)
                _wait_at_least(cnt_ptr + _GU_PASSED, G)
                gu_open = 0
                _stamp(ts_ptr, 5, TIMELINE)
            if slot != prepared:
                _prep_h(h_ptr, hp_row, slot, I, BITS, GS)
                prepared = slot
            tl.store(y_ptr + slot * H + d_rows, tq._rows_dot_loaded(hp_row, words, sc, bi, I, BITS, GS, DBN, ASM))
        else:
            g_rows = r0 + tl.arange(0, GBN)
            g = tq._rows_dot(xp_row, w, s, b, g_rows, stride_gn, stride_gsn, H, BITS, GS, GBN, ASM)
            u = tq._rows_dot(xp_row, w, s, b, g_rows + I, stride_gn, stride_gsn, H, BITS, GS, GBN, ASM)
            tl.store(h_ptr + slot * I + g_rows, g / (1.0 + tl.exp(-g)) * u)
        t = nxt
    _stamp(ts_ptr, 6, TIMELINE)
    if gu_open:
        _bump(cnt_ptr + _GU_PASSED)
    _bump(cnt_ptr + _DOWN_PASSED)

    # every y row written: the first NB programs each sum one n-block's slot rows in slot order (deterministic)
    for nb in range(pid, NB, G):
        routed, top_w = _route(routed, top_w, ids_row, offs_k, logit_ptr, cnt_ptr, n_router_programs, E,
                               ts_ptr, TOP_K, BLOCK_E, NORM, SHARED, TIMELINE)
        _wait_at_least(cnt_ptr + _DOWN_PASSED, G)
        _stamp(ts_ptr, 7, TIMELINE)
        c_rows = nb * DBN + tl.arange(0, DBN)
        ys = tl.load(y_ptr + offs_k[:, None] * H + c_rows[None, :], mask=(offs_k < SLOTS)[:, None], other=0.0,
                     cache_modifier=".cg")
        tl.store(out_ptr + c_rows, tl.sum(top_w[:, None] * ys, axis=0).to(out_ptr.dtype.element_ty))

    # the last program out returns the counters to zero, subtracting what this launch added
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + _EXIT, 1, sem="acq_rel", scope="gpu") == G - 1:
        offs_c = tl.arange(0, _N_COUNTERS)
        added = tl.where(offs_c == _ROUTER, n_router_programs, tl.where(offs_c == _TICKET, N_ITEMS + G, G))
        tl.atomic_add(cnt_ptr + offs_c, -added, mask=offs_c <= _TICKET, sem="relaxed", scope="gpu")
    _stamp(ts_ptr, 8, TIMELINE)


# ---------------------------------------------------------------------------------------------------- host side


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(router, gate_up, down, top_k: int, shared_expert) -> bool:
    """Whether one launch runs this block for a token: router a float [E(+1), H] tensor or a QuantizedTensor
    with supported bits / group size; stacked quantized experts with H and I powers of two; the shared expert
    (if any) stored like a routed one, its gate logit the router's last row."""
    if not (isinstance(gate_up, QuantizedTensor) and isinstance(down, QuantizedTensor)):
        return False
    if not mt.supports(gate_up, down, top_k) or (shared_expert is not None and
                                                 not mt.shared_expert_fits(gate_up, down, *shared_expert)):
        return False
    E, I2, H = gate_up.shape
    I = I2 // 2
    if not (_pow2(H) and _pow2(I) and tuple(down.shape) == (E, H, I) and I >= gate_up.group_size):
        return False
    if gate_up.bits != down.bits or gate_up.group_size != down.group_size:
        return False
    rows = E + (shared_expert is not None)
    if isinstance(router, QuantizedTensor):
        return (router.weight.dim() == 2 and tuple(router.shape) == (rows, H) and router.bits in tq.SUPPORTED_BITS
                and router.group_size in tq.SUPPORTED_GROUPS and router.weight.stride(-1) == 1)
    return (isinstance(router, torch.Tensor) and router.is_floating_point() and tuple(router.shape) == (rows, H)
            and router.stride(-1) == 1)


_WORKSPACES: dict = {}


def _workspace(device, G, slots, H, I, gs, router_gs) -> dict:
    """Scratch of the launch, shared by every call with the same sizes on a device (see the module notes)."""
    key = (str(device), G, slots, H, I, gs, router_gs)
    ws = _WORKSPACES.get(key)
    if ws is None:
        xlen = tq.prep_len(H, gs) + (tq.prep_len(H, router_gs) if router_gs else 0)
        pad = (lambda n: -(-n // 16) * 16)  # noqa: E731
        ws = _WORKSPACES[key] = dict(
            xp=torch.empty((G, pad(xlen)), dtype=torch.int32, device=device),
            hp=torch.empty((G, pad(tq.prep_len(I, gs))), dtype=torch.int32, device=device),
            ids=torch.empty((G, triton.next_power_of_2(slots)), dtype=torch.int32, device=device),
            logits=torch.empty(mt.MAX_EXPERTS + 1, dtype=torch.float32, device=device),
            h=torch.empty((slots, I), dtype=torch.float32, device=device),
            y=torch.empty((slots, H), dtype=torch.float32, device=device),
            counters=torch.zeros(_N_COUNTERS.value, dtype=torch.int32, device=device))
    return ws


def moe_decode_fused(x: torch.Tensor, router, gate_up: QuantizedTensor, down: QuantizedTensor, top_k: int,
                     norm_topk_prob: bool, shared_expert: tuple[QuantizedTensor, QuantizedTensor] | None = None,
                     item_words: int = ITEM_WORDS, num_warps: int = NUM_WARPS,
                     per_sm: int = PER_SM, router_rows: int = ROUTER_ROWS,
                     timeline: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block's output [1, H] (x's dtype) for one token x [1, H], in one launch. router: the fused
    router [E(+1), H] (its last row the shared expert's gate when there is one), dense or quantized; shared_expert:
    its (gate_up [2I, H], down [H, I]) stored like the routed experts. `supports` says which layers qualify.
    item_words, num_warps, per_sm (programs per multiprocessor: 1, or 2 with at most 4 warps, which always fit
    together), router_rows: launch options. timeline: int64
    [programs, 16] to receive each program's global-timer stamps (benchmarks; CUDA only)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_decode_fused: x must be one bf16/fp16/fp32 row [1, H], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not supports(router, gate_up, down, top_k, shared_expert):
        raise ValueError("moe_decode_fused: unsupported router / experts / top-k for the one-launch decode "
                         "(see fused_decode.supports)")
    E, I2, H = gate_up.shape
    I = I2 // 2
    if x.shape[1] != H:
        raise ValueError(f"moe_decode_fused: x must be [1, {H}], got {tuple(x.shape)}")
    tensors = [x, gate_up.weight, down.weight] + ([router.weight] if isinstance(router, QuantizedTensor) else [router])
    if any(t.device != x.device for t in tensors) or not (x.is_cuda or tq.INTERPRET):
        raise ValueError("moe_decode_fused: all tensors must be on one CUDA device (or set TRITON_INTERPRET=1)")
    bits, gs = gate_up.bits, gate_up.group_size
    shared = shared_expert is not None
    slots = top_k + shared
    kw_h, kw_i = H // (32 // bits), I // (32 // bits)
    gbn = max(1, min(I, item_words // kw_h // 2))  # gate and up rows: two tiles per item
    dbn = max(1, min(H, item_words // kw_i))
    if per_sm not in (1, 2) or (per_sm == 2 and num_warps > 4):
        raise ValueError("moe_decode_fused: per_sm is 1, or 2 with at most 4 warps (so that every program is "
                         "resident at once: programs wait for each other)")
    # every program resident at once: 2 x 4 warps x 255 registers still fit one multiprocessor's register file
    G = 1 if tq.INTERPRET else per_sm * launch.num_sms(x.device)
    dense_router = not isinstance(router, QuantizedTensor)
    r_own_x = not dense_router and (router.bits, router.group_size) != (bits, gs)
    ws = _workspace(x.device, G, slots, H, I, gs, router.group_size if r_own_x else 0)
    x = x.contiguous()
    out = torch.empty((1, H), dtype=x.dtype, device=x.device)
    sh_gu, sh_down = shared_expert if shared else (gate_up, down)
    sh = [t for qt in (sh_gu, sh_down) for t in (qt.weight.view(torch.int32), qt.scales, qt.biases)]
    if dense_router:
        rw, rs, rb, stride_rsn, rbits, rgs = router, router, router, 0, 8, 32
    else:
        rw, rs, rb = router.weight.view(torch.int32), router.scales, router.biases
        stride_rsn, rbits, rgs = router.scales.stride(0), router.bits, router.group_size
    if timeline is not None and (timeline.dtype != torch.int64 or tuple(timeline.shape) != (G, 16)):
        raise ValueError(f"moe_decode_fused: timeline must be int64 [{G}, 16]")
    use_pdl = launch.pdl(x.device)
    _fused_decode_kernel[(G,)](
        x, out, rw, rs, rb, gate_up.weight.view(torch.int32), gate_up.scales, gate_up.biases,
        down.weight.view(torch.int32), down.scales, down.biases, *sh,
        ws["xp"], ws["hp"], ws["ids"], ws["logits"], ws["h"], ws["y"], ws["counters"],
        ws["counters"] if timeline is None else timeline, rw.stride(0), stride_rsn, gate_up.weight.stride(0),
        gate_up.weight.stride(1), gate_up.scales.stride(0), gate_up.scales.stride(1), down.weight.stride(0),
        down.weight.stride(1), down.scales.stride(0), down.scales.stride(1), ws["xp"].stride(0), ws["hp"].stride(0),
        E=E, H=H, I=I, TOP_K=top_k, KP=triton.next_power_of_2(slots), BLOCK_E=triton.next_power_of_2(E),
        NORM=norm_topk_prob, SHARED=shared, RBITS=rbits, RGS=rgs, RDENSE=dense_router, R_OWN_X=r_own_x,
        BITS=bits, GS=gs, RBN=router_rows, GBN=gbn, DBN=dbn, ASM=not tq.INTERPRET, PDL=use_pdl,
        PREFETCH=not tq.INTERPRET, TIMELINE=timeline is not None, launch_pdl=use_pdl, num_warps=num_warps,
        num_stages=1)
    return out
