"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, at real model shapes.

The interpreter runs a kernel's arithmetic but does not type-check it the way the compiler does, nor lay out shared
memory or registers: session 5's fused MLA chain passed every CPU test and its GPU tests at latents of 32, and failed
to compile on the GPU at Moonlight's 512 (a name bound at two shapes in two branches). Triton compiles for any
target it ships a backend for (to PTX, then a cubin through its bundled ptxas), so here a launch through a kernel's
own Python wrapper compiles the kernel as a GPU would and runs nothing: `compile_only` stands in for the CUDA driver
(the target, device 0, stream 0) and turns every launch into a warm-up. `cuobjdump` (bundled too) reads each cubin's
registers and spills.

Must run in a process without TRITON_INTERPRET (the test suite sets it): `python tests/sm90.py` runs the cases and
prints a line a kernel (a failure: a compile error, or more shared memory than a block may have; spills are printed:
this machine's Triton may differ from the GPU's); `tests/test_sm90_compile.py` runs it in a subprocess. A case calls
a wrapper with CPU tensors of the real shapes (their values are never read). New kernels add their cases here.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_MAX = 232448  # bytes of shared memory a block may have on sm_90 (227 KB)


@contextlib.contextmanager
def compile_only(capability: int = 90):
    """Within: every Triton launch compiles its kernel for sm_`capability` and runs nothing. Yields the list of
    (kernel name, compiled kernel) in launch order."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Target:  # what a launch asks the driver before it compiles
        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    compiled: list = []
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    from sluice.kernels import launch

    pdl = launch.pdl  # Hopper launches with programmatic dependent launch: compile those variants, not the CPU's
    with_pdl = [(m, name) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("sluice.kernels")
                for name in ("pdl", "pdl_available") if getattr(m, name, None) is pdl]
    before = driver._active
    driver.set_active(Target())
    JITFunction.run = warm
    for m, name in with_pdl:
        setattr(m, name, lambda device: True)
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = before
        for m, name in with_pdl:
            setattr(m, name, pdl)


def supported() -> str | None:
    """Why this Triton cannot be driven so (the private hooks `compile_only` uses changed), or None."""
    import inspect

    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if not (hasattr(driver, "_active") and hasattr(driver, "set_active")):
        return "triton.runtime.driver has no _active / set_active"
    params = inspect.signature(JITFunction.run).parameters
    if not {"grid", "warmup"} <= set(params):
        return "JITFunction.run takes no grid / warmup"
    return None


def resources(kernel) -> dict:
    """{"shared": bytes, "registers": a thread's, "spills": bytes of local memory} of a compiled kernel."""
    out = {"shared": kernel.metadata.shared, "registers": None, "spills": None}
    cubin = kernel.asm.get("cubin")
    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubin and tool.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        if m:
            out["registers"], out["spills"] = int(m.group(1)), int(m.group(2)) + int(m.group(3))
    return out


def mla_cases():
    """The DeepSeek decode chain (`kernels/mla/fused.py`) and the MLA decode (`kernels/mla/triton.py`) at Moonlight's
    16 heads and DeepSeek-V3's 128: latent 512, rope 64, nope 128, v 128, bf16, batch 1 (larger batches take the
    same compiled variants but for the block sizes, which the cases name), paged."""
    import torch

    from sluice.kernels.mla import fused, triton as mt
    from sluice.kernels.mla.chain import Partials
    from sluice.kernels.moe import ExpertOutputs, group_route

    bf = torch.bfloat16
    nope, P, R, V = 128, 64, 512, 128
    for H, hidden in ((16, 2048), (128, 7168)):
        for B in (1,):
            z = lambda *shape, dtype=bf: torch.zeros(*shape, dtype=dtype)  # noqa: E731
            cache, table = z(64, 256, R + P), z(B, 8, dtype=torch.int32)
            rows, pos = z(B, dtype=torch.int32), z(B, dtype=torch.int32)
            for block_r in (None, 128, 64, 32):
                fused.mla_prep(z(3, B, H * (nope + P)), z(1, B, R + P), z(B, P), z(B, P), z(R), 1e-6,
                               z(H, nope, R), cache, rows, pos, table, bf, block_r=block_r)
            for block_v in (None, 64, 16):
                fused.uv_out(z(B, H, R), z(H, V, R), bf, block_v=block_v)
            h = z(B, hidden)
            fused.add_rms_norm(h, Partials(z(4, B, hidden, dtype=torch.float32), bf), z(hidden), 1e-6, True)
            experts = ExpertOutputs(z(2, B * 7, hidden, dtype=torch.float32), z(B, 7, dtype=torch.float32), bf)
            fused.add_rms_norm(h, experts, z(hidden), 1e-6, True)
            E = 64 if H == 16 else 256
            logits = group_route.router_partials(z(B, hidden, dtype=torch.float32), z(E, hidden, dtype=torch.float32))
            group_route.group_topk(logits, z(E, dtype=torch.float32), 6 if H == 16 else 8, "sigmoid", "noaux_tc",
                                   1 if H == 16 else 8, 1 if H == 16 else 4, True, 2.5, extra_slots=2 if H == 16 else 1)
            mt.mla_decode(z(B, H, R), z(B, H, P), cache, rows, pos, 8192, 0.1, table=table, programs_per_sm=2,
                          pdl=True)
            # a short launch's sizes (this process counts 4 SMs: an H200's 132 take them at batch 1 over ~600 keys)
            mt.mla_decode(z(B, H, R), z(B, H, P), cache, rows, pos, 576, 0.1, table=table, programs_per_sm=2,
                          block_n=mt.SHORT_BLOCK_N if H <= 16 else None, num_stages=2 if H <= 16 else None,
                          min_per_split=16)


def _q(*shape, bits=4, group=64):
    """A QuantizedTensor of zeros, [*shape] (the last dim the input width), as the checkpoints lay it out."""
    import torch

    from sluice.quant.affine import QuantizedTensor

    *lead, K = shape
    return QuantizedTensor(torch.zeros(*lead, K * bits // 32, dtype=torch.int32),
                           torch.zeros(*lead, K // group, dtype=torch.bfloat16),
                           torch.zeros(*lead, K // group, dtype=torch.bfloat16), bits, group)


def moe_cases():
    """The MoE kernels (`kernels/moe`) at Qwen3-Next-80B's experts (512 of 2 x 512 x 2048, top-10, a shared expert
    as one more slot) and Moonlight's (64 of 2 x 1408 x 2048, top-6, two shared experts as two more slots): decode
    batches of 1 and 64 through the expert GEMVs or (Moonlight at 64: 6 rows an expert) the grouped GEMMs, and
    4,096 tokens through the grouped GEMMs; a decode step of one token with the shared slots."""
    import torch

    from sluice.kernels.moe import route
    from sluice.kernels.moe import triton as mt

    # CPU tensors stand in for the GPU's (this process compiles only)
    mt.check_device = route.check_device = lambda *tensors: None
    for E, I, H, k, n in ((512, 512, 2048, 10, 1), (64, 1408, 2048, 6, 2)):
        gate_up, down = _q(E, 2 * I, H), _q(E, H, I)
        for T in (1, 64, 4096):
            x = torch.zeros(T, H, dtype=torch.bfloat16)
            ids = torch.zeros(T, k, dtype=torch.int32)
            w = torch.zeros(T, k, dtype=torch.float32)
            mt.moe(x, ids, w, gate_up, down, summed=False)  # the path the layers take at T (`gemv_decode`)
        shared = mt.shared_slots(gate_up, down, _q(2 * n * I, H), _q(H, n * I), n)
        ids, w = torch.zeros(1, k + n, dtype=torch.int32), torch.zeros(1, k + n, dtype=torch.float32)
        mt.moe_decode(torch.zeros(1, H, dtype=torch.bfloat16), ids, w, gate_up, down, shared_expert=shared,
                      summed=False)


def qmatmul_cases():
    """The quantized linears (`kernels/qmatmul`) at a Qwen3-Next projection's shape (2048 -> 4096 and back): the GEMV
    at 1 row, the tensor-core GEMM at 16 and 64."""
    import torch

    from sluice.kernels.qmatmul import gemm, triton as qmm

    qmm.check_activations = lambda x, qt: None  # CPU tensors stand in for the GPU's (this process compiles only)
    for N, K in ((4096, 2048), (2048, 4096)):
        qt = _q(N, K)
        qmm.qgemv(torch.zeros(1, K, dtype=torch.bfloat16), qt)
        for M in (16, 64):
            gemm.qmatmul(torch.zeros(M, K, dtype=torch.bfloat16), qt)


CASES = {"mla": mla_cases, "moe": moe_cases, "qmatmul": qmatmul_cases}


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sm90: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    names = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    why = supported()
    if why:
        print(f"sm90: this Triton cannot be driven so: {why}", file=sys.stderr)
        return 77  # (the test skips)
    failed = 0
    for name in names:
        with compile_only() as compiled:
            CASES[name]()
        seen = set()
        for kernel_name, kernel in compiled:
            key = (kernel_name, kernel.hash)
            if key in seen:
                continue
            seen.add(key)
            r = resources(kernel)
            bad = r["shared"] > SHARED_MAX  # (a spill is reported, not failed: Triton versions differ there)
            failed += bad
            print(f"{'FAIL' if bad else 'ok  '} {name}: {kernel_name} shared {r['shared']} B, registers "
                  f"{r['registers']}, spills {r['spills']} B")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
