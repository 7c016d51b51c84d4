"""Paged KV (issue #41): many sequences of mixed lengths in a pool of KV blocks that could not hold them all at
their longest; when the blocks run out, the newest sequence is preempted and resumes later. Every request must
finish.

    python -m benchmarks run paged_kv --model benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy
    python -m benchmarks run paged_kv --sequences 8 --lengths 16,400 --max-tokens 8 --blocks-share 0.3 --page 16
                                                                        # the demo model on the CPU, small

--sequences prompts of lengths log-uniform in --lengths (random ids, seeded), all sent at once, --max-tokens each,
sampled at temperature 1 (seeded); the engine has a row for each and `max_seq_len` the longest length + a reply;
its KV blocks are --blocks-share of what `sequences` rows of `max_seq_len` positions take. Printed and returned: the
blocks, the positions they hold against those the rows layout would need, the whole run's time, prompt and
generated tokens per second, the preemptions, how many requests finished, and the device's peak memory.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time

import torch

import sluice


class _Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.preempted = 0

    def emit(self, record):
        self.preempted += "preempted" in record.getMessage()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=(128, 32768),
                    help="prompt lengths: lo,hi (log-uniform)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks-share", type=float, default=0.25,
                    help="KV blocks as a share of what every row at max_seq_len takes")
    ap.add_argument("--page", type=int, default=None, help="positions a block (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    lo, hi = args.lengths
    lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(args.sequences)]
    max_seq_len = -(-(max(lengths) + args.max_tokens) // 256) * 256
    probe = sluice.load(args.model, load_format=args.load_format, device=args.device, max_batch=1)
    page = args.page or probe.engine_config.page(probe.device) or 256
    blocks = max(-(-max_seq_len // page), int(args.blocks_share * args.sequences * max_seq_len / page))
    model = probe.with_engine(max_batch=args.sequences, max_seq_len=max_seq_len, kv_page=page, kv_blocks=blocks)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    engine = model.engine
    engine.warmup()
    gpu = model.device.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    counter = _Count()
    log = logging.getLogger("sluice.engine")
    log.addHandler(counter)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, max_tokens=args.max_tokens, stop_ids=(), temperature=1.0, seed=i)
            for i, p in enumerate(prompts)]
    engine.run(seqs)
    wall = time.perf_counter() - t0
    log.removeHandler(counter)
    finished = sum(s.finish_reason == "length" and len(s.output) == args.max_tokens for s in seqs)
    table = engine.runner.pool.blocks
    figures = {
        "model": args.model, "sequences": args.sequences, "lengths": [lo, hi], "prompt_tokens": sum(lengths),
        "max_tokens": args.max_tokens, "max_seq_len": max_seq_len, "page": page, "blocks": table.blocks,
        "positions_held": table.blocks * page, "rows_layout_positions": args.sequences * max_seq_len,
        "kv_gib": round(engine.runner.pool.kv.k.nbytes * 2 / 2**30, 2),
        "rows_layout_kv_gib": round(engine.runner.pool.kv.bytes_per_token() * args.sequences * max_seq_len / 2**30,
                                    2),
        "wall_s": round(wall, 3), "prompt_tok_s": round(sum(lengths) / wall, 1),
        "gen_tok_s": round(args.sequences * args.max_tokens / wall, 1), "preemptions": counter.preempted,
        "finished": finished, "ok": finished == args.sequences,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
    }
    print(f"{args.sequences} sequences of {lo}..{hi} prompt tokens ({sum(lengths)} in all) + {args.max_tokens} "
          f"each in {table.blocks} blocks of {page} ({figures['kv_gib']} GiB; rows of {max_seq_len} would take "
          f"{figures['rows_layout_kv_gib']} GiB): {wall:.2f} s, {figures['prompt_tok_s']} prompt tok/s, "
          f"{figures['gen_tok_s']} generated tok/s, {counter.preempted} preemptions, {finished}/{args.sequences} "
          f"finished, peak {figures['peak_gib']} GiB", file=sys.stderr)
    return figures
