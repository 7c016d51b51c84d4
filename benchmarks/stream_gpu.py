"""Streamed experts on the GPU machine (issue #27): a model bigger than its device memory budget, dummy weights at a
real config's shapes, routed experts in page-locked host memory, a per-layer slot cache on the GPU.

Measures, in one process: the pinned host-to-device copy bandwidth (the floor for misses), the zero-copy fill
kernel's bandwidth at the model's expert size, decode tokens/s (`Model.bench`, graphs) with the hit rate and the
host-to-device bytes a step, the placement, and peak host RSS and GPU memory against the budget. With
--check-greedy the greedy tokens of the streamed model are compared with the same model fully resident (when that
fits the GPU). With --layers N the config is cut to its first N layers (a slice of a model too big for the host).

    PYTHONPATH=src python -m benchmarks run stream_gpu --config benchmarks/configs/qwen3.5-122b-a10b.json \\
        --gpu-memory 24GiB --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

import sluice
from sluice.engine.bench import copy_bandwidth


def evict(paths) -> None:
    """Drop the files from the OS page cache (written pages flushed first), so the next reads come from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn, repeats: int = 6) -> float:
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def miss_copy_gb_s(cache, n: int) -> dict:
    """n missed experts brought into slots two ways, GB/s: the in-graph fill kernel reading the page-locked host
    memory zero-copy (swept over its block and warps), and explicit asynchronous copies by the copy engine (one
    per part and expert: what a host-driven cache would issue once it knew the misses). The cache's slots are
    restored afterwards."""
    from sluice.experts.store import parts as _parts
    from sluice.kernels.expert_cache import triton as ect

    experts = torch.randperm(cache.num_experts)[:n]
    jobs = torch.zeros(2, cache.slots, dtype=torch.int32, device=cache.device)
    jobs[0, :n] = experts.to(torch.int32).to(cache.device)
    jobs[1, :n] = torch.arange(n, dtype=torch.int32, device=cache.device)
    n_jobs = torch.tensor([n], dtype=torch.int32, device=cache.device)
    host, slots = _parts(*cache.experts), _parts(cache.gate_up, cache.down)
    saved = [t.clone() for t in slots]
    nbytes = n * cache.expert_bytes
    out = {"experts": n, "expert_bytes": cache.expert_bytes, "fill": {}}
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8):
            t = _timed(lambda: ect.fill(host, slots, jobs, n_jobs, n, block=block, num_warps=warps))
            out["fill"][f"block{block}_warps{warps}"] = nbytes / t / 1e9
    ok = all(torch.equal(s[i].view(torch.uint8).cpu(), h[int(e)].view(torch.uint8))
             for s, h in zip(slots, host) for i, e in enumerate(experts[:2].tolist()))

    def copies():
        for i, e in enumerate(experts.tolist()):
            for src, dst in zip(host, slots):
                dst[i].copy_(src[e], non_blocking=True)

    out["copy_engine"] = nbytes / _timed(copies) / 1e9
    for t, old in zip(slots, saved):
        t.copy_(old)
    if not ok:
        raise SystemExit("fill kernel copied the wrong bytes")
    out["fill_default"] = out["fill"][f"block{ect.FILL_BLOCK}_warps{ect.FILL_WARPS}"]
    return out


def config_path(config: str, layers: int | None) -> str:
    if layers is None:
        return config
    doc = json.loads(Path(config).read_text())
    text = doc.get("text_config", doc)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    out = Path(tempfile.mkdtemp()) / "config.json"
    out.write_text(json.dumps(doc))
    return str(out)


