"""Tensor parallelism on several GPUs (issue #44): one config's decode on 1 GPU and on N, in one run. Per size and
batch (distinct prompts, sampled tokens, `Model.bench`): decode tok/s, the per-GPU HBM floor (rank 0's shard: the
bytes each GPU reads), and the time one decode step spends in collectives (rank 0's kernels over a few profiled
steps: NCCL's all-reduces and all-gathers, beside the step's whole kernel time).

    python -m benchmarks run tp_gpu --config benchmarks/configs/qwen3-next-80b-a3b.json --sizes 1,2 --batches 1,64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

import sluice
from benchmarks.registry import checkpoint

COLLECTIVE = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "cross_device_reduce", "multimem")


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def step_kernels(model, batch: int, steps: int = 8, prompt_tokens: int = 64) -> dict:
    """Rank 0's kernel time per decode step (ms), all of it and the collectives', over `steps` profiled steps of
    `batch` sequences decoding (sampled) after their prompts are in."""
    from torch.profiler import ProfilerActivity, profile

    engine = model.engine
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), generator=g).tolist()
    seqs = [engine.add_request(p, max_tokens=steps + 16, stop_ids=(), temperature=1.0, seed=i)
            for i, p in enumerate(prompts)]
    try:
        while not all(s.prefilled == len(s.prompt) for s in seqs) or min(len(s.output) for s in seqs) < 2:
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        for s in seqs:
            engine.abort(s)
        while engine.has_work():
            engine.step()
    total = comm = 0.0
    top: dict[str, float] = {}
    for evt in prof.key_averages():
        us = _device_us(evt)
        total += us
        if any(c in evt.key.lower() for c in COLLECTIVE):
            comm += us
            top[evt.key[:80]] = top.get(evt.key[:80], 0.0) + us
    return {"kernel_ms_per_step": total / steps / 1e3, "collective_ms_per_step": comm / steps / 1e3,
            "collectives": {k: v / steps / 1e3 for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:6]}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, each loaded in turn")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (gloo ranks, no profile)")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="also each size > 1 with the routed experts split whole (expert parallel)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    gpu = args.device == "cuda"
    if gpu and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--sizes {args.sizes}: {torch.cuda.device_count()} GPUs visible")
    rows = []
    figures = {"config": args.config, "gpu": torch.cuda.get_device_name() if gpu else None,
               "gpus": torch.cuda.device_count() if gpu else 0, "rows": rows}
    runs = [(size, False) for size in sizes]
    runs += [(size, True) for size in sizes if size > 1 and args.expert_parallel]
    for size, ep in runs:
        t0 = time.perf_counter()
        model = sluice.load(args.config, load_format="dummy", device=args.device, tensor_parallel=size,
                            expert_parallel=ep, kv_cache=args.kv_cache, max_batch=max(batches))
        load_s = time.perf_counter() - t0
        print(f"tensor_parallel={size}{' (experts whole)' if ep else ''}: loaded in {load_s:.1f} s, "
              f"{model.info()['weight_bytes'] / 1e9:.1f} GB a GPU", flush=True)
        try:
            for batch in batches:
                prompt, gen = (512, 64) if batch == 1 else (128, 32)
                if not gpu:  # a smoke run
                    prompt, gen = 16, 4
                r = model.bench(prompt_tokens=prompt, gen_tokens=gen, batch=batch, repeats=2 if gpu else 1)
                r.update(tensor_parallel=size, expert_parallel=ep, load_s=load_s)
                r.update(step_kernels(model, batch) if gpu else {"kernel_ms_per_step": 0.0,
                                                                 "collective_ms_per_step": 0.0, "collectives": {}})
                r.setdefault("floor_decode_tok_s", float("nan"))
                rows.append(r)
                checkpoint(figures)
                print(json.dumps({k: r.get(k) for k in ("tensor_parallel", "expert_parallel", "batch", "decode_tok_s",
                                                         "floor_decode_tok_s", "kernel_ms_per_step",
                                                         "collective_ms_per_step", "ttft_warm_s")}), flush=True)
        finally:
            model.close()
            del model
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    one = {r["batch"]: r["decode_tok_s"] for r in rows if r["tensor_parallel"] == 1}
    print(f"\n{args.config}, {figures['gpu']}, distinct prompts, sampled tokens")
    print(f"{'TP':>3s} {'MoE':>7s} {'batch':>5s} {'decode t/s':>10s} {'vs 1 GPU':>8s} {'floor t/s':>9s} "
          f"{'of floor':>8s} {'step ms':>8s} {'in coll.':>8s} {'TTFT warm':>9s}")
    for r in rows:
        rate = r["decode_tok_s"] or 0.0
        base = one.get(r["batch"])
        moe = "experts" if r["expert_parallel"] else "sliced"
        print(f"{r['tensor_parallel']:3d} {moe:>7s} {r['batch']:5d} {rate:10.1f} "
              f"{(f'{rate / base:.2f}x' if base else '-'):>8s} {r['floor_decode_tok_s']:9.0f} "
              f"{rate / r['floor_decode_tok_s']:8.1%} {r['kernel_ms_per_step']:8.3f} "
              f"{r['collective_ms_per_step']:8.3f} {r['ttft_warm_s']:9.3f}")
    return figures
