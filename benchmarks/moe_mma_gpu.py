"""Issue #43: the tensor-core grouped expert GEMM (`kernels/moe/mma.py`, CUDA C) beside the paths before it, one GPU.

    python -m benchmarks run moe_mma_gpu [--parts layer,engine] [--models qwen3-next,moonlight]
        [--tokens 1,2,4,...] [--batches 1,16,64,128]

- layer: the routed experts of one layer at a real model's shape (random 4-bit g64 weights built in the packed
  layout), T tokens routed uniformly at random to k distinct experts each (what distinct prompts and sampled tokens
  give): the expert GEMVs (one weight read per slot, T <= 128), the Triton grouped GEMMs, the CUDA kernel (tile rows
  by `mma.tile_rows`, and each of 8 / 16 / 32 at some sizes), each launch chain as the MoE block runs it (expert
  order, tile table, two GEMMs; no combine), under CUDA-graph replay over enough routings to keep L2 cold. Every
  path is first checked against the torch reference on the same routing. Floor: the hit experts' bytes over the
  measured copy bandwidth.
- engine: `Model.bench` (distinct prompts, sampled tokens) by decode batch and a 4k prompt's prefill, with the CUDA
  kernel (the default) and without it (`mma.ENABLED = False`: the expert GEMVs and Triton grouped GEMMs), the same
  weights, an engine (and its graphs) each.
"""

from __future__ import annotations

import gc
import json
import traceback

import torch

import sluice
from benchmarks.registry import checkpoint

from .gpu import copy_bandwidth, graph_time, qt_bytes, rel_err
from .moe_gpu import stacked_qt

SHAPES = {  # name: (hidden, experts, expert intermediate, top-k, config)
    "qwen3-next": (2048, 512, 512, 10, "benchmarks/configs/qwen3-next-80b-a3b.json"),
    "moonlight": (2048, 64, 1408, 6, "benchmarks/configs/moonlight-16b-a3b.json"),
    "qwen3.5-122b": (3072, 256, 1024, 8, None),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]
FORCED_TILES = (64, 512)  # token counts where each tile size is timed too
L2_COLD_BYTES = 200e6  # the routings of one timing hit at least this many expert bytes (L2: 50-60 MB)


def _paths(T):
    from sluice.kernels.moe import triton as mt

    return (["gemv"] if T <= mt.DECODE_MAX_TOKENS else []) + ["triton grouped", "mma"]


def _run(path, x, ids, w, gate_up, down, tile=None, config=None):
    """One path's launches; the GEMVs and Triton's GEMMs asked for by their own options (as their defaults set
    them), the CUDA kernel forced at every size by its thresholds (and tile rows, warps and stages when given)."""
    from sluice.kernels.moe import grouped, mma
    from sluice.kernels.moe import triton as mt

    T, k = ids.shape
    if path == "gemv":
        return mt.moe_decode(x, ids, w, gate_up, down, summed=False, expert_order=T >= mt.ORDER_MIN_TOKENS)
    if path == "triton grouped":
        block_m = grouped.prefill_configs(T * k / gate_up.weight.shape[0])[0]
        return mt.moe_prefill(x, ids, w, gate_up, down, summed=False, block_m=block_m)
    if config:  # (warps, stages) of the CUDA kernel, every tile size
        mma.WARPS, mma.STAGES = config
        mma.WIDE_WARPS = config[0]
    mt.MMA_MIN_ROWS, mt.MMA_MAX_ROWS = 0, 10**9
    if tile:
        mma.tile_rows = lambda rows, t=tile: t
    run = mt.moe_decode if x.shape[0] <= mt.DECODE_MAX_TOKENS else mt.moe_prefill
    return run(x, ids, w, gate_up, down, summed=False)


def _reset(saved):
    from sluice.kernels.moe import mma
    from sluice.kernels.moe import triton as mt

    mt.MMA_MIN_ROWS, mt.MMA_MAX_ROWS, mma.ENABLED, mma.tile_rows, mma.WARPS, mma.STAGES, mma.WIDE_WARPS = saved


