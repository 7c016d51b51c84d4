"""The TurboQuant decode-attention split kernel in CUDA C (`tq_decode.cu`), compiled at run time with NVRTC
(`kernels/nvrtc.py`): the fast path on NVIDIA GPUs of compute capability 8.0 and up. It writes the same partials
as `triton._decode_split_kernel` (which stays the path under the interpreter, in CI and wherever this one does not
apply), and the same merge kernel finishes. The math and the fragment layouts are explained in the .cu file.

Applies when: G = Hq / Hkv <= 8, D in (64, 128, 256), cache capacity a multiple of 32 (positions in blocks of 32),
codes, scales and the ring contiguous per (sequence, KV head); the cache tensors may be a pool of more rows than
queries (`rows`: query b reads row rows[b]), or paged (`table`: the codes and scales blocks of `page` positions, a
multiple of 32, and a row's position j in block table[row, j // page]; the ring one per row). SLUICE_TQ_CUDA=0
turns it off.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import triton

from sluice.kernels import nvrtc
from sluice.kernels.launch import num_sms, pdl
from sluice.kernels.turboquant import reference
from sluice.kernels.turboquant import triton as tq_triton

SOURCE = Path(__file__).with_name("tq_decode.cu")
WARPS = 4
BLOCK = 32  # positions a warp takes at a time
# blocks a warp has in flight (cp.async); 3 measured slower everywhere (docs/perf-log.md, 2026-11-25 "attention,
# CUDA C")
STAGES = 2
Q_PARTS = 2  # q as two int8 parts (15 bits), as the Triton kernel
RECENT_SPLIT = 16  # newest positions a recent split takes (4 a warp)
RECENT_COST = 6  # a recent position costs a warp about as much as this many coded ones (fp32 FMAs, shuffles)
ENABLED = os.environ.get("SLUICE_TQ_CUDA", "1") != "0"  # SLUICE_TQ_CUDA=0: the Triton kernel everywhere
SIGNATURE = "p" * 12 + "ff" + "i" * 10 + "q" * 10 + "uuuu" + "pq"
_kernels: dict = {}


def _tables() -> tuple[int, int, int, int]:
    """The byte-permute tables: TA[j] = L(j) - 1 for the negative levels, TB[j] = L(8 + j) for the positive ones
    (tq_decode.cu: prmt(TA, code) + prmt(TB, code ^ 8) = L(code) - 1), as two 32-bit words each."""
    lv = reference.int_levels()
    ta = bytes((x - 1) & 0xFF for x in lv[:8])
    tb = bytes(x & 0xFF for x in lv[8:])
    word = lambda b: int.from_bytes(b, "little")  # noqa: E731
    return word(ta[:4]), word(ta[4:]), word(tb[:4]), word(tb[4:])


def smem_bytes(D: int, G: int) -> int:
    """The stages, each warp's fp32 output sums (G heads), its probabilities (2 x 256 bytes) and (max, sum) per
    head, the packed q fragments and their per-warp max and sums, the rotation's signs."""
    stage = 2 * BLOCK * D // 2 + 2 * BLOCK * 4
    q_fragments = 32 * Q_PARTS * (D // 32) * 2 * 4 + WARPS * 8 * 4 + WARPS * 8 * Q_PARTS * 4
    return STAGES * WARPS * stage + WARPS * G * D * 4 + WARPS * 512 + 2 * WARPS * 8 * 4 + q_fragments + D * 4


def kernel(D: int, G: int, ring_dtype: torch.dtype, pos_dtype: torch.dtype, rows_dtype: torch.dtype | None,
           device, paged: bool = False) -> nvrtc.Kernel:
    """The variant for these shapes and dtypes (`rows_dtype` None: no rows, query b reads cache row b; `paged`:
    the codes and scales read through a block table)."""
    key = (D, G, ring_dtype, pos_dtype, rows_dtype, torch.device(device), paged)
    if key not in _kernels:
        defines = dict(D=D, G=G, QP=Q_PARTS, W=WARPS, STAGES=STAGES, RING_BF16=ring_dtype == torch.bfloat16,
                       POS64=pos_dtype == torch.int64, ROWS=0 if rows_dtype is None else rows_dtype.itemsize * 8,
                       PAGED=int(paged))
        _kernels[key] = nvrtc.Kernel(SOURCE.read_text(), "tq_decode_split", defines, SIGNATURE, device)
    return _kernels[key]


def applies(q, k_codes, v_codes, k_scale, v_scale, k_recent, v_recent, positions, rows=None, table=None) -> bool:
    """Whether this kernel takes the call (else the Triton one). The batch dims are not compared: the cache
    tensors' may be a pool larger than q's (`rows`), or blocks (`table`, int32 [rows, blocks]: the capacity dim is
    the page)."""
    if not ENABLED or q.device.type != "cuda" or not nvrtc.available(q.device):
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return False
    _, Hq, D = q.shape
    Hkv, cap = k_codes.shape[1], k_codes.shape[2]
    if D not in (64, 128, 256) or Hq % Hkv or Hq // Hkv > 8 or cap % BLOCK:
        return False
    if q.dtype != torch.float32 or q.stride(-1) != 1 or q.stride(1) != D:
        return False
    if k_recent.dtype not in (torch.bfloat16, torch.float32) or k_recent.stride(-1) != 1 or k_recent.stride(2) != D:
        return False
    if k_codes.stride(2) != D // 2 or v_codes.stride(2) != 2 * D or k_scale.stride(-1) != 1:
        return False
    rows_dtype = None if rows is None else rows.dtype
    if positions.dtype not in (torch.int32, torch.int64) or rows_dtype not in (None, torch.int32, torch.int64):
        return False
    if table is not None and (table.dtype != torch.int32 or table.dim() != 2 or table.stride(-1) != 1):
        return False
    if smem_bytes(D, Hq // Hkv) > nvrtc.max_shared_per_block(q.device):  # D = 256, G = 8: 108 KB, not on sm_86 / 89
        return False
    return _compiles(D, Hq // Hkv, k_recent.dtype, positions.dtype, rows_dtype, q.device, table is not None)


_failed: set = set()


def _compiles(D, G, ring_dtype, pos_dtype, rows_dtype, device, paged=False) -> bool:
    """Compile (once) and say whether it worked; a failure is reported once and the Triton kernel takes over."""
    key = (D, G, ring_dtype, pos_dtype, rows_dtype, torch.device(device), paged)
    if key in _failed:
        return False
    try:
        kernel(D, G, ring_dtype, pos_dtype, rows_dtype, device, paged)
        return True
    except nvrtc.NvrtcError as e:
        _failed.add(key)
        warnings.warn(f"sluice: the CUDA TurboQuant decode kernel is unavailable here, using the Triton one ({e})",
                      RuntimeWarning, stacklevel=2)
        return False


def plan(batch_heads: int, visible: int, recent: int, D: int, G: int, ring_dtype, pos_dtype, rows_dtype, device,
         splits: int | None = None, paged: bool = False) -> tuple[int, int, int]:
    """(coded splits, positions per coded split, all splits): one wave of the programs the GPU holds, each split
    at least one block per warp; the newest `recent` positions in splits of RECENT_SPLIT after them."""
    coded = max(visible - recent, 0)
    n_recent = max(1, triton.cdiv(min(visible, recent), RECENT_SPLIT))
    if splits is None:
        # one wave of coded splits, and the recent ones after them: when they do not fit the wave they run once
        # the first coded ones end, unless giving them slots of the wave costs less (few sequences and KV heads)
        occ = max(1, kernel(D, G, ring_dtype, pos_dtype, rows_dtype, device, paged).occupancy(WARPS * 32,
                                                                                               smem_bytes(D, G)))
        slots = occ * num_sms(device)
        splits = max(1, slots // batch_heads)
        spill = batch_heads * (splits + n_recent) > slots
        warp_positions = lambda n: coded / (n * WARPS)  # noqa: E731  the coded positions each warp takes
        recent_cost = RECENT_COST * triton.cdiv(min(visible, recent), n_recent * WARPS)
        if spill and splits > n_recent and (warp_positions(splits - n_recent)
                                            < warp_positions(splits) + recent_cost):
            splits -= n_recent
    n_coded = max(1, min(splits, triton.cdiv(coded, WARPS * BLOCK)))
    per_split = triton.cdiv(triton.cdiv(max(coded, 1), n_coded), BLOCK) * BLOCK
    n_coded = max(1, triton.cdiv(coded, per_split))
    return n_coded, per_split, n_coded + n_recent


def decode_split(q, k_codes, v_codes, k_scale, v_scale, k_recent, v_recent, positions, rows, scale: float, window,
                 op, ml, unrotate: bool, n_coded: int, per_split: int, n_splits: int, table=None) -> None:
    """The split kernel: partials into op [B Hkv, n_splits, BG, D] and ml [B Hkv, n_splits, 2, BG] (fp32, natural
    log units) as the Triton kernel writes them, query b reading the cache tensors' row rows[b] (row b where rows
    is None); with `unrotate` each partial is rotated back out of the codec's domain already (the merge is linear),
    so the merge need not. Paged (`table`): the codes and scales are blocks, the capacity dim the page, read
    through table[row, position // page]. On sm_90 launched with programmatic dependent launch, like the Triton
    kernels: it starts while the launch before ends and waits for it before reading."""
    B, Hq, D = q.shape
    Hkv, cap = k_codes.shape[1], k_codes.shape[2]
    G = Hq // Hkv
    BG = op.shape[2]
    kern = kernel(D, G, k_recent.dtype, positions.dtype, None if rows is None else rows.dtype, q.device,
                  table is not None)
    ta0, ta1, tb0, tb1 = _tables()
    recent = k_recent.shape[2]
    signs = tq_triton._tables(D, q.device)[0]
    kern((B * Hkv, n_splits), (WARPS * 32,), smem_bytes(D, G),
         q, k_codes, v_codes, k_scale, v_scale, k_recent, v_recent, positions, 0 if rows is None else rows, op, ml,
         signs, scale * 1.4426950408889634, reference.LEVEL_STEP,
         Hkv, cap, per_split, n_coded, n_splits, recent, window or 0, int(window is not None), int(unrotate), BG,
         q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1), v_codes.stride(0), v_codes.stride(1),
         k_scale.stride(0), k_scale.stride(1), k_recent.stride(0), k_recent.stride(1),
         ta0, ta1, tb0, tb1, 0 if table is None else table, 0 if table is None else table.stride(0),
         pdl=pdl(q.device))
