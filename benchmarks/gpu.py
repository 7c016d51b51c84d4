"""What the GPU kernel microbenchmarks share: timing (CUDA events, CUDA-graph replay with a lead so the host's
submission is hidden), the copy-bandwidth and bf16 GEMM floors, a read-only ceiling kernel, random packed weights, and
a run's arguments and result dict (`start_run` / `end_run`)."""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton
import triton.language as tl

from sluice.kernels import launch
from sluice.kernels.qmatmul import triton as qmm
from sluice.quant.affine import QuantizedTensor

L2_BYTES = 60 << 20

LEAD_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host takes to submit what is timed


def events_time(fn, reps=20, warmup=3, lead=False):
    """Median seconds of fn() between two CUDA events. `lead`: the GPU first spins for ~1 ms, so that it is still
    busy when fn's work has been submitted and the interval holds GPU time only; without it, the host's own
    launch time (a graph replay's several µs) lands inside the interval whenever the GPU is idle."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(LEAD_CYCLES)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


GRAPH_MIN_US = 300  # a replay's fixed GPU-side start is shared by at least this much work


def capture_graph(calls):
    """The calls run once (warm-up, compilation), then captured in order into one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def _replay_time(calls, reps, lead):
    return events_time(capture_graph(calls).replay, reps=reps, lead=lead) / len(calls)


def graph_time(calls, reps=20, legacy=False):
    """Seconds per call, each call on its own buffers (cold L2), captured in one CUDA graph and replayed behind a
    busy GPU (`events_time`'s `lead`), so that the host's launch of the replay is not charged to the calls; when
    the calls take less than GRAPH_MIN_US in all, they are repeated (in order) to about that much, so that the
    replay's own start is shared by enough of them. (Not by far more: a replay of many long calls ran an H100
    into its power limit, ~10% slower.) `legacy`: the timing of the runs before 2026-11-25 (the calls once, the
    GPU idle at the start event), which added (replay launch gap) / len(calls) to every call: 1-4 us at 32k
    context, batch 1, in decode attention."""
    if legacy:
        return _replay_time(calls, reps, lead=False)
    t = _replay_time(calls, reps, lead=True)
    if t * len(calls) * 1e6 < GRAPH_MIN_US:
        t = _replay_time(calls * math.ceil(GRAPH_MIN_US / (t * len(calls) * 1e6)), reps, lead=True)
    return t


def copy_bandwidth(dev) -> float:
    """Measured device copy bandwidth, bytes read + written per second (1 GiB each way): the best of three
    medians (one H100 gave 2.76 and 2.97 TB/s in two runs: the higher floor is the honest one)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return max(2 * src.numel() / events_time(lambda: dst.copy_(src)) for _ in range(3))


def bf16_gemm_rate(dev) -> float:
    """Measured bf16 GEMM rate, FLOP/s: an 8192 x 8192 matrix squared by cuBLAS (median of 10); the matrix is
    freed on return."""
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / events_time(lambda: m @ m, reps=10)


READ_WORDS = 4096  # int32 words per program of `_read_kernel` (16 KB: eight 16-byte loads per thread, 4 warps)


@triton.jit
def _read_kernel(w_ptr, out_ptr, n_words, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Read CHUNK words per program and xor them down to one word: a kernel that only reads the bytes, in the
    GEMV's setting (launched with PDL, its reads issued before the dependency wait, its write after)."""
    offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    launch.pdl_start(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(v, axis=0))


def read_ceiling(nbytes: int, n: int) -> float:
    """Seconds per read of `nbytes` by `_read_kernel`, rotating over n buffers (cold L2), graph replay: the time
    any kernel reading these bytes (and nothing else) takes under this timing, launch and drain included."""
    words = -(-nbytes // 4)
    bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda") for _ in range(n)]
    grid = triton.cdiv(words, READ_WORDS)
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    pdl = launch.pdl(out.device)
    return graph_time([lambda b=b: _read_kernel[(grid,)](b, out, words, CHUNK=READ_WORDS, PDL=pdl,
                                                         launch_pdl=pdl, num_warps=4) for b in bufs])


def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(4 * L2_BYTES / nbytes)))


def random_qt(N, K, bits=4, gs=64, device="cuda"):
    """A random quantized weight built directly in the packed layout (quantizing 248k x 4k rows on the CPU would
    take minutes; the kernels only care about the layout)."""
    w = torch.randint(-2**31, 2**31 - 1, (N, K * bits // 32), dtype=torch.int32, device=device)
    s = (torch.rand(N, K // gs, device=device) * 0.02 + 0.001).to(torch.bfloat16)
    b = (torch.randn(N, K // gs, device=device) * 0.05).to(torch.bfloat16)
    return QuantizedTensor(w.view(torch.uint32), s, b, bits, gs)


def qt_bytes(qt):
    return qt.weight.nbytes + qt.scales.nbytes + qt.biases.nbytes


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def start_run(argv, *sections, flags=(), values=()):
    """(arguments (`argv` parsed: the on/off `flags` and the string-valued `values`), the GPU, the result dict: the
    GPU's identity and an empty list per section; the benchmark returns it, the runner writes it)."""
    ap = argparse.ArgumentParser()
    for flag in flags:
        ap.add_argument(flag, action="store_true")
    for value in values:
        ap.add_argument(value, default=None)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    res = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": qmm.triton.__version__, **{name: [] for name in sections}}
    return ap.parse_args(argv), dev, res


def end_run(res):
    """The run's checks and errors printed last (the counterpart of start_run)."""
    for c in res.get("correctness", []):
        print(f"check {c}")
    for msg in res.get("errors", []):
        print(f"ERROR {msg}")
