"""End-to-end engine speed on the GPU machine: `Model.bench` (what `sluice bench` prints) on a dummy-weight model of a
real config, dense and TurboQuant KV, batch 1 with graphs and eagerly, and batches of distinct prompts; the HBM floor
beside each figure, and the kernels of each batch's replayed decode step.

    PYTHONPATH=src python -m benchmarks run engine_gpu --config benchmarks/configs/qwen3-next-80b-a3b.json \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sluice
from sluice.engine.bench import copy_bandwidth

from .registry import checkpoint


def profile_graph(graph, top: int = 14) -> dict:
    """The kernels of one replay of a captured decode step (`kernel_profile`)."""
    graph.replay()
    torch.cuda.synchronize()
    return kernel_profile(graph.replay, top)


def kernel_profile(run, top: int = 14, sequence_len: int = 60) -> dict:
    """The kernels that run() launches: the launch count, and where the wall time goes: each kernel charged only
    the time no earlier kernel covers (so the charges add up to the busy time whatever overlaps, as programmatic
    dependent launch makes them), the gaps with no kernel running, and the span from the first kernel's start to
    the last one's end; and the first `sequence_len` kernels in order (a decode step's first layers)."""
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    charged, calls, covered = {}, {}, kernels[0][0]
    for start, end, name in kernels:
        charged[name] = charged.get(name, 0.0) + max(0.0, end - max(start, covered))
        calls[name] = calls.get(name, 0) + 1
        covered = max(covered, end)
    span = covered - kernels[0][0]
    busy = sum(charged.values())
    sequence, end = [], kernels[0][0]  # the first kernels in order: each one's time and the gap before it
    for start, stop, name in kernels[:sequence_len]:
        sequence.append({"kernel": name[:48], "us": stop - start, "gap_us": start - end})
        end = max(end, stop)
    rows = sorted(({"kernel": k, "wall_ms": v / 1e3, "calls": calls[k]} for k, v in charged.items()),
                  key=lambda r: -r["wall_ms"])
    return {"kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": busy / 1e3, "gap_ms": (span - busy) / 1e3,
            "top": rows[:top], "sequence": sequence}


def step_anatomy(model, batch: int, steps: int = 12, context: int = 128) -> dict:
    """Where a steady decode step of `batch` distinct sequences goes: the step (what the engine user waits), the
    model runner's part (graph replay plus waiting for it), the host's part around it, and the host functions that
    take the most of it (cProfile)."""
    import cProfile
    import io
    import pstats

    engine = model.engine
    g = torch.Generator().manual_seed(2)
    seqs = [engine.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist(),
                               max_tokens=steps + batch + 4, stop_ids=()) for _ in range(batch)]  # (all decode)
    while any(s.status != "decoding" for s in seqs):
        engine.step()
    engine.step()
    runner_s = []
    decode = engine.runner.decode

    def timed(*args):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = decode(*args)
        torch.cuda.synchronize()
        runner_s.append(time.perf_counter() - t)
        return out

    step_s = []
    for _ in range(steps // 2):  # untouched steps first
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
    engine.runner.decode = timed
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps // 2):
        engine.step()
    prof.disable()
    del engine.runner.decode
    for s in seqs:
        engine.abort(s)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    step_ms, runner_ms = 1e3 * sorted(step_s)[len(step_s) // 2], 1e3 * sorted(runner_s)[len(runner_s) // 2]
    return {"batch": batch, "step_ms": step_ms, "runner_ms": runner_ms, "host_rest_ms": step_ms - runner_ms,
            "profile": out.getvalue()[-3000:]}


def replay_ms(graph, n: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def lone_replay_ms(graph, n: int = 20) -> float:
    """GPU time of one replay started on an idle GPU (as the engine's steps start: each waits for the last one's
    tokens), from events around the replay alone: the median of n."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--batches", default="1,8,16,64")
    ap.add_argument("--kinds", default="dense,turboquant4")
    ap.add_argument("--eager", action="store_true", help="also batch 1 without graphs")
    ap.add_argument("--serial", action="store_true", help="also batch 1 without overlap (each step read back at once)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    base = sluice.load(args.config, load_format="dummy", device="cuda", max_batch=128)
    load_s = time.perf_counter() - t0
    info = base.info()
    print(f"loaded {info['weight_bytes'] / 1e9:.1f} GB of dummy weights in {load_s:.1f} s; copy bandwidth "
          f"{copy_bandwidth(base.device) / 1e9:.0f} GB/s", flush=True)

    rows, profiles = [], {}
    for kind in args.kinds.split(","):
        model = base if kind == base.kv_cache else base.with_engine(kv_cache=kind)
        for batch in (int(b) for b in args.batches.split(",")):
            prompt, gen = (512, 64) if batch == 1 else (128, 32)
            r = model.bench(prompt_tokens=prompt, gen_tokens=gen, batch=batch, repeats=2)
            graphs = model.engine.runner._graphs
            if batch in graphs:  # the same step's graph alone: what the engine's per-step host work costs beside it
                r["graph_replay_ms"] = replay_ms(graphs[batch][0])
                r["lone_replay_ms"] = lone_replay_ms(graphs[batch][0])
                profiles[f"{kind} batch {batch}"] = profile_graph(graphs[batch][0])
                anatomy = r["anatomy"] = step_anatomy(model, batch)
                print(f"step anatomy, batch {batch}: step {anatomy['step_ms']:.2f} ms, runner "
                      f"{anatomy['runner_ms']:.2f} ms\n{anatomy['profile']}", flush=True)
            rows.append(r)
            checkpoint(figures(args.config, rows, {}))
            print(json.dumps({k: r.get(k) for k in ("kv_cache", "batch", "graphs", "ttft_cold_s", "ttft_warm_s",
                                                     "prefill_tok_s", "decode_tok_s", "floor_decode_tok_s",
                                                     "graph_replay_ms", "lone_replay_ms")}),
                  flush=True)
        model._engine = None
        torch.cuda.empty_cache()
        if args.serial:
            serial = base.with_engine(kv_cache=kind, overlap=False)
            rows.append({**serial.bench(prompt_tokens=512, gen_tokens=64, batch=1, repeats=2), "overlap": False})
            serial._engine = None
            torch.cuda.empty_cache()
        if args.eager:
            eager = base.with_engine(kv_cache=kind, graphs=False)
            rows.append(eager.bench(prompt_tokens=512, gen_tokens=16, batch=1, repeats=1))
            eager._engine = None
            torch.cuda.empty_cache()
    print(f"\n{'KV':12s} {'batch':>5s} {'graphs':>6s} {'overlap':>7s} {'TTFT cold':>9s} {'TTFT warm':>9s} "
          f"{'prefill t/s':>11s} {'decode t/s':>10s} {'floor t/s':>9s} {'of floor':>8s}")
    for r in rows:
        rate = r["decode_tok_s"] or 0.0  # None: no steady window
        print(f"{r['kv_cache']:12s} {r['batch']:5d} {str(r['graphs']):>6s} {str(r.get('overlap', True)):>7s} "
              f"{r['ttft_cold_s']:9.3f} "
              f"{r['ttft_warm_s']:9.3f} {r['prefill_tok_s']:11.0f} {rate:10.1f} "
              f"{r['floor_decode_tok_s']:9.0f} {rate / r['floor_decode_tok_s']:8.1%}")
    for case, prof in profiles.items():
        print(f"\none replayed decode step, {case}: {prof['kernels']} launches, span {prof['span_ms']:.3f} ms = "
              f"{prof['busy_ms']:.3f} ms with a kernel running + {prof['gap_ms']:.3f} ms of gaps")
        for p in prof["top"]:
            print(f"  {p['wall_ms']:8.3f} ms {p['calls']:5d}x  {p['kernel']}")
        if case.endswith("batch 1"):
            print("  its first kernels in order (us, and the gap before each):")
            for p in prof["sequence"]:
                print(f"    {p['us']:7.2f} {p['gap_us']:+6.2f}  {p['kernel']}")
    return figures(args.config, rows, profiles)


def figures(config, rows, profiles) -> dict:
    """The results so far (checkpointed after every row: a run cut short keeps what it measured)."""
    return {"config": config, "gpu": torch.cuda.get_device_name(), "rows": rows, "profiles": profiles}
