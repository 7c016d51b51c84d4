"""Running decodes while a long prompt joins (issue #29): the inter-token latency of a batch of decoding sequences
before and while a long prompt prefills in chunks beside them, and that prompt's time to first token, for each
`decode_prefill_chunk` given (the prompt tokens a step prefills at most while sequences decode in it).

    PYTHONPATH=src python -m benchmarks run long_prompt_join --model benchmarks/configs/qwen3-next-80b-a3b.json \\
        --load-format dummy --running 8 --prompt-tokens 32768 --decode-prefill-chunk 256 512 1024 --json out.json

Steps are timed on the host around `Engine.step()` with the device synchronised before and after (with overlap a
step returns while the one it launched still runs). The issue's bar: p99 inter-token latency while the prompt joins
<= 5x the batch's normal step. The table of all settings is printed last.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

import sluice


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def join(model, args, prompt_tokens: int, profile: bool = False) -> dict:
    """One run: `args.running` sequences decode, then a prompt of prompt_tokens joins; the steps before and while it
    prefills. profile: print the kernels and host time of the ninth step of the join."""
    engine, vocab = model.engine, model.config.vocab_size
    prefill_chunk = model.engine_config.prefill_tokens(model.device)
    decode_prefill_chunk = model.engine_config.prefill_tokens(model.device, decoding=True)
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    long_len = prompt_tokens
    budget = -(-long_len // decode_prefill_chunk) + args.normal_steps * 2 + 64  # decode tokens the batch will need
    running = [engine.add_request(torch.randint(0, vocab, (32,), generator=g).tolist(), max_tokens=budget,
                                  stop_ids=()) for _ in range(args.running)]
    while any(s.status != "decoding" for s in running):
        engine.step()

    def timed_step():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - t

    normal = [timed_step() for _ in range(args.normal_steps)]
    gc_before = [s["collections"] for s in gc.get_stats()]
    mem_before = torch.cuda.memory_stats() if model.device.type == "cuda" else {}
    prompt = torch.randint(0, vocab, (long_len,), generator=g).tolist()
    t0 = time.perf_counter()
    joiner = engine.add_request(prompt, max_tokens=1, stop_ids=())
    joined, beside = [], 0  # beside: steps that prefilled part of the prompt while the batch decoded
    while joiner.status != "decoding" and not joiner.finished:
        before = joiner.prefilled or 0
        if profile and len(joined) == 8:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                joined.append(timed_step())
            events = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in events) / 1e3
            print(f"one mixed step ({1e3 * joined[-1]:.1f} ms on the host clock; kernels {gpu:.1f} ms):")
            print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
            print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
        else:
            joined.append(timed_step())
        beside += (joiner.prefilled or 0) > before and all(s.status == "decoding" for s in running)
    ttft = time.perf_counter() - t0
    for s in running:
        engine.abort(s)
    while engine.has_work():
        engine.step()
    row = {"prefill_chunk": prefill_chunk, "decode_prefill_chunk": decode_prefill_chunk,
           "normal_step_ms": {"p50": 1e3 * percentile(normal, 50), "p99": 1e3 * percentile(normal, 99)},
           "join_step_ms": {"p50": 1e3 * percentile(joined, 50), "p99": 1e3 * percentile(joined, 99),
                            "max": 1e3 * max(joined)},
           "join_steps": len(joined), "prefill_steps_beside_decodes": beside, "ttft_s": ttft,
           "prefill_tok_s": long_len / ttft, "join_series_ms": [round(1e3 * t, 2) for t in joined],
           "gc_collections": [s["collections"] - b for s, b in zip(gc.get_stats(), gc_before)]}
    if mem_before:
        after = torch.cuda.memory_stats()
        row["cuda_mallocs"] = after["segment.all.allocated"] - mem_before["segment.all.allocated"]
        row["cuda_alloc_retries"] = after["num_alloc_retries"] - mem_before["num_alloc_retries"]
    row["p99_over_normal"] = row["join_step_ms"]["p99"] / row["normal_step_ms"]["p50"]
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--running", type=int, default=8, help="sequences decoding when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens a step prefills at most (default: the engine's, 4096 on a GPU)")
    ap.add_argument("--decode-prefill-chunk", type=int, nargs="+", default=[None], metavar="N",
                    help="prompt tokens a step prefills at most while sequences decode in it; several: one run each "
                         "(default: the engine's, 512)")
    ap.add_argument("--normal-steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print the kernels and host time of one mixed step")
    args = ap.parse_args(argv)
    # positions for the long prompt from the start: a pool sized to the running batch could only grow once it ends
    base = sluice.load(args.model, load_format=args.load_format, device=args.device, kv_cache=args.kv_cache,
                       max_batch=args.running + 1, max_seq_len=args.prompt_tokens + 1024,
                       prefill_chunk=args.prefill_chunk)
    rows = []
    for decode_prefill_chunk in args.decode_prefill_chunk:
        model = base.with_engine(decode_prefill_chunk=decode_prefill_chunk)
        # a short join first: the kernels a mixed step runs are compiled before the timed one
        join(model, args, 4 * model.engine_config.prefill_tokens(model.device, decoding=True))
        r = join(model, args, args.prompt_tokens, profile=args.profile)
        rows.append(r)
        print(f"decode_prefill_chunk {r['decode_prefill_chunk']}: join p99 {r['join_step_ms']['p99']:.1f} ms "
              f"({r['p99_over_normal']:.1f}x normal), TTFT {r['ttft_s']:.2f} s", file=sys.stderr, flush=True)
        if base.device.type == "cuda":
            torch.cuda.empty_cache()  # the last run's cache pool and graphs
    out = {"model": args.model, "device": str(base.device), "running": args.running,
           "prompt_tokens": args.prompt_tokens, "kv_cache": args.kv_cache, "rows": rows}
    print(f"{args.running} decoding on {base.device}, a {args.prompt_tokens}-token prompt joins ({args.kv_cache} KV): "
          "steps in ms; the prompt prefills in chunks of `beside` tokens while the others decode (`mixed`: the steps "
          "that did both)")
    print(f"{'chunk':>6s} {'beside':>6s} {'normal p50':>10s} {'join p50':>9s} {'join p99':>9s} {'join max':>9s} "
          f"{'p99/normal':>10s} {'steps':>6s} {'mixed':>6s} {'TTFT s':>7s} {'prefill tok/s':>13s}")
    for r in rows:
        n, j = r["normal_step_ms"], r["join_step_ms"]
        print(f"{r['prefill_chunk']:6d} {r['decode_prefill_chunk']:6d} {n['p50']:10.1f} {j['p50']:9.1f} "
              f"{j['p99']:9.1f} {j['max']:9.1f} {r['p99_over_normal']:10.1f} {r['join_steps']:6d} "
              f"{r['prefill_steps_beside_decodes']:6d} {r['ttft_s']:7.2f} {r['prefill_tok_s']:13.0f}", flush=True)
    return out
