"""sluice's native CPU kernels: one C file (sluice_cpu.c) compiled on first use with the system's gcc/cc
(`-O3 -march=native -fopenmp`), cached under $SLUICE_HOME/kernels, loaded with ctypes.

Why C at all: on a CPU, decode speed is bytes of weights read per token plus per-op overhead. A fused 4-bit
GEMV reads ~8x fewer bytes than fp32 BLAS over dequantized weights, and one C call replaces the dozen small
torch ops of an attention decode step. Each kernel family keeps its torch reference as the oracle; its
`cpu.py` wraps the functions here.

If no C compiler is found, or SLUICE_CPU_KERNEL=0, `lib()` is None and callers use the torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SOURCE = Path(__file__).with_name("sluice_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib = None
_tried = False

i64, f32, i32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "qgemv": [ptr, i64, i64, ptr, ptr, ptr, i32, i64, i32, i32, ptr, ptr],
    "dequant": [ptr, ptr, ptr, i32, i64, i32, i32, ptr, i64, ptr],
    "rms_norm": [ptr, ptr, f32, i64, i64, ptr],
    "attn_decode": [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr],
    "tq_decode_steps": [ptr] * 12 + [i64] * 8 + [i32, f32, ptr],
}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _compile() -> ctypes.CDLL | None:
    if os.environ.get("SLUICE_CPU_KERNEL", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        print("sluice: no C compiler found; using the slower pure-PyTorch CPU path", file=sys.stderr)
        return None
    from sluice.formats.demo import cache_dir

    src = _SOURCE.read_bytes()
    # -march=native code must not be reused on another CPU that shares the cache directory.
    tag = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"sluice_cpu_{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            err = ""
            for flags in (_FLAGS, [f for f in _FLAGS if f != "-fopenmp"]):  # no OpenMP: single-threaded, still fast
                proc = subprocess.run([cc, *flags, str(_SOURCE), "-o", str(tmp_so), "-lm"], capture_output=True,
                                      text=True)
                if proc.returncode == 0:
                    break
                err = proc.stderr.strip()[-300:]
            else:
                print(f"sluice: could not compile the CPU kernels ({err}); using the slower pure-PyTorch CPU path",
                      file=sys.stderr)
                return None
            os.replace(tmp_so, out)
    lib = ctypes.CDLL(str(out))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def lib() -> ctypes.CDLL | None:
    """The compiled library (built on first call), or None when unavailable."""
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = _compile()
                _tried = True
    return _lib


def available() -> bool:
    return lib() is not None


def check_buffer(name: str, t, dtype, numel: int) -> None:
    """The native kernels take raw pointers, so their wrappers check every buffer here before C sees it: a
    contiguous CPU tensor of `dtype` holding at least `numel` elements, or a ValueError (never a read past the
    end of a buffer)."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"native CPU kernel: {name} must be a contiguous CPU {dtype} tensor of at least {numel} "
                         f"elements, got {tuple(t.shape)} {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")
