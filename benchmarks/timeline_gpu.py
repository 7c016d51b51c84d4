"""Where a decode step's time goes: every kernel's start and end (µs, from the first kernel of the call) under
CUDA-graph replay, read from the CUDA profiler (CUPTI), for

- the MoE decode layer (the multi-launch decode) at both models' shapes, 8-bit router;
- decode attention at 4k context, batch 1, and 32k, batch 1 and 16, dense bf16 and TurboQuant caches, both shapes of
  `attention_gpu.py` (the kernel and its merge; TurboQuant q rotated beforehand).

    python benchmarks/timeline_gpu.py [--json out.json] [--only moe|attention]

Each case is captured as a graph of `COPIES` calls on their own buffers (cold L2: the timeline printed is the
last call's) and replayed behind a busy GPU. Gaps between one kernel's end and the next one's start are the
launch and dependency costs; kernels that overlap ran concurrently.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmatmul_gpu import LEAD_CYCLES, capture_graph, end_run, start_run  # noqa: E402

COPIES = 4


def kernel_timeline(calls):
    """[(name, start µs, end µs)] of the last call's kernels in one replay of a graph of `calls`, in start order;
    the number of kernels a call launches is found from a replay of the first call alone."""
    from torch.profiler import ProfilerActivity, profile

    def record(fns):
        g = capture_graph(fns)
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(LEAD_CYCLES)
            g.replay()
            torch.cuda.synchronize()
        ks = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name]
        return sorted(ks, key=lambda k: k[1])

    per_call = len(record(calls[:1]))
    last = record(calls)[-per_call:]
    t0 = last[0][1]
    return [(n, s - t0, e - t0) for n, s, e in last]


def show(res, label, timeline):
    res["timelines"].append({"case": label, "kernels": [{"name": n, "start_us": s, "end_us": e}
                                                         for n, s, e in timeline]})
    print(f"\n{label}: {timeline[-1][2]:.1f} us from the first kernel's start to the last one's end", flush=True)
    for n, s, e in timeline:
        print(f"  {s:7.2f} {e:7.2f} {e - s:6.2f}  {n[:90]}", flush=True)


def moe(res):
    from moe_gpu import MODELS, build_layers

    for name, (H, E, I, k, Is) in MODELS.items():
        layers = [build_layers(H, E, I, k, Is)["8-bit"] for _ in range(COPIES)]
        xs = [torch.randn(1, H, device="cuda", dtype=torch.bfloat16) for _ in layers]
        show(res, f"MoE decode {name}", kernel_timeline([lambda m=m, x=x: m(x) for m, x in zip(layers, xs)]))
        del layers
        torch.cuda.empty_cache()


def attention(res):
    from attention_gpu import SHAPES, make_cache, ours

    from sluice.kernels.turboquant.triton import rotate

    for name, (Hq, Hkv, D) in SHAPES.items():
        for S, B in ((4096, 1), (32768, 1), (32768, 16)):
            g = torch.Generator(device="cuda").manual_seed(B)
            q = torch.randn(B, Hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
            pos = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
            for quant in (False, True):
                caches = [make_cache(B, Hkv, S, D, quant, g) for _ in range(1 if B == 16 else COPIES)]
                qq = rotate(q) if quant else q
                show(res, f"attention {name} {S // 1024}k B={B} {'TurboQuant (q rotated)' if quant else 'bf16'}",
                     kernel_timeline([lambda c=c: ours(qq, c, pos, D ** -0.5, S, quant, rotated=quant)
                                      for c in caches]))
                del caches
                torch.cuda.empty_cache()


def main():
    a, dev, res = start_run("timelines", "errors", values=("--only",))
    for part, fn in (("moe", moe), ("attention", attention)):
        if a.only in (None, part):
            fn(res)
    end_run(a, res)


if __name__ == "__main__":
    main()