def disk_run(model, files, prompt_tokens: int, steps: int) -> dict:
    """One sequence through the engine with experts read from disk: the prefill (whole layers read) and then
    `steps` decode steps, the page cache emptied before each; tokens/s, disk GB/s and the hit rate of the decode."""
    p, engine = model.placement, model.engine
    g = torch.Generator().manual_seed(3)
    evict(files)
    b0, t0 = p.disk_bytes_read(), time.perf_counter()
    seq = engine.add_request(torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=g).tolist(),
                             max_tokens=steps + 4, stop_ids=())
    while seq.status != "decoding":
        engine.step()
    torch.cuda.synchronize()
    prefill_s, prefill_bytes = time.perf_counter() - t0, p.disk_bytes_read() - b0
    evict(files)
    hits0, misses0 = (sum(int(c.stats[i]) for c in p.caches) for i in range(2))
    b1, t1 = p.disk_bytes_read(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    decode_s, decode_bytes = time.perf_counter() - t1, p.disk_bytes_read() - b1
    hits, misses = (sum(int(c.stats[i]) for c in p.caches) - v for i, v in enumerate((hits0, misses0)))
    engine.abort(seq)
    return {"prompt_tokens": prompt_tokens, "prefill_s": prefill_s,
            "prefill_disk_gb_s": prefill_bytes / prefill_s / 1e9, "decode_steps": steps,
            "decode_tok_s": steps / decode_s,
            "decode_disk_gb_s": decode_bytes / decode_s / 1e9, "decode_bytes_per_step": decode_bytes / steps,
            "hit_rate": hits / max(1, hits + misses)}


def greedy(model, prompts, n):
    return [model.generate(p, max_tokens=n, temperature=0) for p in prompts]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpu-memory", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--check-greedy", action="store_true")
    ap.add_argument("--disk", type=Path, default=None,
                    help="write the dummy checkpoint here (MLX layout) and stream the experts from these files")
    ap.add_argument("--disk-steps", type=int, default=24)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    cfg = config_path(args.config, args.layers)
    out = {"config": args.config, "layers": args.layers, "gpu_memory": args.gpu_memory,
           "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    out["pinned_copy_gb_s"] = copy_bandwidth(dev, 1 << 30, host=True) / 1e9
    print(f"pinned host-to-device copy: {out['pinned_copy_gb_s']:.1f} GB/s", flush=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    if args.check_greedy:
        t0 = time.perf_counter()
        whole = sluice.load(cfg, load_format="dummy", device="cuda")
        assert whole.placement is None
        ref = greedy(whole, prompts, 16)
        out["resident_load_s"] = time.perf_counter() - t0
        del whole
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if args.disk is not None:
        from sluice.formats.dummy import DummyCheckpoint

        t0 = time.perf_counter()
        if not any(args.disk.glob("*.safetensors")):
            DummyCheckpoint(cfg).write(args.disk, device="cuda")
        files = sorted(args.disk.glob("*.safetensors"))
        out["checkpoint_gb"] = sum(f.stat().st_size for f in files) / 1e9
        out["write_s"] = time.perf_counter() - t0
        print(f"checkpoint on disk: {out['checkpoint_gb']:.1f} GB in {args.disk} ({out['write_s']:.0f} s)", flush=True)
        evict(files)
    t0 = time.perf_counter()
    if args.disk is not None:
        model = sluice.load(args.disk, device="cuda", gpu_memory=args.gpu_memory, expert_store="disk")
    else:
        model = sluice.load(cfg, load_format="dummy", device="cuda", gpu_memory=args.gpu_memory)
    out["load_s"] = time.perf_counter() - t0
    p = model.placement
    out["placement"] = p.summary()
    print(f"loaded in {out['load_s']:.0f} s: {p.describe()}", flush=True)
    if args.check_greedy:
        got = greedy(model, prompts, 16)
        out["greedy_identical"] = got == ref
        print(f"greedy tokens identical to the resident model: {got == ref}", flush=True)
    if args.disk is not None:
        for run in range(2):
            r = disk_run(model, files, args.prompt_tokens, args.disk_steps)
            out.setdefault("disk_runs", []).append(r)
            print(f"from disk (page cache emptied first), run {run + 1}: prefill of {r['prompt_tokens']} tokens "
                  f"{r['prefill_s']:.1f} s ({r['prefill_disk_gb_s']:.2f} GB/s from disk); decode "
                  f"{r['decode_tok_s']:.2f} tok/s, {r['decode_disk_gb_s']:.2f} GB/s from disk, "
                  f"{r['decode_bytes_per_step'] / 1e9:.2f} GB a step, hit rate {100 * r['hit_rate']:.1f} %",
                  flush=True)
        args.batches = ""
    for n in sorted({min(p.slots, p.top_k), min(p.slots, 4 * p.top_k)}) if p.store == "host" else ():
        mc = miss_copy_gb_s(p.caches[0], n)
        out.setdefault("miss_copy", []).append(mc)
        best = max(mc["fill"], key=mc["fill"].get)
        print(f"{n} missed experts of {p.expert_bytes / 1e6:.2f} MB: fill kernel {mc['fill_default']:.1f} GB/s "
              f"({100 * mc['fill_default'] / out['pinned_copy_gb_s']:.0f} % of the pinned copy; best {best} "
              f"{mc['fill'][best]:.1f}), copy engine {mc['copy_engine']:.1f} GB/s; sweep "
              + " ".join(f"{k}={v:.1f}" for k, v in mc["fill"].items()), flush=True)
    out["runs"] = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        m = model.with_engine(max_batch=batch)
        before = [sum(int(c.stats[i]) for c in p.caches) for i in range(2)]
        r = m.bench(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, batch=batch, repeats=2)
        hits, misses = (sum(int(c.stats[i]) for c in p.caches) - before[i] for i in range(2))
        r["hit_rate_run"] = hits / max(1, hits + misses)
        steps = 2 * (args.gen_tokens + batch)  # decode steps of both runs (prefill stages whole layers: no lookups)
        r["miss_bytes_per_step"] = misses / steps * p.expert_bytes
        r["miss_gb_s_over_step"] = r["miss_bytes_per_step"] * r["decode_tok_s"] / batch / 1e9
        out["runs"].append(r)
        print(f"batch {batch}: decode {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_warm_s']:.2f} s, prefill "
              f"{r['prefill_tok_s']:.0f} tok/s, hit rate {100 * r['hit_rate_run']:.1f} %, "
              f"{r['miss_bytes_per_step'] / 1e9:.2f} GB of misses a step ({r['miss_gb_s_over_step']:.1f} GB/s over "
              f"the step)", flush=True)
        del m
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    out["peak_gpu_gb"] = torch.cuda.max_memory_reserved() / 1e9
    out["peak_gpu_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    out["budget_gb"] = (p.budget or 0) / 1e9
    print(f"peak host RSS {out['peak_rss_gb']:.1f} GB; peak GPU memory reserved {out['peak_gpu_gb']:.1f} GB, "
          f"allocated {out['peak_gpu_allocated_gb']:.1f} GB "
          f"(budget {out['budget_gb']:.1f} GB)", flush=True)
    if args.check_greedy:
        out["ok"] = out["greedy_identical"]
    return out
