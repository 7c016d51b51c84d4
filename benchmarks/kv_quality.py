"""Quality of the compressed KV caches against the dense one, on the same model and text (runs on the CPU).

Teacher-forced over a public text (>= 1,000 tokens; prefilled in the engine's 512-token chunks, so later chunks
attend to what the cache holds): perplexity with each cache kind, its change against the dense cache, top-1
agreement of the next-token predictions, and the mean KL divergence of the dense distribution to the other.

    python -m benchmarks run kv_quality [--model FILE.gguf] [--tokens 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from .common import public_text

import sluice
from sluice.cache import KV_CACHE_KINDS


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(float(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    base = sluice.load(a.model, device=a.device)
    text, label = public_text()
    ids = base.tokenizer.encode(text)[: a.tokens]
    res = {"model": str(base.path), "text": label, "tokens": len(ids), "device": a.device, "kinds": {}}
    dense = None
    for kind in KV_CACHE_KINDS:
        model = base if kind == base.kv_cache else base.with_engine(kv_cache=kind)
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
    return res
