"""Running decodes while a long prompt joins (issue #29): the inter-token latency of a batch of decoding sequences
before and while a long prompt prefills in chunks beside them, and that prompt's time to first token.

    PYTHONPATH=src python benchmarks/long_prompt_join.py --model benchmarks/configs/qwen3-next-80b-a3b.json \\
        --load-format dummy --running 8 --prompt-tokens 32768 --prefill-chunk 512 --json out.json

Steps are timed on the host around `Engine.step()` with the device synchronised before and after (with overlap a
step returns while the one it launched still runs). The issue's bar: p99 inter-token latency while the prompt joins <= 5x the batch's normal step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sluice


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--running", type=int, default=8, help="sequences decoding when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--normal-steps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = sluice.load(args.model, load_format=args.load_format, device=args.device, kv_cache=args.kv_cache,
                        max_batch=args.running + 1, prefill_chunk=args.prefill_chunk)
    engine, vocab = model.engine, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    long_len = args.prompt_tokens
    budget = long_len // args.prefill_chunk + args.normal_steps * 2 + 64  # decode tokens the batch will need
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
    prompt = torch.randint(0, vocab, (long_len,), generator=g).tolist()
    t0 = time.perf_counter()
    joiner = engine.add_request(prompt, max_tokens=1, stop_ids=())
    joined = []
    while joiner.status != "decoding" and not joiner.finished:
        joined.append(timed_step())
    ttft = time.perf_counter() - t0
    for s in running:
        engine.abort(s)
    while engine.has_work():
        engine.step()
    out = {"model": args.model, "device": str(model.device), "running": args.running, "prompt_tokens": long_len,
           "prefill_chunk": args.prefill_chunk, "kv_cache": args.kv_cache,
           "normal_step_ms": {"p50": 1e3 * percentile(normal, 50), "p99": 1e3 * percentile(normal, 99)},
           "join_step_ms": {"p50": 1e3 * percentile(joined, 50), "p99": 1e3 * percentile(joined, 99),
                            "max": 1e3 * max(joined)},
           "join_steps": len(joined), "ttft_s": ttft, "prefill_tok_s": long_len / ttft}
    out["p99_over_normal"] = out["join_step_ms"]["p99"] / out["normal_step_ms"]["p50"]
    print(f"{args.running} decoding, a {long_len}-token prompt joins in chunks of {args.prefill_chunk}: normal step "
          f"p50 {out['normal_step_ms']['p50']:.1f} ms; while it prefills p50 {out['join_step_ms']['p50']:.1f} ms, "
          f"p99 {out['join_step_ms']['p99']:.1f} ms ({out['p99_over_normal']:.1f}x normal); its TTFT "
          f"{ttft:.2f} s ({out['prefill_tok_s']:.0f} tok/s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