def layer(figures, names, tokens, copy_bw, configs=()):
    from sluice.kernels.moe import mma, reference
    from sluice.kernels.moe import triton as mt

    saved = (mt.MMA_MIN_ROWS, mt.MMA_MAX_ROWS, mma.ENABLED, mma.tile_rows, mma.WARPS, mma.STAGES, mma.WIDE_WARPS)
    rows = figures.setdefault("layer", [])
    for name in names:
        H, E, I, k, _ = SHAPES[name]
        gate_up, down = stacked_qt(E, 2 * I, H), stacked_qt(E, H, I)
        per_expert = (qt_bytes(gate_up) + qt_bytes(down)) / E
        for T in tokens:
            g = torch.Generator(device="cuda").manual_seed(T)
            hit = E * (1 - (1 - k / E) ** T) * per_expert
            n = max(2, min(32, int(L2_COLD_BYTES / hit) + 1))
            sets = []
            for _ in range(n):
                logits = torch.randn(T, E, device="cuda", generator=g)
                w, ids = reference.route(logits, k, True)
                sets.append((torch.randn(T, H, device="cuda", generator=g).bfloat16(), ids.int(), w, logits))
            floor_us = hit / copy_bw * 1e6
            x0, ids0, w0, logits0 = sets[0]
            ref = reference.moe_reference(x0, logits0, gate_up, down, k, True) if T <= 256 else None
            variants = ([(p, None, None) for p in _paths(T)] + [("mma", t, None) for t in mma.TILE_ROWS
                                                                 if T in FORCED_TILES and not configs]
                        + [("mma", None, c) for c in configs])
            for path, tile, config in variants:
                label = path + (f" tile {tile}" if tile else "") + (f" w{config[0]} s{config[1]}" if config else "")
                row = {"model": name, "T": T, "path": label, "floor_us": floor_us, "rows_per_expert": T * k / E}
                try:
                    out = _run(path, x0, ids0, w0, gate_up, down, tile, config).combine()
                    if ref is None:  # (the reference's loop over every expert: the first path stands in)
                        ref = out
                    row["rel_err"] = rel_err(out, ref)
                    calls = [lambda s=s, path=path, tile=tile, c=config, gu=gate_up, dn=down:
                             _run(path, *s[:3], gu, dn, tile, c) for s in sets]
                    row["us"] = graph_time(calls) * 1e6
                    row["pct_floor"] = 100 * floor_us / row["us"]
                except Exception:  # noqa: BLE001 - recorded, the run goes on
                    row["error"] = traceback.format_exc(limit=4)
                    figures["ok"] = False
                finally:
                    _reset(saved)
                rows.append(row)
                print(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}),
                      flush=True)
            checkpoint(figures)
            del sets
        del gate_up, down
        gc.collect()
        torch.cuda.empty_cache()


DENSE = {  # Qwen3-Next-80B's 4-bit projections a decode step runs: name: (N, K)
    "GDN qkvz 12288x2048": (12288, 2048), "GDN out 2048x4096": (2048, 4096), "attn qkv 9216x2048": (9216, 2048),
    "lm_head 151936x2048": (151936, 2048)}
DENSE_ROWS = (8, 16, 32, 64, 128, 256)
DENSE_CONFIGS = "16:1:4,16:2:4,16:4:4,32:2:4,32:4:4,64:1:4,64:2:4,64:1:8,64:2:8,32:4:8"


