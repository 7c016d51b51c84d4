"""What a user of the engine gets, in one process (issue #38): each scenario drives `Engine.step()` as the server's
engine thread does, with distinct random prompts and sampled tokens (temperature 1, seeded: random weights decode
greedily into a few tokens that route to a few experts).

    PYTHONPATH=src python -m benchmarks run serving_gpu --json out.json --model \\
        benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy --scenarios decode,prefill,closed,burst,join

Scenarios (each on its own engine over the same weights):
- decode: steady decode of N sequences (`--batches`, 512-token prompts): tokens/s over the steps in which all of
  them decode, from the second such step on;
- prefill: one prompt of each of `--prompt-lengths` tokens alone (`Model.bench`): prefill tokens/s, warm;
- closed: `--clients` closed-loop clients, each sending a 12-token prompt for 64 tokens and the next as soon as one
  ends (client i starts at step i); output tokens/s and time to first token (p50, p99) after a warm-up;
- burst: `--clients` prompts of 512 tokens added at once: when each first token comes (p50, last);
- join: 8 sequences decode, then a 32k-token prompt joins: the time between the batch's steps before (normal) and
  while it prefills (p50, p99, max, p99 / normal), and the prompt's time to first token.
Only the engine API that older trees have too is used for decode and prefill (`--baseline` runs those on a tree given
by PYTHONPATH, or by the runner's `--base REF`). Steps are timed by the host clock between `step()` returns, as a
client would see them (with overlap a step's tokens come from the next `step()` call). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sluice

from .registry import checkpoint
from .runner import commit


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def randoms(vocab, n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def drain(engine):
    for s in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(s)
    while engine.has_work():
        engine.step()


def decode(model, batch: int, prompt_tokens: int = 512, steps: int = 64) -> dict:
    engine = model.engine
    seqs = [engine.add_request(p, max_tokens=steps + 8 + batch, stop_ids=(), temperature=1.0, seed=i)
            for i, p in enumerate(randoms(model.config.vocab_size, batch, prompt_tokens, batch))]
    while any(s.status != "decoding" for s in seqs):
        engine.step()
    for _ in range(4):  # the batch's graph captured, the run-ahead going
        engine.step()
    sync()
    tokens0, t0 = sum(len(s.output) for s in seqs), time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    dt, tokens = time.perf_counter() - t0, sum(len(s.output) for s in seqs) - tokens0
    drain(engine)
    return {"batch": batch, "prompt_tokens": prompt_tokens, "decode_tok_s": tokens / dt, "step_ms": 1e3 * dt / steps}


def closed(model, clients: int, prompt_tokens: int = 12, max_tokens: int = 64, warmup_s: float = 5.0,
           duration_s: float = 20.0, profile: str | None = None) -> dict:
    engine, vocab = model.engine, model.config.vocab_size
    counter = iter(range(1 << 30))
    added, first, tokens = {}, {}, 0
    live = set()

    def add():
        i = next(counter)
        seq = engine.add_request(randoms(vocab, 1, prompt_tokens, 1000 + i)[0], max_tokens=max_tokens, stop_ids=(),
                                 temperature=1.0, seed=i)
        added[seq.id] = time.perf_counter()
        live.add(seq.id)

    t_start = last = time.perf_counter()
    started, steps, step_s, kinds = 0, 0, [], []
    t_measure = t_end = None
    prof = None
    while True:
        if started < clients:  # client i starts at step i
            add()
            started += 1
        mixed = bool(engine.scheduler.waiting) or any(s.status != "decoding" for s in engine.scheduler.running)
        if profile and t_measure is not None and prof is None:  # 40 measured steps under the profiler
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_steps = 0
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        if t_measure is not None:
            step_s.append(now - last)
            kinds.append(mixed)
        last = now
        if prof is not None and prof_steps is not None:
            prof_steps += 1
            if prof_steps == 40:
                sync()
                prof.__exit__(None, None, None)
                with open(profile, "w") as f:
                    for key in ("self_cuda_time_total", "self_cpu_time_total"):
                        f.write(prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70))
                        f.write("\n\n")
                prof_steps = None
        if t_measure is None and now - t_start >= warmup_s:
            t_measure = now
        for o in outs:
            sid = o.seq.id
            if o.token is not None:
                if sid not in first:
                    first[sid] = now
                if t_measure is not None:
                    tokens += 1
            if o.finished and sid in live:
                live.discard(sid)
                if t_measure is None or now - t_measure < duration_s:
                    add()
        if t_measure is not None and now - t_measure >= duration_s:
            t_end = now
            break
    ttft = [first[i] - added[i] for i in first if t_measure is not None and added[i] >= t_measure]
    mixed_s = [t for t, m in zip(step_s, kinds) if m]
    decode_s = [t for t, m in zip(step_s, kinds) if not m]
    drain(engine)
    return {"clients": clients, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "output_tok_s": tokens / (t_end - t_measure), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "requests_measured": len(ttft), "steps": steps, "step_ms_p50": 1e3 * pct(step_s, 50),
            "step_ms_p90": 1e3 * pct(step_s, 90), "step_ms_max": 1e3 * max(step_s),
            "mixed_steps": len(mixed_s), "mixed_step_ms_p50": 1e3 * pct(mixed_s, 50),
            "decode_steps": len(decode_s), "decode_step_ms_p50": 1e3 * pct(decode_s, 50)}


def burst(model, n: int, prompt_tokens: int = 512, seed: int = 7) -> dict:
    engine = model.engine
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, max_tokens=16, stop_ids=(), temperature=1.0, seed=i)
            for i, p in enumerate(randoms(model.config.vocab_size, n, prompt_tokens, seed))]
    first, steps, trace, last, shape = {}, 0, [], 0.0, []
    runner_step = engine.runner.step

    def traced(decodes, tokens, chunks):  # what each forward holds: decode tokens, prompt tokens
        shape[:] = [len(decodes), sum(len(ids) for _, ids, _ in chunks)]
        return runner_step(decodes, tokens, chunks)

    engine.runner.step = traced
    while any(s.id not in first and not s.finished for s in seqs):  # a failed request may end without a token
        shape[:] = [0, 0]
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        trace.append((round(1e3 * (now - last), 1), *shape))  # ms, decode tokens, prompt tokens
        last = now
        for o in outs:
            if o.token is not None and o.seq.id not in first:
                first[o.seq.id] = now
    engine.runner.step = runner_step
    drain(engine)
    times = sorted(first.values())
    return {"prompts": n, "prompt_tokens": prompt_tokens, "first_token_p50_s": pct(times, 50),
            "last_first_token_s": times[-1] if times else float("nan"), "steps": steps,
            "step_trace": trace}


def join(model, running: int = 8, prompt_tokens: int = 32768, normal_steps: int = 30) -> dict:
    engine, vocab = model.engine, model.config.vocab_size
    seqs = [engine.add_request(p, max_tokens=4096, stop_ids=(), temperature=1.0, seed=i)
            for i, p in enumerate(randoms(vocab, running, 32, 3))]
    while any(s.status != "decoding" for s in seqs):
        engine.step()
    for _ in range(4):
        engine.step()

    normal, last = [], time.perf_counter()
    for _ in range(normal_steps):
        engine.step()
        now = time.perf_counter()
        normal.append(now - last)
        last = now
    t0 = time.perf_counter()
    joiner = engine.add_request(randoms(vocab, 1, prompt_tokens, 4)[0], max_tokens=2, stop_ids=(),
                                temperature=1.0, seed=99)
    joined, last, ttft = [], time.perf_counter(), None
    while ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        joined.append(now - last)
        last = now
        if any(o.seq is joiner and o.token is not None for o in outs):
            ttft = now - t0
    drain(engine)
    normal_ms = 1e3 * pct(normal, 50)
    return {"running": running, "prompt_tokens": prompt_tokens, "normal_step_ms": normal_ms,
            "join_p50_ms": 1e3 * pct(joined, 50), "join_p99_ms": 1e3 * pct(joined, 99),
            "join_max_ms": 1e3 * max(joined), "p99_over_normal": 1e3 * pct(joined, 99) / normal_ms,
            "ttft_s": ttft, "join_steps": len(joined)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="benchmarks/configs/qwen3-next-80b-a3b.json")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scenarios", default="decode,prefill,closed,burst,join")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--decode-prompt-tokens", type=int, default=512)
    ap.add_argument("--prompt-lengths", default="4096,32768")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--burst-prompt-tokens", type=int, default=512)
    ap.add_argument("--duration", type=float, default=20.0, help="closed: seconds measured after a 5 s warm-up")
    ap.add_argument("--policies", default="default",
                    help="comma-separated step budgets to try for burst and join: 'default', or "
                         "'D' / 'D+p' (decode_prefill_chunk D, with + the budget grows with the prompts waiting), "
                         "each optionally '/wN' (whole_graph_tokens N)")
    ap.add_argument("--baseline", action="store_true", help="only what an older tree has (decode, prefill)")
    ap.add_argument("--profile", help="closed: write a torch profiler table of 40 measured steps to this file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    base = sluice.load(args.model, load_format=args.load_format, device=args.device, kv_cache=args.kv_cache)
    gpu = torch.cuda.get_device_name() if base.device.type == "cuda" else "cpu"
    report = {"model": args.model, "kv_cache": args.kv_cache, "gpu": gpu,
              "load_s": time.perf_counter() - t0, "sluice": sluice.__file__}
    print(f"loaded in {report['load_s']:.0f} s", flush=True)
    scenarios = args.scenarios.split(",")

    def engine(**options):
        save()
        return base.with_engine(**options)

    def save():  # after every scenario: a run cut short keeps what it measured
        checkpoint(report)

    def timed_warmup(model):
        eng = model.engine
        if hasattr(eng, "warmup"):
            report.setdefault("warmup_s", []).append(round(eng.warmup(), 1))
        return model

    if "decode" in scenarios:
        model = engine(max_batch=64, decode_prefill_chunk=4096)
        batches = [int(x) for x in args.batches.split(",")]
        report["decode"] = [decode(model, b, args.decode_prompt_tokens) for b in batches]
        for r in report["decode"]:
            print(json.dumps(r), flush=True)
        del model
    if "prefill" in scenarios:
        report["prefill"] = []
        for n in (int(x) for x in args.prompt_lengths.split(",")):
            model = engine(max_batch=1)
            r = model.bench(prompt_tokens=n, gen_tokens=2, batch=1, repeats=2)
            report["prefill"].append({"prompt_tokens": n, "ttft_warm_s": r["ttft_warm_s"],
                                      "prefill_tok_s": r["prefill_tok_s"]})
            print(json.dumps(report["prefill"][-1]), flush=True)
            del model
    if args.baseline:
        scenarios = []
    if "closed" in scenarios:
        model = timed_warmup(engine(max_batch=args.clients, max_seq_len=256))
        report["closed"] = closed(model, args.clients, duration_s=args.duration, profile=args.profile)
        print(json.dumps(report["closed"]), flush=True)
        del model
    for policy in args.policies.split(","):
        opts, proportional = {}, None
        budget, _, whole = policy.partition("/w")
        if whole:
            opts["whole_graph_tokens"] = int(whole)
        if budget != "default":
            proportional = budget.endswith("+p")
            opts["decode_prefill_chunk"] = int(budget.removesuffix("+p"))
        if "burst" in scenarios:
            model = engine(max_batch=args.clients, max_seq_len=1024, **opts)
            if proportional is not None:
                model.engine.scheduler.proportional = proportional
            burst(model, args.clients, args.burst_prompt_tokens, seed=1)  # once to warm what warmup did not
            r = {"policy": policy, **burst(model, args.clients, args.burst_prompt_tokens)}
            report.setdefault("burst", []).append(r)
            print(json.dumps(r), flush=True)
            del model
        if "join" in scenarios:
            model = engine(max_batch=16, max_seq_len=32768 + 4096 + 256, **opts)
            if proportional is not None:
                model.engine.scheduler.proportional = proportional
            join(model, prompt_tokens=4096, normal_steps=4)  # once to capture the graphs its steps replay
            r = {"policy": policy, **join(model)}
            report.setdefault("join", []).append(r)
            print(json.dumps(r), flush=True)
            del model
    print()
    print(f"sluice at {report['sluice']} ({commit()}), {report['gpu']}, {args.kv_cache} KV")
    for r in report.get("decode", []):
        print(f"decode batch {r['batch']:3d}: {r['decode_tok_s']:9.1f} tok/s  ({r['step_ms']:.2f} ms a step)")
    for r in report.get("prefill", []):
        print(f"prefill {r['prompt_tokens']:6d}: {r['ttft_warm_s']:.3f} s, {r['prefill_tok_s']:9.0f} tok/s")
    if "closed" in report:
        r = report["closed"]
        print(f"closed loop {r['clients']} clients: {r['output_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p99 {r['ttft_p99_s']:.3f} s ({r['requests_measured']} requests); step p50 {r['step_ms_p50']:.1f} ms "
              f"p90 {r['step_ms_p90']:.1f} max {r['step_ms_max']:.1f}; mixed {r['mixed_steps']} p50 "
              f"{r['mixed_step_ms_p50']:.1f} ms, decode-only {r['decode_steps']} p50 {r['decode_step_ms_p50']:.1f} ms")
    for r in report.get("burst", []):
        print(f"burst {r['prompts']} x {r['prompt_tokens']} [{r['policy']}]: first tokens p50 "
              f"{r['first_token_p50_s']:.3f} s, last {r['last_first_token_s']:.3f} s ({r['steps']} steps)")
    for r in report.get("join", []):
        print(f"join {r['prompt_tokens']} beside {r['running']} [{r['policy']}]: TTFT {r['ttft_s']:.2f} s, step "
              f"normal {r['normal_step_ms']:.1f} ms, p50 {r['join_p50_ms']:.1f}, p99 {r['join_p99_ms']:.1f} "
              f"({r['p99_over_normal']:.1f}x), max {r['join_max_ms']:.1f}")
    return report
