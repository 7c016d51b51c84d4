"""The grouped expert GEMM for few rows an expert in CUDA C (`w4_mma.cu`, compiled at run time with NVRTC,
`kernels/nvrtc.py`): mma.sync on 4-bit MLX-affine weights read in their own layout, each tile's expert read once
for its rows. The math, the fragment layouts and the pipeline are explained in the .cu file. It takes the same tile
table as the Triton grouped GEMM (`grouped.tile_table`), which stays the path under the interpreter, in CI and
wherever this one does not apply (`applies`).

Applies when: an NVIDIA GPU of compute capability 8.0 or more with NVRTC; x bf16 or fp16 and the scales alike;
4-bit weights in groups of 32 or 64; K a multiple of 128; the output columns (gate_up's I, down's H) a multiple of
64; rows of 16-byte aligned words. SLUICE_MOE_MMA=0 turns it off.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import torch
import triton

from sluice.kernels import nvrtc
from sluice.kernels.launch import num_sms, pdl
from sluice.quant.affine import QuantizedTensor

SOURCE = Path(__file__).with_name("w4_mma.cu")
WARPS = 4  # a program's warps, 16 output columns each
WIDE_WARPS = 8  # ... of the grouped GEMM with tiles of 16+ rows, where the output columns allow (more warps share
# each x chunk: 12-13 % faster at 10-12 rows an expert, docs/perf-log.md session 9)
STAGES = 4  # chunks of 128 k in flight (cp.async)
KC = 128  # k a chunk
TILE_ROWS = (8, 16, 32)  # rows a tile of the grouped GEMM (NB = 1, 2, 4 mma column blocks)
DENSE_TILE_ROWS = (16, 32, 64)  # of the dense one (16 for 5-16 rows: faster than 8 at 8 rows on the lm_head,
# docs/perf-log.md session 10)
DENSE_MT = 2  # 16-row weight sets a warp of the dense GEMM reads against each x chunk (x's shared-memory reads are
# tile rows / (4 MT) times the weights'); 2 measured best or near it at 8-64 rows, 4 spills at 64-row tiles
MIN_SPLIT_CHUNKS = 4  # a dense GEMM's K split keeps at least this many chunks a split
COUNTERS = 1 << 16  # the dense GEMM's split counters a device: (tile, column block) pairs a launch may split
ENABLED = os.environ.get("SLUICE_MOE_MMA", "1") != "0"
SIGNATURE = "p" * 14 + "i" * 7 + "q" * 10
_kernels: dict = {}
_failed: set = set()
_counters: dict = {}


def warps_for(swiglu: bool, tile_rows: int, group_size: int, columns: int, smem_limit: int) -> int:
    """The grouped GEMM's warps: WIDE_WARPS for tiles of 16+ rows where the columns and the shared memory a
    program may take (`smem_limit`, `nvrtc.max_shared_per_block`: 99 KB on sm_86 / 89 / 120, not enough for
    SwiGLU's 32-row tiles at 8 warps) allow, else WARPS."""
    wide = (tile_rows >= 16 and columns % (16 * WIDE_WARPS) == 0
            and smem_bytes(swiglu, tile_rows, group_size, WIDE_WARPS) <= smem_limit)
    return WIDE_WARPS if wide else WARPS


def smem_bytes(swiglu: bool, tile_rows: int, group_size: int, warps: int = WARPS, mt: int = 1) -> int:
    rowsets = 2 if swiglu else mt
    warp = rowsets * 2 * 32 * 16 + rowsets * 2 * 16 * (KC // group_size) * 2
    return STAGES * (tile_rows * 320 + warps * warp)


def _defines(swiglu: bool, tile_rows: int, group_size: int, fp16: bool, dense: bool = False, mt: int = 1,
             warps: int = WARPS) -> dict:
    return dict(SWIGLU=int(swiglu), NB=tile_rows // 8, GS=group_size, FP16=int(fp16), DENSE=int(dense), MT=mt,
                WARPS=warps, STAGES=STAGES)


def variants():
    """Every compiled variant: (swiglu, tile rows, group size, fp16, dense, mt, warps)."""
    for gs, fp16 in itertools.product((32, 64), (False, True)):
        for swiglu, tm in itertools.product((True, False), TILE_ROWS):
            yield swiglu, tm, gs, fp16, False, 1, WARPS
            if tm >= 16:
                yield swiglu, tm, gs, fp16, False, 1, WIDE_WARPS
        for tm in DENSE_TILE_ROWS:
            yield False, tm, gs, fp16, True, DENSE_MT, WARPS


def kernel(swiglu: bool, tile_rows: int, group_size: int, fp16: bool, device, dense: bool = False, mt: int = 1,
           warps: int = WARPS) -> nvrtc.Kernel:
    defines = _defines(swiglu, tile_rows, group_size, fp16, dense, mt, warps)
    key = (tuple(sorted(defines.items())), torch.device(device))
    if key not in _kernels:
        _kernels[key] = nvrtc.Kernel(SOURCE.read_text(), "moe_w4_mma", defines, SIGNATURE, device)
    return _kernels[key]


def _fits(qt: QuantizedTensor, dtype: torch.dtype, columns: int) -> bool:
    """Whether the kernel reads qt ([.., N, K] stacked or 2-D) with columns (its output columns) as they lie."""
    if qt.bits != 4 or qt.group_size not in (32, 64) or qt.scales.dtype != dtype or qt.in_features % KC:
        return False
    if columns % (16 * WARPS) or qt.weight.stride(-1) != 1 or qt.scales.stride(-1) != 1:
        return False
    gpc = KC // qt.group_size
    w = qt.weight.view(torch.int32)
    if any(st % 4 for st in w.stride()[:-1]) or w.data_ptr() % 16:
        return False
    if qt.scales.stride() != qt.biases.stride() or any(st % gpc for st in qt.scales.stride()[:-1]):
        return False
    return all(t.data_ptr() % (2 * gpc) == 0 for t in (qt.scales, qt.biases))


def applies(x: torch.Tensor, gate_up: QuantizedTensor, down: QuantizedTensor, extras=None) -> bool:
    """Whether this kernel runs these experts for x (and the shared expert's `ExtraExperts`, if any)."""
    if not ENABLED or x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not nvrtc.available(x.device) or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    I, H = gate_up.shape[1] // 2, gate_up.shape[2]
    if not (_fits(gate_up, x.dtype, I) and _fits(down, x.dtype, H)):
        return False
    for ex, columns in zip(extras or (), (I, H)):
        gpc = KC // ex.qt.group_size
        if not _fits(ex.qt, x.dtype, columns) or ex.words % 4 or ex.groups % gpc:
            return False
    limit = nvrtc.max_shared_per_block(x.device)
    if any(smem_bytes(sw, tm, qt.group_size) > limit for sw, qt in ((True, gate_up), (False, down))
           for tm in TILE_ROWS):
        return False
    return all(_compiles(x.device, sw, tm, qt.group_size, x.dtype == torch.float16, False, 1,
                         warps_for(sw, tm, qt.group_size, columns, limit))
               for sw, qt, columns in ((True, gate_up, I), (False, down, H)) for tm in TILE_ROWS)


def dense_applies(x: torch.Tensor, qt: QuantizedTensor) -> bool:
    """Whether `dense` computes x @ W^T for this 2-D weight."""
    if not ENABLED or x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or qt.weight.dim() != 2:
        return False
    if not nvrtc.available(x.device) or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    if not _fits(qt, x.dtype, qt.out_features) or x.dim() != 2 or x.shape[1] != qt.in_features:
        return False
    tm = dense_tile_rows(x.shape[0])  # (only the variant these rows take: a first load compiles less)
    if smem_bytes(False, tm, qt.group_size, WARPS, DENSE_MT) > nvrtc.max_shared_per_block(x.device):
        return False
    return _compiles(x.device, False, tm, qt.group_size, x.dtype == torch.float16, True, DENSE_MT, WARPS)


def _compiles(device, *variant) -> bool:
    """Compile (once) and say whether it worked; a failure is reported once and the Triton GEMM takes over."""
    key = (*variant, STAGES, torch.device(device))
    if key in _failed:
        return False
    try:
        kernel(*variant[:4], device, *variant[4:])
        return True
    except nvrtc.NvrtcError as e:
        _failed.add(key)
        warnings.warn(f"sluice: the CUDA MoE GEMM is unavailable here, using the Triton one ({e})", RuntimeWarning,
                      stacklevel=2)
        return False


def tile_rows(rows: float) -> int:
    """Rows a tile for experts that average `rows` rows (docs/perf-log.md, session 9: 8 fastest at 2.5 and 6 rows,
    16 at 10, 32 at 24)."""
    return 8 if rows <= 6 else 16 if rows <= 16 else 32


def grouped_gemm(a: torch.Tensor, a_div: int, qt: QuantizedTensor, c: torch.Tensor, table, swiglu: bool,
                 tile_rows: int, extra=None) -> None:
    """c[order[r]] for the sorted rows r of each tile of `table` (`grouped.tile_table`, tiles of tile_rows):
    a[order[r] // a_div] @ W[e]^T (with swiglu, qt gate_up: silu(gate) * up), W[e] the tile's expert; experts
    E.. (past qt's stack) are `extra`'s (`triton.ExtraExperts`). a and c: x's dtype, rows 16-byte aligned."""
    order, offsets, tile_expert, tile_row = table
    if not all(t.dtype == torch.int32 and t.is_contiguous() for t in table):
        raise ValueError("moe mma: the tile table's tensors must be contiguous int32")
    E = qt.weight.shape[0]
    N = qt.out_features // 2 if swiglu else qt.out_features
    K = qt.in_features
    if a.stride(-1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or c.stride(-1) != 1 or a.shape[1] != K:
        raise ValueError(f"moe mma: a must be [rows, {K}] with 16-byte aligned rows, c unit column stride")
    w = qt.weight.view(torch.int32)
    if extra is None:
        xw, xs, xb, x_words, x_groups, x_wn, x_sn, n_extra = w, qt.scales, qt.biases, 0, 0, 0, 0, 0
    else:
        xw, xs, xb, x_words, x_groups, x_wn, x_sn = extra.launch_args()
        n_extra = extra.n
    if offsets.numel() - 1 > E + n_extra:
        raise ValueError(f"moe mma: the tile table covers {offsets.numel() - 1} experts, more than {E} + {n_extra}")
    warps = warps_for(swiglu, tile_rows, qt.group_size, N, nvrtc.max_shared_per_block(a.device))
    k = kernel(swiglu, tile_rows, qt.group_size, a.dtype == torch.float16, a.device, warps=warps)
    grid = (N // (16 * warps), tile_expert.numel())
    k(grid, (warps * 32,), smem_bytes(swiglu, tile_rows, qt.group_size, warps), a, w, qt.scales, qt.biases, xw, xs,
      xb, c, order, tile_expert, tile_row, offsets, c, offsets, N, K, E, offsets.numel() - 1, a_div, 0, K // KC,
      a.stride(0), w.stride(0), w.stride(1), qt.scales.stride(0), qt.scales.stride(1), x_words, x_groups, x_wn, x_sn,
      c.stride(0), pdl=pdl(a.device))


def dense_tile_rows(M: int) -> int:
    return next((t for t in DENSE_TILE_ROWS if M <= t), DENSE_TILE_ROWS[-1])


def _split_counters(device) -> torch.Tensor | None:
    """The dense GEMM's split counters on `device`: zeros, each set back to 0 by the launch that counts on it (so
    one launch at a time a device: the engine's single stream). None while a CUDA graph is being captured and they
    do not exist yet (made then, they would be the graph's memory, zeroed only when it replays): that call does not
    split K."""
    device = torch.device(device)
    if device not in _counters:
        if torch.cuda.is_current_stream_capturing():
            return None
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def dense_plan(M: int, N: int, K: int, sms: int, tile_rows: int | None = None, splits: int | None = None,
               mt: int | None = None, warps: int = WARPS) -> tuple[int, int, int, int, int, int]:
    """(tile rows, mt, tiles, column blocks, splits, chunks a split) of the dense GEMM: one tile up to 64 rows
    (`dense_tile_rows`), mt `DENSE_MT`, K split where the programs would leave multiprocessors idle (about two
    programs an SM, at least MIN_SPLIT_CHUNKS chunks a split). N: a multiple of 16 warps (`dense_applies`)."""
    tm = tile_rows or dense_tile_rows(M)
    mt = mt or DENSE_MT
    if N % (16 * warps) or N % (16 * mt):  # (a warp's 16 mt columns all in N or all past it)
        raise ValueError(f"moe mma dense: {N} columns are not a multiple of {16 * warps} and {16 * mt}")
    tiles, blocks, chunks = triton.cdiv(M, tm), triton.cdiv(N, 16 * warps * mt), K // KC
    if splits is None:
        splits = max(1, min(triton.cdiv(2 * sms, blocks * tiles), chunks // MIN_SPLIT_CHUNKS))
    if blocks * tiles > COUNTERS:
        splits = 1
    per = triton.cdiv(chunks, splits)
    return tm, mt, tiles, blocks, triton.cdiv(chunks, per), per


def dense(x: torch.Tensor, qt: QuantizedTensor, tile_rows: int | None = None, splits: int | None = None,
          mt: int | None = None, warps: int = WARPS) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype (`dense_applies`), planned by `dense_plan` (the options override
    it); a split K's fp32 partials are summed by the launch's last split."""
    M, K = x.shape
    N = qt.out_features
    if K != qt.in_features:
        raise ValueError(f"moe mma dense: x has {K} features, the weight {qt.in_features}")
    if not (x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0):
        x = x.clone(memory_format=torch.contiguous_format)  # (a fresh allocation: 16-byte aligned rows)
    tm, mt, tiles, blocks, splits, per = dense_plan(M, N, K, num_sms(x.device), tile_rows, splits, mt, warps)
    counters = _split_counters(x.device) if splits > 1 else None
    if counters is None:  # (one split: the workspace and the counters are never touched; out stands in for both)
        splits, per = 1, K // KC
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = out if counters is None else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    counters = out if counters is None else counters
    w = qt.weight.view(torch.int32)
    k = kernel(False, tm, qt.group_size, x.dtype == torch.float16, x.device, True, mt, warps)
    k((tiles, blocks, splits), (warps * 32,), smem_bytes(False, tm, qt.group_size, warps, mt), x, w, qt.scales,
      qt.biases, w, qt.scales, qt.biases, out, 0, 0, 0, 0, ws, counters, N, K, 1, 1, 1, M, per, x.stride(0), 0,
      w.stride(0), 0, qt.scales.stride(0), 0, 0, 0, 0, N, pdl=pdl(x.device))
    return out
