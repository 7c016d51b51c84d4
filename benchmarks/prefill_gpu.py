"""Prefill on the GPU machine (issue #29): time to first token and prefill tokens/s of one prompt, for several
prefill chunk sizes (the prompt tokens one step's forward takes), and the peak GPU memory of each.

    PYTHONPATH=src python -m benchmarks run prefill_gpu --config benchmarks/configs/qwen3-next-80b-a3b.json \\
        --prompts 4096 --chunks 512,2048,4096,8192 --json out.json

A dummy-weight model of the config, distinct random prompts (`Model.bench`: TTFT warm is the second of two runs).
"""

from __future__ import annotations

import argparse
import json

import torch

import sluice

from .engine_gpu import kernel_profile


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="benchmarks/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--prompts", default="4096")
    ap.add_argument("--chunks", default="512,2048,4096,8192")
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--profile", action="store_true", help="then the kernels of one prefill at the last chunk")
    args = ap.parse_args(argv)
    base = sluice.load(args.config, load_format="dummy", device="cuda", kv_cache=args.kv_cache, max_batch=1)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        model = base.with_engine(prefill_chunk=chunk)
        for prompt in (int(p) for p in args.prompts.split(",")):
            torch.cuda.reset_peak_memory_stats()
            r = model.bench(prompt_tokens=prompt, gen_tokens=2, batch=1, repeats=2)
            rows.append({"prefill_chunk": chunk, "prompt_tokens": prompt, "kv_cache": args.kv_cache,
                         "ttft_warm_s": r["ttft_warm_s"], "prefill_tok_s": r["prefill_tok_s"],
                         "peak_gb": torch.cuda.max_memory_allocated() / 1e9})
            print(json.dumps(rows[-1]), flush=True)
        if args.profile and chunk == int(args.chunks.split(",")[-1]):
            prompt = int(args.prompts.split(",")[-1])
            prof = kernel_profile(lambda: model.bench(prompt_tokens=prompt, gen_tokens=1, batch=1, repeats=1), 20)
            print(f"\nkernels of one {prompt}-token prefill, chunk {chunk} (and one decode step): {prof['kernels']} "
                  f"launches, span {prof['span_ms']:.1f} ms = {prof['busy_ms']:.1f} ms with a kernel running + "
                  f"{prof['gap_ms']:.1f} ms of gaps")
            for r in prof["top"]:
                print(f"  {r['wall_ms']:8.2f} ms {r['calls']:6d}x  {r['kernel']}")
            rows[-1]["profile"] = prof
        model._engine = None
        torch.cuda.empty_cache()
    print(f"\n{'chunk':>6s} {'prompt':>7s} {'TTFT warm':>10s} {'prefill t/s':>11s} {'peak GB':>8s}")
    for r in rows:
        print(f"{r['prefill_chunk']:6d} {r['prompt_tokens']:7d} {r['ttft_warm_s']:10.3f} {r['prefill_tok_s']:11.0f} "
              f"{r['peak_gb']:8.1f}")
    return {"config": args.config, "gpu": torch.cuda.get_device_name(), "rows": rows}
