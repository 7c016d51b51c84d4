"""`sluice bench`: time to first token, prefill and decode speed through the engine, with distinct random prompts
(identical prompts would route every token to the same experts and hide the cost of a batch), and on a GPU the
memory-bandwidth floor beside them: the bytes a step must read (weights outside the experts, the experts a batch of
random routings hits, the KV cache) over the measured copy bandwidth."""

from __future__ import annotations

import time

import torch

from sluice.errors import ContextLengthError, InvalidOptionError, SluiceError


def bench(model, prompt_tokens: int = 512, gen_tokens: int = 64, batch: int = 1, repeats: int = 2,
          temperature: float = 1.0) -> dict:
    """Distinct random prompts, sampled (seeded per sequence) at `temperature` (0: greedy; random weights decode
    greedily into a few tokens that route to a few experts, which hides the cost of a batch)."""
    for name, value in (("prompt_tokens", prompt_tokens), ("gen_tokens", gen_tokens), ("batch", batch),
                        ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise InvalidOptionError(f"bench: {name}={value!r}: use an integer >= 1.")
    engine = model.engine
    if prompt_tokens + gen_tokens + 2 > engine.max_length:
        raise ContextLengthError(f"bench: {prompt_tokens} + {gen_tokens} (+ 2) tokens exceed the "
                                 f"{engine.max_length} positions a sequence may hold.")
    if batch > model.engine_config.max_batch:
        raise InvalidOptionError(f"bench: batch={batch} is more than max_batch={model.engine_config.max_batch}.")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), generator=g).tolist()
    runs = [_run(engine, prompts, gen_tokens, temperature) for _ in range(repeats)]
    best = max(runs, key=_decode_rate)
    result = {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
              "kv_cache": model.kv_cache, "graphs": engine.runner.uses_graphs, "batch": batch,
              "temperature": temperature,
              "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
              "ttft_cold_s": runs[0]["ttft_s"], "ttft_warm_s": min(r["ttft_s"] for r in runs[1:] or runs),
              "prefill_tok_s": batch * prompt_tokens / min(r["prefill_s"] for r in runs),
              "decode_tok_s": _decode_rate(best) or None,
              "decode_steps": best["decode_tokens"] // batch, **model._kv_layout()}
    result["decode_tok_s_per_seq"] = None if result["decode_tok_s"] is None else result["decode_tok_s"] / batch
    if model.device.type == "cuda":
        result.update(floor(model, batch, prompt_tokens + gen_tokens // 2))
    placement = getattr(model.module, "placement", None)
    if placement is not None:
        result["placement"] = placement.summary()
    return result


def _decode_rate(run: dict) -> float:
    return run["decode_tokens"] / run["decode_s"] if run["decode_s"] else 0.0


def _run(engine, prompts, gen_tokens: int, temperature: float) -> dict:
    """One pass: every prompt prefilled, then `gen_tokens` steady steps of all of them decoding. A sequence may hold
    as many tokens as fit (the first prompts decode while the last ones prefill); the run ends, the sequences aborted,
    once the steady window is measured. Steady: the steps in which all sequences decode and no prompt prefills;
    timed from the start of the second such step (the first may capture the batch's CUDA graph) to the end of the
    last, over the tokens those steps computed (with overlap, a step launched before the window and read back in it
    is not counted); with one steady step only, that one; with none (a sequence ended first), no decode rate."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    failed_before = engine.failed_steps
    engine.clear_prefixes()  # every pass prefills its prompts whole: the passes repeat them
    sync()
    t0 = time.perf_counter()
    # the steps the last prompts take to prefill while the first ones decode, at the least a step prefills beside
    # decodes: a sequence never runs out of tokens before the window (nor holds many more positions than it needs)
    beside = engine.scheduler.budget(len(prompts))
    room = gen_tokens + 2 + len(prompts) + -(-sum(len(p) for p in prompts) // beside)
    room = min(room, engine.max_length - max(len(p) for p in prompts))
    seqs = [engine.add_request(p, max_tokens=room, stop_ids=(), temperature=temperature, seed=i)
            for i, p in enumerate(prompts)]
    ttft = prefill_end = None
    windows = []  # (start time, tokens before) of the first two steady steps
    spans = [(0.0, 0), (0.0, 0)]  # (seconds, tokens) from each window's start to the last steady step's end
    steady_steps = 0
    try:
        while not all(s.finished for s in seqs) and steady_steps <= gen_tokens:
            steady = len(engine.scheduler.decoding()) == len(seqs) and not engine.scheduler.next_prefills()
            if steady and len(windows) < 2:
                windows.append((time.perf_counter(), sum(len(s.output) for s in seqs) + engine.in_flight))
            engine.step()
            now = time.perf_counter()
            if ttft is None and seqs[0].output:
                ttft = now - t0
            if prefill_end is None and all(s.prefilled == len(s.prompt) for s in seqs):
                sync()  # the last chunk launched, not yet computed: its end is when the GPU is done with it
                prefill_end = time.perf_counter() - t0
            if steady:
                steady_steps += 1
                tokens = sum(len(s.output) for s in seqs)
                spans[:len(windows)] = [(now - start, tokens - before) for start, before in windows]
    finally:
        for s in seqs:
            engine.abort(s)
        while engine.has_work():  # a step run ahead: read it back
            engine.step()
    sync()
    failed = [s for s in seqs if s.finish_reason == "error"]
    if failed:  # timings of steps that failed are not the engine's speed
        raise SluiceError(f"bench: {len(failed)} of {len(seqs)} sequences failed; the first: {failed[0].error}")
    if engine.failed_steps > failed_before:  # a batch that failed and went on one sequence at a time
        raise SluiceError(f"bench: {engine.failed_steps - failed_before} step(s) failed and their sequences were run "
                          "one at a time (the error is logged above): those timings are not the engine's speed.")
    decode_s, decode_tokens = spans[1] if spans[1][1] > 0 else spans[0]
    return {"ttft_s": ttft, "prefill_s": prefill_end, "decode_s": decode_s, "decode_tokens": decode_tokens}


def copy_bandwidth(device, nbytes: int = 256 << 20, host: bool = False) -> float:
    """Device copy bandwidth in bytes/s (read + write), the best of a few copies of `nbytes`; host: the
    host-to-device bandwidth from page-locked memory (bytes moved, counted once)."""
    if host:
        src = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
        dst = torch.empty_like(src, device=device)
    else:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return (1 if host else 2) * nbytes / best


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` sequences at `context` positions reads at least: every weight outside the
    routed experts, the experts that `batch` independent top-k routings hit (expected count), the KV cache."""
    from sluice.layers.moe import SparseMoE

    total = model.info()["weight_bytes"]
    embed = model.module.embed
    embed = getattr(embed, "embedding", embed)  # tensor-parallel: this rank's shard inside its wrapper
    if not model.config.tie_word_embeddings:  # the embedding is a lookup of `batch` rows
        total -= sum(t.nbytes for t in (embed.qweight, embed.scales, embed.biases, embed.weight) if t is not None)
    for moe in (m for m in model.module.modules() if isinstance(m, SparseMoE)):
        experts = sum(w.nbytes for w in (moe.gate_up, moe.down))
        E, k = moe.num_experts, moe.top_k
        hit = E * (1 - (1 - k / E) ** batch)
        total -= experts * (1 - hit / E)
    kv = model._kv_layout()
    return int(total + batch * (context * kv["kv_cache_bytes_per_token"] + kv["kv_cache_fixed_bytes"]))


def floor(model, batch: int, context: int) -> dict:
    """The decode floor: the step's bytes at the device copy bandwidth; with streamed experts, the misses of a
    uniform routing (the experts a batch hits outside the slots) at the host-to-device bandwidth, the two
    overlapped at best."""
    bandwidth = copy_bandwidth(model.device)
    nbytes = step_bytes(model, batch, context)
    out = {"copy_bandwidth_gb_s": bandwidth / 1e9, "step_bytes": nbytes}
    seconds = nbytes / bandwidth
    p = getattr(model.module, "placement", None)
    if p is not None:
        host = copy_bandwidth(model.device, host=True)
        hit = p.experts * (1 - (1 - p.top_k / p.experts) ** batch)
        miss_bytes = p.layers * hit * (1 - p.slots / p.experts) * p.expert_bytes
        out.update(host_copy_bandwidth_gb_s=host / 1e9, step_miss_bytes=int(miss_bytes))
        seconds = max(seconds, miss_bytes / host)
    out["floor_decode_tok_s"] = batch / seconds
    return out
