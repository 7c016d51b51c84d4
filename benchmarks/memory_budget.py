"""One memory budget (issue #41): a model loaded with `gpu_memory` keeps the device memory it uses (weights, expert
slots, KV blocks, rows, snapshots, graphs, activations) within it, measured.

    python -m benchmarks run memory_budget --model benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy \
        --gpu-memory 40GiB

The engine is warmed up (its pool at `max_batch` rows of `max_seq_len` positions, every graph captured), then
--sequences prompts of --prompt-tokens run to --max-tokens each, sampled. The device's use is read as the total
memory less the free memory (`torch.cuda.mem_get_info`: PyTorch's allocator, CUDA graphs' pools, cuBLAS workspaces
and the CUDA context alike), before the load, after it, after the warm-up and at its peak (sampled after every
step); the budget counts from the device's use before the load. Printed and returned: the memory plan
(`engine/memory.py`), those readings, and whether the peak stayed within the budget.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

import sluice
from sluice.experts.placement import parse_bytes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--gpu-memory", default="40GiB")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=32768)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    budget = parse_bytes(args.gpu_memory)
    total = torch.cuda.mem_get_info()[1]
    used = lambda: total - torch.cuda.mem_get_info()[0]  # noqa: E731
    before = used()
    model = sluice.load(args.model, load_format=args.load_format, device="cuda", gpu_memory=budget,
                        max_batch=args.max_batch, max_seq_len=args.max_seq_len)
    loaded = used() - before
    engine = model.engine
    engine.warmup()
    warm = used() - before
    plan = engine.memory_plan()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    seqs = [engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_tokens)], max_tokens=args.max_tokens,
                               stop_ids=(), temperature=1.0, seed=i) for i in range(args.sequences)]
    peak = warm
    while not all(s.finished for s in seqs):
        engine.step()
        peak = max(peak, used() - before)
    figures = {"model": args.model, "gpu_memory": budget, "max_batch": args.max_batch,
               "max_seq_len": args.max_seq_len, "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens, "plan": plan, "loaded_bytes": loaded, "warm_bytes": warm,
               "peak_bytes": peak, "torch_peak_reserved": torch.cuda.max_memory_reserved(),
               "finished": sum(s.finish_reason == "length" for s in seqs), "within": peak <= budget}
    figures["ok"] = figures["within"] and figures["finished"] == args.sequences
    g = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    print("\n".join(plan.get("lines", [plan.get("error", "")])), file=sys.stderr)
    print(f"budget {g(budget)}: after the load {g(loaded)}, after the warm-up {g(warm)}, peak {g(peak)} "
          f"({'within' if figures['within'] else 'OVER'} the budget); {figures['finished']}/{args.sequences} "
          "finished", file=sys.stderr)
    return figures