def dense(figures, copy_bw, configs=DENSE_CONFIGS, ms=DENSE_ROWS):
    """The dense projections by rows: the Triton paths (GEMV up to 4 rows, the tensor-core GEMM) as `qmatmul` ran
    them before, `qmatmul` now, the CUDA kernel (`mma.dense`) as planned and with each (tile rows : weight row sets
    a warp : warps) of `configs`, over enough weight copies to keep L2 cold."""
    from sluice.kernels.launch import num_sms
    from sluice.kernels.moe import mma
    from sluice.kernels.qmatmul import gemm

    from .gpu import random_qt

    configs = [tuple(int(v) for v in c.split(":")) for c in configs.split(",") if c]
    rows = figures.setdefault("dense", [])
    sms = num_sms(torch.device("cuda"))
    saved = gemm.MMA_MAX_ROWS
    for name, (N, K) in DENSE.items():
        nbytes = N * K // 2 + N * K // 64 * 4
        copies = [random_qt(N, K) for _ in range(max(1, min(8, int(L2_COLD_BYTES // nbytes) + 1)))]
        for M in ms:
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in copies]
            ref = xs[0].float() @ copies[0].dequantize(torch.float32).T
            floor_us = nbytes / copy_bw * 1e6
            paths = [("triton GEMM", None), ("qmatmul", None), ("mma planned", None)]
            paths += [(f"mma {tm}:{mt}:{w}", (tm, mt, w)) for tm, mt, w in configs if N % (16 * w) == 0]
            for path, cfg in paths:
                row = {"proj": name, "M": M, "path": path, "floor_us": floor_us}
                if path == "triton GEMM":
                    gemm.MMA_MAX_ROWS = 0
                    fn = gemm.qmatmul
                elif path == "qmatmul":
                    fn = gemm.qmatmul
                else:
                    opts = dict(tile_rows=cfg[0], mt=cfg[1], warps=cfg[2]) if cfg else {}
                    row["plan"] = mma.dense_plan(M, N, K, sms, **opts)
                    fn = lambda x, q, o=opts: mma.dense(x, q, **o)  # noqa: E731
                try:
                    row["rel_err"] = rel_err(fn(xs[0], copies[0]), ref)
                    row["us"] = graph_time([lambda x=x, q=q: fn(x, q) for x, q in zip(xs, copies)]) * 1e6
                    row["pct_floor"] = 100 * floor_us / row["us"]
                except Exception:  # noqa: BLE001
                    row["error"] = traceback.format_exc(limit=4)
                    figures["ok"] = False
                finally:
                    gemm.MMA_MAX_ROWS = saved
                rows.append(row)
                print(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}),
                      flush=True)
        del copies
        checkpoint(figures)


ENGINE_VARIANTS = ("before (gemv + triton grouped)", "mma/dense-triton-past-8", "mma")
PROFILE_BATCHES = (16, 64)


def engine(figures, names, batches, variants=ENGINE_VARIANTS, prefill=True):
    from sluice.kernels.moe import mma
    from sluice.kernels.qmatmul import gemm

    saved = gemm.MMA_MAX_ROWS

    rows = figures.setdefault("engine", [])
    for name in names:
        cfg = SHAPES[name][4]
        if cfg is None:
            continue
        base = sluice.load(cfg, load_format="dummy", device="cuda", max_batch=max(batches))
        for variant in variants:
            mma.ENABLED = variant.startswith("mma")
            gemm.MMA_MAX_ROWS = 8 if "dense-triton" in variant else saved
            model = base.with_engine()
            for batch in batches:
                prompt, gen = (512, 64) if batch == 1 else (128, 32)
                try:
                    r = model.bench(prompt_tokens=prompt, gen_tokens=gen, batch=batch, repeats=2)
                    rows.append({"model": name, "variant": variant, "batch": batch,
                                 "decode_tok_s": r["decode_tok_s"], "floor_decode_tok_s": r.get("floor_decode_tok_s")})
                    graphs = model.engine.runner._graphs
                    if batch in PROFILE_BATCHES and batch in graphs:  # the step's kernels, one replay
                        from benchmarks.engine_gpu import profile_graph

                        prof = profile_graph(graphs[batch][0], top=16)
                        prof.pop("sequence", None)
                        figures.setdefault("profiles", {})[f"{name} {variant} b{batch}"] = prof
                except Exception:  # noqa: BLE001
                    rows.append({"model": name, "variant": variant, "batch": batch, "error": traceback.format_exc()})
                    figures["ok"] = False
                print(json.dumps(rows[-1]), flush=True)
                checkpoint(figures)
            if prefill:
                try:
                    r = model.bench(prompt_tokens=4096, gen_tokens=2, batch=1, repeats=2)
                    rows.append({"model": name, "variant": variant, "prompt": 4096,
                                 "prefill_tok_s": r["prefill_tok_s"], "ttft_warm_s": r.get("ttft_warm_s")})
                except Exception:  # noqa: BLE001
                    rows.append({"model": name, "variant": variant, "prompt": 4096, "error": traceback.format_exc()})
                    figures["ok"] = False
                print(json.dumps(rows[-1]), flush=True)
                checkpoint(figures)
            model._engine = None
            del model
            gc.collect()
            torch.cuda.empty_cache()
        mma.ENABLED, gemm.MMA_MAX_ROWS = True, saved
        del base
        gc.collect()
        torch.cuda.empty_cache()


def _paths_by_case(rows, label) -> list[str]:
    """A line per case (`label(row)` names it): each path's time and % of floor, the largest error."""
    by = {}
    for r in rows:
        by.setdefault(label(r), []).append(r)
    lines = []
    for name, rs in by.items():
        cells = [f"{r['path']} {r['us']:.1f} ({r['pct_floor']:.0f}%)" if "us" in r else f"{r['path']} ERROR"
                 for r in rs]
        errs = [r["rel_err"] for r in rs if r.get("rel_err") is not None]
        lines.append(f"{name} floor {rs[0]['floor_us']:8.1f} | " + " | ".join(cells)
                     + (f" | max rel err {max(errs):.1e}" if errs else ""))
    return lines


def table(figures) -> str:
    lines = ["MoE experts of one layer (routed, random routing), us (% of floor):"]
    lines += _paths_by_case(figures.get("layer", []), lambda r: f"{r['model']:13s} T={r['T']:5d}")
    lines.append("Dense projections, us (% of floor) by path:")
    lines += _paths_by_case(figures.get("dense", []), lambda r: f"{r['proj']:20s} M={r['M']:4d}")
    lines.append("Engine (decode tok/s by batch, 4k prefill tok/s):")
    for r in figures.get("engine", []):
        if "error" in r:
            lines.append(f"{r['model']} {r['variant']} {r.get('batch', r.get('prompt'))}: ERROR")
        elif "batch" in r:
            lines.append(f"{r['model']:11s} {r['variant']:32s} b{r['batch']:<4d} {r['decode_tok_s']:9.1f} "
                         f"(floor {r['floor_decode_tok_s'] or 0:.0f})")
        else:
            lines.append(f"{r['model']:11s} {r['variant']:32s} 4k prefill {r['prefill_tok_s']:9.0f} tok/s")
    for key, prof in figures.get("profiles", {}).items():
        lines.append(f"profile {key}: {prof['kernels']} kernels, span {prof['span_ms']:.2f} ms, gaps "
                     f"{prof['gap_ms']:.2f} ms; " + "; ".join(f"{r['kernel'][:40]} {r['wall_ms']:.2f} ({r['calls']})"
                                                            for r in prof["top"][:10]))
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="layer,dense,engine")
    ap.add_argument("--models", default="qwen3-next,moonlight")
    ap.add_argument("--engine-models", default=None)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--engine-variants", default=",".join(ENGINE_VARIANTS))
    ap.add_argument("--no-prefill", action="store_true", help="the engine part without its 4k prompt")
    ap.add_argument("--configs", default="", help="the CUDA kernel's (warps x stages) to time beside, e.g. 8x3,4x6")
    ap.add_argument("--dense-configs", default=DENSE_CONFIGS, help="the dense GEMM's tile rows:mt:warps to time")
    ap.add_argument("--dense-rows", default=",".join(map(str, DENSE_ROWS)))
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    names = args.models.split(",")
    figures: dict = {"ok": True, "gpu": torch.cuda.get_device_name()}
    bw = copy_bandwidth(torch.device("cuda"))
    figures["copy_bandwidth_Bps"] = bw
    if "layer" in parts:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
        layer(figures, names, [int(t) for t in args.tokens.split(",")], bw, configs)
    if "dense" in parts:
        dense(figures, bw, args.dense_configs, [int(m) for m in args.dense_rows.split(",")])
    if "engine" in parts:
        engine(figures, (args.engine_models or args.models).split(","), [int(b) for b in args.batches.split(",")],
               args.engine_variants.split(","), not args.no_prefill)
    print(table(figures), flush=True)
    return figures
