"""Compile our Triton kernels for sm_90 (H100/H200) on a machine without a GPU and print what ptxas reports:
registers, spill bytes, shared memory. Costs no device time; run it before a device run.

    PYTHONPATH=/path/to/triton-3.6 python benchmarks/sm90_resources.py [gdn | attention | decode | gemv]

`attention` also prints the instruction mix of each decode kernel's longest loop (SASS, cuobjdump): per position
of a block, what the kernel must issue whatever the memory does.

Use the Triton version the device has (3.6 there: unpack its wheel and put it first on PYTHONPATH); 3.9 picks
other layouts. A kernel is compiled with the exact arguments the wrapper would launch it with: the launches are
captured (CPU tensors stand in for CUDA ones), not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int16: "i16"}


class Capture:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the launch instead."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def compile_launch(fn, args, kw, want_sass=False):
    """ptxas's report for one captured launch: (registers, spill bytes, shared bytes), and its SASS text after
    them with want_sass."""
    kw = dict(kw)
    kw.pop("launch_pdl", None)  # a launch option, not a compile one
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    names = [n for n in fn.arg_names if n not in kw]
    signature, attrs = {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        idx = fn.arg_names.index(name)
        if torch.is_tensor(a):
            signature[name] = "*" + _TYPES[a.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool) or isinstance(a, int):
            signature[name] = "i32" if abs(a) < 2 ** 31 else "i64"
            if a % 16 == 0 and a:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    for name in kw:
        signature[name] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=kw, attrs=attrs)
    backend = triton.compiler.make_backend(TARGET)
    ck = triton.compile(src, target=TARGET, options=backend.parse_options(opts).__dict__)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ck.asm["ptx"])
    out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    if not want_sass:
        return regs, spills, ck.metadata.shared
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    sass = subprocess.run([str(ptxas.parent / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return regs, spills, ck.metadata.shared, sass


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch and everything from its target to it)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def opcode_mix(body: list[str], top: int = 12) -> str:
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return ", ".join(f"{k} {v}" for k, v in ops.most_common(top))


def gdn():
    from sluice.kernels.gdn import triton as gt

    gt.INTERPRET = False
    rows = []
    for dtype, K, configs in ((torch.bfloat16, 128, [(32, (4, 4), 2), (32, (4, 4), 1), (16, (4, 4), 2),
                                                     (16, (8, 4), 1), (64, (4, 4), 2), (32, (4, 8), 2)]),
                              (torch.bfloat16, 256, [(32, (4, 4), 2), (16, (4, 4), 2)]),
                              (torch.float32, 128, [(32, (4, 4), 1)]), (torch.float32, 256, [(32, (4, 4), 1)]),
                              (torch.float16, 256, [(32, (8, 4), 1)])):
        T, Hk, Hv = 256, 2, 4
        for bv, warps, stages in configs:
            prep, scan = Capture(gt._chunk_prep_kernel), Capture(gt._chunk_scan_kernel)
            real = gt._chunk_prep_kernel, gt._chunk_scan_kernel
            gt._chunk_prep_kernel, gt._chunk_scan_kernel = prep, scan
            try:
                x = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
                gt.chunk_gated_delta_rule(x(1, T, Hk, K), x(1, T, Hk, K), x(1, T, Hv, K), torch.randn(1, T, Hv),
                                          torch.randn(1, T, Hv), torch.zeros(1, Hv, K, K), torch.randn(Hv),
                                          torch.randn(Hv), block_v=bv, num_warps=warps, num_stages=stages)
            finally:
                gt._chunk_prep_kernel, gt._chunk_scan_kernel = real
            for cap in (prep, scan):
                (grid, args, kw), = cap.launches
                try:
                    r = compile_launch(cap.fn, args, kw)
                except Exception as e:  # noqa: BLE001 - report and go on
                    r = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append((cap.fn.__name__, str(dtype)[6:], K, bv, kw.get("num_warps"), kw.get("num_stages"), r))
                print(*rows[-1], flush=True)
    print(f"\n{'kernel':22s} {'dtype':9s} {'K':>4s} {'BV':>3s} {'warps':>5s} {'stages':>6s}  regs spill shared")
    for name, dt, K, bv, w, s, r in rows:
        res = f"{r[0]:4d} {r[1]:5d} {r[2]:6d}" if isinstance(r, tuple) else r
        print(f"{name:22s} {dt:9s} {K:4d} {bv:3d} {w!s:>5s} {s!s:>6s}  {res}")


def _capture_all(module, names, call):
    """Run `call` with the named kernels of `module` captured; [(name, launch)]."""
    caps = {n: Capture(getattr(module, n)) for n in names}
    real = {n: getattr(module, n) for n in names}
    for n, c in caps.items():
        setattr(module, n, c)
    try:
        call()
    finally:
        for n, f in real.items():
            setattr(module, n, f)
    return [(n, c.fn, launch) for n, c in caps.items() for launch in c.launches]


def attention():
    """The decode-attention kernels (dense bf16 and TurboQuant) and the quantize-on-append kernel."""
    from sluice.kernels.attention import triton as at
    from sluice.kernels.turboquant import triton as tqt

    at_names = ["_decode_split_kernel", "_merge_splits_kernel"]
    tqt.INTERPRET = False
    rows = []
    for Hq, Hkv, D in ((16, 2, 256), (32, 8, 128), (9, 3, 64)):
        B, S = 1, 512
        q = torch.randn(B, Hq, D).to(torch.bfloat16)
        pos = torch.tensor([S - 1], dtype=torch.int32)
        kv = torch.randn(B, Hkv, S, D).to(torch.bfloat16)
        codes = torch.zeros(B, Hkv, S, D // 2, dtype=torch.uint8)
        sc, ring = torch.zeros(B, Hkv, S), torch.zeros(B, Hkv, 64, D, dtype=torch.bfloat16)
        launches = _capture_all(at, at_names, lambda: at.decode_attention(q, kv, kv, pos, 0.1, S, splits=4))
        launches += _capture_all(at, at_names, lambda: at.decode_attention(
            q.float(), codes, codes.reshape(B, Hkv, S // 4, D // 2, 4), pos, 0.1, S, splits=4, k_scale=sc,
            v_scale=sc, k_recent=ring, v_recent=ring))
        launches += _capture_all(tqt, ["_append_kernel"],
                                 lambda: tqt.quantize_append(kv[:, :, 0], codes, sc, ring, torch.full((B,), 3, dtype=torch.int32)))
        for name, fn, (grid, args, kw) in launches:
            if name == "_decode_split_kernel":
                kw = dict(kw, TC=True)  # the tensor-core path, as on a GPU
            try:
                r = compile_launch(fn, args, kw, want_sass=name == "_decode_split_kernel")
            except Exception as e:  # noqa: BLE001 - report and go on
                r = f"{type(e).__name__}: {str(e)[:200]}"
            if isinstance(r, tuple) and len(r) == 4:
                body, bn, warps = longest_loop(r[3]), kw["BLOCK_N"], kw["num_warps"]
                print(f"  longest loop: {len(body)} instructions per warp for {bn} positions = "
                      f"{len(body) * warps / bn:.1f} warp instructions per position; {opcode_mix(body)}")
                r = r[:3]
            rows.append((f"{name} QUANT={kw.get('QUANT', '-')}", f"{Hq}/{Hkv}", D, r))
            print(*rows[-1], flush=True)
    print(f"\n{'kernel':36s} {'heads':>6s} {'D':>4s}  regs spill shared")
    for name, heads, D, r in rows:
        res = f"{r[0]:4d} {r[1]:5d} {r[2]:6d}" if isinstance(r, tuple) else r
        print(f"{name:36s} {heads:>6s} {D:4d}  {res}")


def decode():
    """The multi-launch MoE decode (x prep, router GEMV, route, expert GEMVs with the shared expert as a slot,
    SwiGLU prep, combine) at the Qwen3.5 shape: every distinct launch compiles."""
    from sluice.kernels.moe import triton as mt
    from sluice.kernels.qmatmul import triton as qt
    from sluice.quant.affine import QuantizedTensor

    def q(E, N, K, bits=4, gs=64):
        parts = (torch.zeros(1, N, K * bits // 32, dtype=torch.int32), torch.zeros(1, N, K // gs).bfloat16(),
                 torch.zeros(1, N, K // gs).bfloat16())
        return QuantizedTensor(*(t.expand(E, *t.shape[1:]) if E else t[0] for t in parts), bits, gs)

    H, I, E, k = 4096, 1024, 512, 10
    gate_up, down, pair = q(E, 2 * I, H), q(E, H, I), (q(0, 2 * I, H), q(0, H, I))

    def run():
        x = torch.zeros(1, H).bfloat16()
        logits = qt.qgemv_partials(x, q(0, E + 1, H, 8))
        ids, w = mt.route(logits[..., :E], k, True, logits[..., E])
        mt.moe_decode(x, ids, w, gate_up, down, shared_expert=pair)

    interp, qt.INTERPRET = qt.INTERPRET, True  # passes the device checks; the kernel flags are set below
    inner = []
    try:
        launches = _capture_all(qt, ["_prep_x_kernel", "_gemv_kernel"], lambda: inner.extend(_capture_all(
            mt, ["_route_kernel", "_combine_kernel"], run)))
        launches += inner
    finally:
        qt.INTERPRET = interp
    seen = set()
    for name, fn, (grid, args, kw) in launches:
        kw = dict(kw, **{f: True for f in ("ASM", "PDL") if f in kw})  # PREFETCH as the wrapper chose
        key = (name, tuple(sorted((a, str(b)) for a, b in kw.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            r = compile_launch(fn, args, kw)
        except Exception as e:  # noqa: BLE001 - report and go on
            r = f"{type(e).__name__}: {str(e)[-1500:]}"
        flags = " ".join(f for f in ("INDEXED", "EXTRA", "SWIGLU") if kw.get(f))
        print(f"{name:16s} {flags:28s} grid {grid}: {r}", flush=True)


def gemv():
    """The dense M = 1 GEMV at the benchmark's Qwen3-Next shapes: x prepared by its own launch or in the GEMV
    (RAW_X), the first step's weights asked of L2 or loaded into registers before the wait (PREFETCH 1 / 2);
    registers and the instruction mix of the steps' loop."""
    from sluice.kernels.qmatmul import triton as qt
    from sluice.quant.affine import QuantizedTensor

    for N, K, bits, gs in ((16384, 2048, 4, 64), (2048, 512, 4, 64), (4096, 4096, 8, 64), (4096, 4096, 2, 32)):
        w = QuantizedTensor(torch.zeros(N, K * bits // 32, dtype=torch.int32).view(torch.uint32),
                            torch.zeros(N, K // gs).bfloat16(), torch.zeros(N, K // gs).bfloat16(), bits, gs)
        for raw in (False, True) if qt.raw_x_supported(bits, gs) else (False,):
            for block_n in (4, 8):
                interp, qt.INTERPRET = qt.INTERPRET, True
                try:
                    launches = _capture_all(qt, ["_gemv_kernel", "_prep_x_kernel"], lambda: qt.qgemv(
                        torch.zeros(1, K).bfloat16(), w, block_n=block_n, raw_x=raw))
                finally:
                    qt.INTERPRET = interp
                (name, fn, (grid, args, kw)), = [la for la in launches if la[0] == "_gemv_kernel"]
                for prefetch in (1, 2):
                    kw = dict(kw, ASM=True, PDL=True, PREFETCH=prefetch)
                    try:
                        r = compile_launch(fn, args, kw, want_sass=True)
                        body = longest_loop(r[3])
                        r = f"regs {r[0]} spill {r[1]}; loop {len(body)}: {opcode_mix(body)}"
                    except Exception as e:  # noqa: BLE001 - report and go on
                        r = f"{type(e).__name__}: {str(e)[-1500:]}"
                    print(f"{N}x{K} {bits}-bit g{gs} RAW_X={raw} BLOCK_N={block_n} PREFETCH={prefetch}: {r}",
                          flush=True)


if __name__ == "__main__":
    {"gdn": gdn, "attention": attention, "decode": decode, "gemv": gemv}[sys.argv[1] if len(sys.argv) > 1 else "gdn"]()
