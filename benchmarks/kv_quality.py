"""Quality of the compressed KV caches against the dense one, on the same model and text (runs on the CPU).

Teacher-forced over a public text (>= 1,000 tokens; prefilled in the engine's 512-token chunks, so later chunks
attend to what the cache holds): perplexity with each cache kind, its change against the dense cache, top-1
agreement of the next-token predictions, and the mean KL divergence of the dense distribution to the other.

    python benchmarks/kv_quality.py [--model FILE.gguf] [--tokens 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from .common import public_text

import sluice
from sluice.cache import KV_CACHE_KINDS


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(float(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = sluice.load(a.model, device=a.device)
    text, label = public_text()
    ids = model.tokenizer.encode(text)[: a.tokens]
    res = {"model": str(model.path), "text": label, "tokens": len(ids), "device": a.device, "kinds": {}}
    dense = None
    for kind in KV_CACHE_KINDS:
        model.kv_cache = kind
        t0 = time.perf_counter()
        logits = model.logits(ids)[0]
        row = {"ppl": perplexity(logits, ids), "seconds": time.perf_counter() - t0,
               "kv_bytes_per_token": model.info()["kv_cache_bytes_per_token"]}
        if dense is None:
            dense = logits
        else:
            row["ppl_rel_change"] = row["ppl"] / res["kinds"]["dense"]["ppl"] - 1
            row["top1_agreement"] = float((logits.argmax(-1) == dense.argmax(-1)).double().mean())
            lp, lq = torch.log_softmax(dense.double(), -1), torch.log_softmax(logits.double(), -1)
            row["kl_dense_to_this"] = float((lp.exp() * (lp - lq)).sum(-1).mean())
        res["kinds"][kind] = row
        print(f"{kind:12s} " + " ".join(f"{k}={v:.6g}" for k, v in row.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
