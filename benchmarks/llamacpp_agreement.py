"""Teacher-forced agreement of sluice with llama.cpp on the same GGUF.

Both engines read the same token ids (sluice's tokenization of a public text, >= 1,000 tokens); for every
position we compare the top-1 next token and compute each engine's perplexity of the text.

    python -m benchmarks run llamacpp_agreement [--model FILE.gguf] [--tokens 1500] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from .common import llama_cpp_model, public_text

import sluice


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    lp = torch.log_softmax(torch.from_numpy(logits[:-1]).double(), dim=-1)
    nll = -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return math.exp(float(nll.mean()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--kv-cache", default=None, help="(reserved for cache kinds)")
    a = ap.parse_args(argv)
    model = sluice.load(a.model, device="cpu")
    text, label = public_text()
    ids = model.tokenizer.encode(text)[: a.tokens]
    t0 = time.perf_counter()
    ours = model.logits(ids)[0].numpy()
    t_ours = time.perf_counter() - t0
    llm = llama_cpp_model(model.path, n_ctx=len(ids) + 8, logits_all=True)
    t0 = time.perf_counter()
    llm.eval(ids)
    t_ref = time.perf_counter() - t0
    ref = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    ppl_ours, ppl_ref = perplexity(ours, ids), perplexity(ref, ids)
    res = {"text": label, "tokens": len(ids), "top1_agreement": agree, "ppl_sluice": ppl_ours,
           "ppl_llamacpp": ppl_ref, "ppl_rel_diff": ppl_ours / ppl_ref - 1,
           "max_abs_logit_diff": float(np.abs(ours - ref).max()), "seconds_sluice": t_ours, "seconds_llamacpp": t_ref}
    for k, v in res.items():
        print(f"{k:20s} {v:.6g}" if isinstance(v, float) else f"{k:20s} {v}")
    return res
