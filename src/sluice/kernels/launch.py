"""What every GPU kernel family shares about launching: the multiprocessor count and compute capability (cached:
asked on every decode launch), and programmatic dependent launch (PDL, Hopper+): `pdl(device)` says whether to
launch with it, `pdl_start` is the wait a kernel so launched makes before it touches the launch before's outputs;
and `round_to`, a cast that rounds under the interpreter as a GPU does.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
USE_PDL = True  # programmatic dependent launch on sm_90+ (see `pdl_start`); off: every launch waits in full


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper+): a kernel launched with `launch_pdl` may start while the previous
    one still runs. It must not touch that kernel's outputs, nor write anything, before this wait; the wait also
    lets the next launch start (its programs then wait here in turn). So before its own wait a kernel may read
    what was written two launches back or earlier: the previous kernel had passed its wait, so those are done."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Ask L2 for the lines at `ptrs` without waiting (nothing is read into registers)."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def round_to(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 v rounded to `dtype`, returned in fp32. RNE_BF16: round to nearest even by hand, since the Triton
    interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even; so the tests see its rounding)."""
    if RNE_BF16:
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            v = u.to(tl.float32, bitcast=True)  # now exact in bf16
    return v.to(dtype).to(tl.float32)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return _sm_count(torch.device(device).index or 0)  # cached: this runs on every decode matmul


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl(device) -> bool:
    """Launch with programmatic dependent launch (`pdl_start`): Hopper or newer, not the interpreter."""
    device = torch.device(device)
    return USE_PDL and not INTERPRET and device.type == "cuda" and capability(device.index or 0)[0] >= 9


COMPILED: list[str] = []  # names of the Triton kernels compiled since `watch_compiles` (a slow step's diagnosis)


def watch_compiles() -> None:
    """Record the name of every Triton kernel compiled from now on in `COMPILED` (a jit cache-miss hook, chained to
    any hook already set; idempotent). A step that compiles mid-serving stalls every request in it: the server logs
    which kernels did."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or getattr(runtime.jit_cache_hook, "_sluice", False):
        return
    previous = runtime.jit_cache_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        COMPILED.append(getattr(fn, "name", "?"))
        return previous(*args, **kwargs) if previous else None

    hook._sluice = True
    runtime.jit_cache_hook = hook
