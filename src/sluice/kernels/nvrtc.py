"""CUDA C kernels compiled at run time with NVRTC (the runtime compiler that ships with PyTorch's CUDA wheels) and
launched through the CUDA driver API with ctypes: no nvcc, no build step, no extension module.

Used where Triton cannot express a loop well enough (kernels/attention/tq_decode.cu). A kernel is compiled once
per (source, defines, architecture, NVRTC version) to a cubin, kept under $SLUICE_HOME/kernels/nvrtc so that later
processes skip the compile, and loaded once per device. Launches go to PyTorch's current stream, so CUDA-graph
capture records them like any other kernel.

`available()` is False without a CUDA device, without NVRTC, or with SLUICE_NVRTC=0; callers then use Triton.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import site
import sys
import threading

import torch

_lock = threading.Lock()
_libs: dict = {}
_modules: dict = {}
_smem_optin: dict = {}


class NvrtcError(RuntimeError):
    pass


def _find(names: list[str], pattern: str | None = None):
    """The first of `names` the loader finds, else the first match of `pattern` under site-packages and sys.path."""
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for root in [*site.getsitepackages(), site.getusersitepackages(), *sys.path] if pattern else []:
        for path in sorted(glob.glob(os.path.join(root, pattern)), reverse=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    return None


def _nvrtc():
    if "nvrtc" not in _libs:
        lib = None
        path = os.environ.get("SLUICE_NVRTC_LIB")
        if path:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                from sluice.errors import InvalidOptionError

                raise InvalidOptionError(f"SLUICE_NVRTC_LIB={path} cannot be loaded ({e}); point it at a "
                                         "libnvrtc.so, or unset it to use PyTorch's") from None
        if lib is None:
            try:  # PyTorch's own copy: the version its CUDA runtime was built with
                from torch.cuda._utils import _get_nvrtc_library

                lib = _get_nvrtc_library()
            except Exception:  # noqa: BLE001 - any failure: the wheels' copies below
                lib = None
        if lib is None:  # the pip wheels' copies (nvidia/cuda_nvrtc/lib, nvidia/cu13/lib)
            lib = _find(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"], "nvidia/cu*/lib/libnvrtc.so*")
        _libs["nvrtc"] = lib
    return _libs["nvrtc"]


def _cuda():
    if "cuda" not in _libs:
        _libs["cuda"] = _find(["libcuda.so.1", "libcuda.so"])
    return _libs["cuda"]


def available(device=None) -> bool:
    """NVRTC and the driver can be loaded and `device` (default: the current one) is an NVIDIA GPU."""
    if os.environ.get("SLUICE_NVRTC", "1") == "0" or not torch.cuda.is_available() or torch.version.hip:
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    return _nvrtc() is not None and _cuda() is not None


def compiler_found() -> bool:
    """NVRTC's library can be loaded (compiling needs no GPU: the tests compile the kernels for sm_90 with it)."""
    try:
        return _nvrtc() is not None
    except Exception:  # noqa: BLE001 - a broken SLUICE_NVRTC_LIB: no compiler
        return False


