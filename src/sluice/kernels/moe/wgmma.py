"""The grouped expert GEMM for many rows an expert (prefill) on sm_90, in CUDA C (`w4_wgmma.cu`, compiled at run time
with NVRTC for sm_90a): wgmma with the 4-bit MLX-affine weights dequantized into its register operand, the tile's x
from shared memory. The design is explained in the .cu file. It takes the tile table of the other grouped GEMMs
(`grouped.tile_table`); the Triton grouped GEMM stays the path everywhere this one does not apply (`applies`).

Applies when: a GPU of compute capability 9.0 with NVRTC; x bf16 or fp16 and the scales alike; 4-bit weights in
groups of 32 or 64; K a multiple of 128; gate_up's columns a multiple of 32 and down's of 64; rows of 16-byte aligned
words; no extra (shared-expert) slots. SLUICE_MOE_WGMMA=0 turns it off.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import torch

from sluice.kernels import nvrtc
from sluice.kernels.launch import pdl
from sluice.kernels.moe import mma
from sluice.quant.affine import QuantizedTensor

SOURCE = Path(__file__).with_name("w4_wgmma.cu")
TILE_ROWS = (64, 128)  # rows a tile (the wgmma's N)
WARPGROUPS = 2  # a program's warpgroups, where the columns allow; they share the tile's x
M_BLOCKS = 2  # wgmmas of 64 weight rows a warpgroup a step, where the columns allow (each reads the same x)
STAGES = 4  # chunks of 128 k in flight (cp.async), 3 where 4 do not fit
KC = 128
ENABLED = os.environ.get("SLUICE_MOE_WGMMA", "1") != "0"
SIGNATURE = "p" * 9 + "i" * 4 + "q" * 6
_kernels: dict = {}
_failed: set = set()


def step_function(tile_rows: int) -> str:
    """`wgmma_step(d, a, desc)`: one m64n{tile_rows}k16 wgmma (the asm names each of the tile_rows / 2 accumulator
    registers of a thread)."""
    n = tile_rows // 2
    acc = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (f"__device__ __forceinline__ void wgmma_step(float (&d)[{n}], const u32 (&a)[4], u64 desc) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{tile_rows}k16.f32." MMA_TYPE "." MMA_TYPE " "\n'
            f'                 "{{{acc}}}, {{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n"\n'
            f"                 : {outs}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));\n'
            "}\n")


def source(tile_rows: int) -> str:
    return mma.COMMON.read_text() + SOURCE.read_text().replace("\nWGMMA_STEP\n", "\n" + step_function(tile_rows))


def stage_bytes(tile_rows: int, warpgroups: int, m_blocks: int, group_size: int) -> int:
    rows = warpgroups * m_blocks * 64
    return tile_rows * KC * 2 + rows * 80 + 2 * rows * (KC // group_size) * 2


def stages(tile_rows: int, warpgroups: int, m_blocks: int, group_size: int, smem_limit: int = 227 * 1024) -> int:
    return STAGES if STAGES * stage_bytes(tile_rows, warpgroups, m_blocks, group_size) <= smem_limit else 3


def smem_bytes(tile_rows: int, warpgroups: int, m_blocks: int, group_size: int, n_stages: int | None = None) -> int:
    n_stages = n_stages or stages(tile_rows, warpgroups, m_blocks, group_size)
    return n_stages * stage_bytes(tile_rows, warpgroups, m_blocks, group_size)


def _defines(swiglu: bool, tile_rows: int, warpgroups: int, m_blocks: int, group_size: int, fp16: bool,
             n_stages: int | None = None, min_blocks: int = 1) -> dict:
    return dict(SWIGLU=int(swiglu), TN=tile_rows, WG=warpgroups, MB=m_blocks, GS=group_size, FP16=int(fp16),
                STAGES=n_stages or stages(tile_rows, warpgroups, m_blocks, group_size), MINB=min_blocks)


def variants():
    """Every compiled variant: (swiglu, tile rows, warpgroups, m blocks, group size, fp16)."""
    for swiglu, tn, (wg, mb), gs, fp16 in itertools.product((True, False), TILE_ROWS, ((1, 1), (WARPGROUPS, 1),
                                                            (WARPGROUPS, M_BLOCKS)), (32, 64), (False, True)):
        yield swiglu, tn, wg, mb, gs, fp16


def kernel(swiglu: bool, tile_rows: int, warpgroups: int, m_blocks: int, group_size: int, fp16: bool,
           device, n_stages: int | None = None, min_blocks: int = 1) -> nvrtc.Kernel:
    defines = _defines(swiglu, tile_rows, warpgroups, m_blocks, group_size, fp16, n_stages, min_blocks)
    key = (tuple(sorted(defines.items())), torch.device(device))
    if key not in _kernels:
        _kernels[key] = nvrtc.Kernel(source(tile_rows), "moe_w4_wgmma", defines, SIGNATURE, device, arch_suffix="a")
    return _kernels[key]


def layout(swiglu: bool, columns: int, m_blocks: int | None = None) -> tuple[int, int]:
    """(warpgroups, wgmmas a warpgroup a step) of a program: the most the output columns are whole programs of."""
    unit = 32 if swiglu else 64
    for wg, mb in ((WARPGROUPS, m_blocks or M_BLOCKS), (WARPGROUPS, 1), (1, 1)):
        if columns % (wg * mb * unit) == 0:
            return wg, mb
    raise ValueError(f"moe wgmma: {columns} output columns are not a multiple of {unit}")


def _fits(qt: QuantizedTensor, dtype: torch.dtype, columns: int, swiglu: bool) -> bool:
    if qt.bits != 4 or qt.group_size not in (32, 64) or qt.scales.dtype != dtype or qt.in_features % KC:
        return False
    if columns % (32 if swiglu else 64) or qt.weight.stride(-1) != 1 or qt.scales.stride(-1) != 1:
        return False
    gpc = KC // qt.group_size
    w = qt.weight.view(torch.int32)
    if any(st % 4 for st in w.stride()[:-1]) or w.data_ptr() % 16:
        return False
    if qt.scales.stride() != qt.biases.stride() or any(st % gpc for st in qt.scales.stride()[:-1]):
        return False
    return all(t.data_ptr() % (2 * gpc) == 0 for t in (qt.scales, qt.biases))


def applies(x: torch.Tensor, gate_up: QuantizedTensor, down: QuantizedTensor) -> bool:
    """Whether this kernel runs these experts for x."""
    if not ENABLED or x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not nvrtc.available(x.device) or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    I, H = gate_up.shape[1] // 2, gate_up.shape[2]
    if not (_fits(gate_up, x.dtype, I, True) and _fits(down, x.dtype, H, False)):
        return False
    limit = nvrtc.max_shared_per_block(x.device)
    fp16 = x.dtype == torch.float16
    checks = [(sw, tn, *layout(sw, cols), qt.group_size)
              for sw, qt, cols in ((True, gate_up, I), (False, down, H)) for tn in TILE_ROWS]
    return all(smem_bytes(tn, wg, mb, gs) <= limit and _compiles(x.device, sw, tn, wg, mb, gs, fp16)
               for sw, tn, wg, mb, gs in checks)


def _compiles(device, *variant) -> bool:
    key = (*variant, STAGES, torch.device(device))
    if key in _failed:
        return False
    try:
        kernel(*variant, device)
        return True
    except nvrtc.NvrtcError as e:
        _failed.add(key)
        warnings.warn(f"sluice: the wgmma MoE GEMM is unavailable here, using the Triton one ({e})", RuntimeWarning,
                      stacklevel=2)
        return False


def tile_rows(rows: float) -> int:
    """Rows a tile for experts that average `rows` rows."""
    return 64 if rows <= 48 else 128


def grouped_gemm(a: torch.Tensor, a_div: int, qt: QuantizedTensor, c: torch.Tensor, table, swiglu: bool,
                 tile_rows: int, extra=None, m_blocks: int | None = None, n_stages: int | None = None,
                 min_blocks: int = 1) -> None:
    """c[order[r]] for the sorted rows r of each tile of `table` (`grouped.tile_table`, tiles of tile_rows):
    a[order[r] // a_div] @ W[e]^T (with swiglu, qt gate_up: silu(gate) * up), W[e] the tile's expert. a and c: x's
    dtype, rows 16-byte aligned. (`extra`: for `mma.grouped_gemm`'s signature; none here. m_blocks: `layout`'s,
    default M_BLOCKS.)"""
    if extra is not None:
        raise ValueError("moe wgmma: no extra expert slots")
    order, offsets, tile_expert, tile_row = table
    if not all(t.dtype == torch.int32 and t.is_contiguous() for t in table):
        raise ValueError("moe wgmma: the tile table's tensors must be contiguous int32")
    N = qt.out_features // 2 if swiglu else qt.out_features
    K = qt.in_features
    if a.stride(-1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16 or c.stride(-1) != 1 or a.shape[1] != K:
        raise ValueError(f"moe wgmma: a must be [rows, {K}] with 16-byte aligned rows, c unit column stride")
    if offsets.numel() - 1 > qt.weight.shape[0]:
        raise ValueError(f"moe wgmma: the tile table covers {offsets.numel() - 1} experts, more than the stack's")
    wg, mb = layout(swiglu, N, m_blocks)
    w = qt.weight.view(torch.int32)
    k = kernel(swiglu, tile_rows, wg, mb, qt.group_size, a.dtype == torch.float16, a.device, n_stages, min_blocks)
    grid = (N // (wg * mb * (32 if swiglu else 64)), tile_expert.numel())
    k(grid, (wg * 128,), smem_bytes(tile_rows, wg, mb, qt.group_size, n_stages), a, w, qt.scales, qt.biases, c, order,
      tile_expert, tile_row, offsets, N, K, offsets.numel() - 1, a_div, a.stride(0), w.stride(0), w.stride(1),
      qt.scales.stride(0), qt.scales.stride(1), c.stride(0), pdl=pdl(a.device))
