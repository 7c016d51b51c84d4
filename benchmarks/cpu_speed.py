"""Prompt processing and decode speed of sluice vs llama.cpp on the CPU, same GGUF, same thread count.

    python -m benchmarks run cpu_speed [--model FILE.gguf] [--prompt-tokens 512] [--decode-tokens 128] [--json out.json]

Both engines are driven the same way: one prefill of the prompt ids, then greedy decode one token at a time
(llama.cpp through llama-cpp-python's eval loop). Each number is the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from .common import llama_cpp_model, public_text

import sluice


def bench_sluice(model, ids, n_decode):
    cache = model.new_cache(len(ids) + n_decode)
    t0 = time.perf_counter()
    logits = model._prefill(torch.tensor([ids]), cache, last_only=True)
    t1 = time.perf_counter()
    tok = int(logits[0, -1].argmax())
    for i in range(n_decode):
        logits = model._forward(torch.tensor([[tok]]), cache, len(ids) + i, last_only=True)
        tok = int(logits[0, -1].argmax())
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n_decode / (t2 - t1)


def _last_logits(llm) -> np.ndarray:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def bench_llamacpp(llm, ids, n_decode):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = int(np.argmax(_last_logits(llm)))
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(_last_logits(llm)))
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n_decode / (t2 - t1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = sluice.load(a.model, device="cpu")
    text, _ = public_text()
    ids = model.tokenizer.encode(text)[: a.prompt_tokens]
    llm = llama_cpp_model(model.path, n_ctx=len(ids) + a.decode_tokens + 8, threads=a.threads)
    rows = {}
    for name, fn, obj in (("sluice", bench_sluice, model), ("llama.cpp", bench_llamacpp, llm)):
        runs = [fn(obj, ids, a.decode_tokens) for _ in range(a.repeats)]
        rows[name] = {"prefill_tok_s": max(r[0] for r in runs), "decode_tok_s": max(r[1] for r in runs)}
    s, l = rows["sluice"], rows["llama.cpp"]
    rows["ratio"] = {"prefill": s["prefill_tok_s"] / l["prefill_tok_s"],
                     "decode": s["decode_tok_s"] / l["decode_tok_s"]}
    print(f"{'engine':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   ({len(ids)}-token prompt, "
          f"{a.decode_tokens} decoded, {a.threads} threads)")
    for name in ("sluice", "llama.cpp"):
        print(f"{name:10s} {rows[name]['prefill_tok_s']:14.1f} {rows[name]['decode_tok_s']:13.1f}")
    print(f"{'ratio':10s} {rows['ratio']['prefill']:14.2f} {rows['ratio']['decode']:13.2f}")
    return {"prompt_tokens": len(ids), "decode_tokens": a.decode_tokens, "threads": a.threads, **rows}