def max_shared_per_block(device) -> int:
    """Dynamic shared memory a program may opt in to on `device` (bytes; 227 KB on an H100, 99 KB on sm_86/89)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _smem_optin:
        torch.cuda.init()
        dev, n = ctypes.c_int(), ctypes.c_int()
        _check(_cuda().cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(_cuda().cuDeviceGetAttribute(ctypes.byref(n), 97, dev), "cuDeviceGetAttribute")  # ..._BLOCK_OPTIN
        _smem_optin[index] = n.value
    return _smem_optin[index]


def compile_cubin(source: str, name: str, defines: dict, arch: str) -> bytes:
    """Compile `source` for `arch` ("sm_90") with -D defines; the cubin. Raises NvrtcError with the log."""
    lib = _nvrtc()
    if lib is None:
        raise NvrtcError("NVRTC (libnvrtc) not found")
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None,
                                             None))
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=true", "-lineinfo"]
    opts += [f"-D{k}={int(v)}" for k, v in sorted(defines.items())]
    c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        res = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        if res != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC could not compile {name} ({defines}):\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cached_cubin(source: str, name: str, defines: dict, arch: str) -> bytes:
    """compile_cubin through a file cache keyed by everything that goes into the cubin (a cache that cannot be
    read or written is skipped: the compile then happens every process)."""
    from sluice.formats.demo import cache_dir

    key = hashlib.sha256(repr((source, name, sorted(defines.items()), arch, _nvrtc_version())).encode()).hexdigest()
    path = cache_dir() / "kernels" / "nvrtc" / f"{name}-{key[:32]}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin = compile_cubin(source, name, defines, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass
    return cubin


def _check_nvrtc(lib, res: int) -> None:
    if res != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"NVRTC error {res}: {lib.nvrtcGetErrorString(res).decode()}")


def _check(res: int, what: str) -> None:
    if res != 0:
        s = ctypes.c_char_p()
        _cuda().cuGetErrorName(res, ctypes.byref(s))
        raise NvrtcError(f"CUDA driver error in {what}: {s.value.decode() if s.value else res}")


_CTYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float,
           "u": ctypes.c_uint32}


class Kernel:
    """One compiled kernel on one device: `kernel(grid, block, smem, *args)` launches it on the current stream.
    `signature`: one letter per argument (p pointer or tensor, i int32, q int64, f float32, u uint32)."""

    def __init__(self, source: str, name: str, defines: dict, signature: str, device):
        self.device = torch.device(device)
        self.name, self.signature = name, signature
        major, minor = torch.cuda.get_device_capability(self.device)
        key = (hashlib.sha256(source.encode()).hexdigest(), name, tuple(sorted(defines.items())), major, minor,
               self.device.index)
        with _lock:
            if key not in _modules:
                cubin = cached_cubin(source, name, defines, f"sm_{major}{minor}")
                with torch.cuda.device(self.device):
                    torch.cuda.current_stream(self.device)  # the primary context, current on this thread
                    module, func = ctypes.c_void_p(), ctypes.c_void_p()
                    _check(_cuda().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
                    _check(_cuda().cuModuleGetFunction(ctypes.byref(func), module, name.encode()),
                           "cuModuleGetFunction")
                _modules[key] = (module, func, {})
        self._module, self._func, self._smem_set = _modules[key]

    def _smem(self, smem: int) -> None:
        if smem > 48 * 1024 and self._smem_set.get("max", 0) < smem:
            _check(_cuda().cuFuncSetAttribute(self._func, 8, smem), "cuFuncSetAttribute")  # max dynamic smem
            self._smem_set["max"] = smem

    def occupancy(self, threads: int, smem: int) -> int:
        """Programs of `threads` threads and `smem` bytes of dynamic shared memory one multiprocessor holds."""
        key = ("occupancy", threads, smem)
        if key not in self._smem_set:  # asked once (not while a CUDA graph is being captured, say)
            self._smem(smem)
            n = ctypes.c_int()
            with torch.cuda.device(self.device):
                _check(_cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self._func, threads,
                                                                           ctypes.c_size_t(smem)), "occupancy")
            self._smem_set[key] = n.value
        return self._smem_set[key]

    def __call__(self, grid, block, smem: int, *args, pdl: bool = False) -> None:
        """Launch on the current stream; `pdl`: with programmatic dependent launch (sm_90: the kernel may start
        while the one before runs, and waits for it with griddepcontrol.wait)."""
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name}: {len(args)} arguments for signature {self.signature!r}")
        self._smem(smem)
        values = []
        for kind, a in zip(self.signature, args):
            if kind == "p":
                a = a.data_ptr() if isinstance(a, torch.Tensor) else int(a)
            values.append(_CTYPES[kind](a))
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        stream = torch.cuda.current_stream(self.device).cuda_stream
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        config = _LaunchConfig(*g, *b, smem, stream, _PDL_ATTRS, int(pdl))  # no attribute: a plain launch
        _check(_cuda().cuLaunchKernelEx(ctypes.byref(config), self._func, params, None), "cuLaunchKernelEx")


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id (4 bytes, padded to 8) and a 64-byte value union (here read as 16 uints)."""
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_PDL_ATTRS = (_LaunchAttribute * 1)()  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1
_PDL_ATTRS[0].id = 6
_PDL_ATTRS[0].value[0] = 1
