"""DeepSeek-V3-family models on one GPU (issue #42), 4-bit dummy weights, distinct prompts, sampled tokens:

* the MLA decode kernel at batch 1 over a short context (`MLA_SHORT`: the launch's sizes), paged and in rows, with
  and without L2 evicted before it, as a decode graph plans it (for the pool's capacity);
* Moonlight-16B-A3B decode by batch in `VARIANTS`: the fused decode chain (`kernels/mla/chain.py`) off and on,
  the experts as GEMVs, Triton grouped GEMMs or the CUDA grouped GEMM (the default since session 9), and (named,
  batch 1 only) the MLA launch's sizes before the short launch, the same weights (an engine each, graphs captured
  so); the kernels of one replayed batch-1 step of each;
* Moonlight's prefill of a 4k prompt (tok/s, TTFT);
* slices of DeepSeek-V3 671B (its first `first_k_dense_replace` dense layers alone, then with MoE layers after them):
  the decode step's time per dense and per MoE layer by difference, and the whole model's step extrapolated from
  them (61 layers), so the full model's speed on one GPU's worth of bandwidth can be read off.

A part that raises is recorded with its whole traceback (and the figures say ok: false); the others still run.

    python -m benchmarks run deepseek_gpu --batches 1,16,32,64 --parts mla,moonlight,v3
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

import sluice
from benchmarks.registry import checkpoint

MOONLIGHT = "benchmarks/configs/moonlight-16b-a3b.json"
V3 = "benchmarks/configs/deepseek-v3.json"


def _free(*models) -> None:
    for m in models:
        m._engine = None
    gc.collect()
    torch.cuda.empty_cache()


VARIANTS = {  # name: settings of the decode path (absent: the default)
    "unfused/gemv": {"chain": False, "grouped_min_rows": 10**9, "mma": False},  # the decode before session 7
    "fused/gemv": {"grouped_min_rows": 10**9, "mma": False},
    "fused/grouped": {"mma": False},  # the default before session 9: kernels.moe.triton.GROUPED_MIN_ROWS
    "fused/mma": {},  # the default: the CUDA grouped GEMM (kernels/moe/mma.py) from MMA_MIN_ROWS rows an expert
    "fused/all-grouped": {"grouped_min_rows": 1e-9, "mma": False},  # the Triton grouped GEMMs at every batch
    # batch-1 experiments on the MLA decode's launch (mla_decode's keyword arguments)
    "mla/long": {"mla": {"block_n": 32, "num_stages": 3, "min_per_split": 128}},  # the launch before session 8
}
BATCH1_ONLY = ("mla/",)  # variants measured at batch 1 alone
EXPERIMENTS = ("mla/", "fused/all-grouped")  # variants run only when named


_DEFAULT: dict = {}


def _variant(name: str) -> None:
    import functools

    from sluice.kernels.mla import chain, triton as mt
    from sluice.kernels.moe import mma
    from sluice.kernels.moe import triton as moe_triton

    v = VARIANTS[name]
    mma.ENABLED = v.get("mma", True)
    _DEFAULT.setdefault("grouped_min_rows", moe_triton.GROUPED_MIN_ROWS)
    _DEFAULT.setdefault("mla_decode", mt.mla_decode)
    chain.ENABLED = v.get("chain", True)  # read when a step is captured or run
    moe_triton.GROUPED_MIN_ROWS = v.get("grouped_min_rows") or _DEFAULT["grouped_min_rows"]
    mla = v.get("mla")  # the attention imports mla_decode from the module when a step runs
    mt.mla_decode = functools.partial(_DEFAULT["mla_decode"], **mla) if mla else _DEFAULT["mla_decode"]


def moonlight(batches: list[int], figures: dict, variants: list[str]) -> None:
    from sluice.kernels.moe import triton as moe_triton

    base = sluice.load(MOONLIGHT, load_format="dummy", device="cuda", max_batch=max(batches))
    k, E = base.config.top_k, base.config.num_experts
    rows = figures["moonlight"] = []
    for name in variants:
        _variant(name)
        model = base.with_engine()  # its own engine: graphs captured with the variant's kernels
        for batch in batches:
            if name == "fused/grouped" and "fused/gemv" in variants and moe_triton.gemv_decode(batch, k, E):
                continue  # the same path as fused/gemv at this batch
            if name.startswith(BATCH1_ONLY) and batch != 1:
                continue
            prompt, gen = (512, 64) if batch == 1 else (128, 32)
            try:
                r = model.bench(prompt_tokens=prompt, gen_tokens=gen, batch=batch, repeats=2)
                rows.append({"variant": name, **r})
                print(json.dumps({"variant": name, "batch": batch, "decode_tok_s": r["decode_tok_s"],
                                  "floor_decode_tok_s": r["floor_decode_tok_s"]}), flush=True)
                graphs = model.engine.runner._graphs
                if batch == 1 and 1 in graphs:  # its kernels now: a larger batch may rebuild the pool and graphs
                    from benchmarks.engine_gpu import profile_graph

                    figures.setdefault("profiles", {})[name] = profile_graph(graphs[1][0])
            except Exception:  # noqa: BLE001  recorded whole: the GPU run is where it shows
                rows.append({"variant": name, "batch": batch, "error": traceback.format_exc()})
                print(rows[-1]["error"], flush=True)
                figures["ok"] = False
            checkpoint(figures)
        _free(model)
    _variant("fused/mma")
    try:
        r = base.bench(prompt_tokens=4096, gen_tokens=2, batch=1, repeats=2)
        figures["moonlight_prefill_4k"] = {k: r[k] for k in ("prefill_tok_s", "ttft_cold_s", "ttft_warm_s")}
        print(json.dumps(figures["moonlight_prefill_4k"]), flush=True)
    except Exception:  # noqa: BLE001
        figures["moonlight_prefill_4k"] = {"error": traceback.format_exc()}
        figures["ok"] = False
        print(figures["moonlight_prefill_4k"]["error"], flush=True)
    _free(base)
    del base
    gc.collect()
    torch.cuda.empty_cache()


def v3_slices(batches: list[int], moe_layers: int, figures: dict) -> None:
    cfg = json.loads(Path(V3).read_text())
    dense = cfg["first_k_dense_replace"]
    out = figures["v3_slices"] = []
    for layers in (dense, dense + moe_layers):
        d = Path(tempfile.mkdtemp()) / f"v3-{layers}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers, "num_nextn_predict_layers": 0}))
        model = None
        try:
            model = sluice.load(d, load_format="dummy", device="cuda", max_batch=max(batches))
            for batch in batches:
                r = model.bench(prompt_tokens=256, gen_tokens=32, batch=batch, repeats=2)
                step_ms = 1e3 * batch / r["decode_tok_s"]
                out.append({"layers": layers, "batch": batch, "step_ms": step_ms, "decode_tok_s": r["decode_tok_s"],
                            "weight_bytes": model.info()["weight_bytes"]})
                print(json.dumps(out[-1]), flush=True)
        except Exception:  # noqa: BLE001
            out.append({"layers": layers, "error": traceback.format_exc()})
            figures["ok"] = False
            print(out[-1]["error"], flush=True)
        finally:  # freed before the next slice loads, or that one would stream its experts or run out
            if model is not None:
                _free(model)
            del model
        gc.collect()
        torch.cuda.empty_cache()
        checkpoint(figures)
    total = cfg["num_hidden_layers"]
    per = figures["v3_per_layer"] = []
    for batch in batches:
        t = {r["layers"]: r["step_ms"] for r in out if r.get("batch") == batch}
        if len(t) == 2:
            moe_ms = (t[dense + moe_layers] - t[dense]) / moe_layers
            whole = t[dense] + (total - dense) * moe_ms
            per.append({"batch": batch, "dense_slice_ms": t[dense], "moe_layer_ms": moe_ms,
                        "extrapolated_step_ms": whole, "extrapolated_tok_s": 1e3 * batch / whole})


MLA_SHORT = {  # name: mla_decode keyword arguments, for the batch-1 short-context kernel times
    "default": {},  # a short launch (`kernels.mla.triton.short_launch`): one 16-position tile a split
    "long": {"block_n": 32, "num_stages": 3, "min_per_split": 128},  # the sizes of longer launches
    "n32/split32": {"block_n": 32, "min_per_split": 32},
    "n16s1/split16": {"block_n": 16, "num_stages": 1, "min_per_split": 16},
}


def mla_short(figures: dict, context: int = 576, heads: int = 16, page: int = 256) -> None:
    """The MLA decode kernel (split and merge) at batch 1 over a short context, as a decode step runs it: a paged
    cache (the GPU default), splits planned for the pool's capacity, captured in a graph; with and without a
    256 MB copy before it (the step's weight traffic evicts L2, the kernels' code included). Kernel times from the
    profiler, mean of 20 replays, µs."""
    from torch.autograd import DeviceType

    from sluice.kernels.mla import triton as mt

    R, P = 512, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = 64
    cache = torch.randn(blocks, page, R + P, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(2, blocks // 2).contiguous()
    q_lat = torch.randn(1, heads, R, device="cuda", generator=g).to(torch.bfloat16)
    q_pe = torch.randn(1, heads, P, device="cuda", generator=g).to(torch.bfloat16)
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.full((1,), context - 1, dtype=torch.int32, device="cuda")
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    visible = page * (blocks // 2)
    out = figures["mla_short"] = []
    for paged in (True, False):
        for name, kw in MLA_SHORT.items():
            for flush in (False, True):
                if not paged and flush is False and name != "default":
                    continue
                cache_l = cache if paged else cache.view(2, -1, R + P)

                def run():
                    if flush:
                        big2.copy_(big)
                    return mt.mla_decode(q_lat, q_pe, cache_l, rows, pos, visible, 0.1,
                                         table=table if paged else None, **kw)
                try:
                    run()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    graph.replay()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            graph.replay()
                        torch.cuda.synchronize()
                    times: dict = {}
                    for e in prof.events():
                        if e.device_type == DeviceType.CUDA:
                            times.setdefault(e.name[:20], []).append(e.time_range.end - e.time_range.start)
                    r = {"name": name, "paged": paged, "flush": flush, "context": context,
                         **{k: sum(v) / len(v) for k, v in times.items() if "mla" in k or "merge" in k}}
                except Exception as exc:  # noqa: BLE001
                    r = {"name": name, "paged": paged, "flush": flush, "error": repr(exc)[:300]}
                out.append(r)
                print(json.dumps(r), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,32,64")
    ap.add_argument("--v3-batches", default="1,32")
    ap.add_argument("--v3-moe-layers", type=int, default=8, help="MoE layers past the dense ones in the second "
                    "slice (8: their time ~10x the dense slice's run-to-run spread of ~0.1 ms)")
    ap.add_argument("--parts", default="mla,moonlight,v3")
    ap.add_argument("--variants", default=",".join(n for n in VARIANTS if not n.startswith(EXPERIMENTS)),
                    help="Moonlight's decode variants (VARIANTS; the experiments at batch 1 when named)")
    args = ap.parse_args(argv)
    figures: dict = {"gpu": torch.cuda.get_device_name(), "ok": True}
    t0 = time.perf_counter()
    if "mla" in args.parts:
        mla_short(figures)
    if "moonlight" in args.parts:
        try:
            moonlight([int(b) for b in args.batches.split(",")], figures, args.variants.split(","))
        except Exception:  # noqa: BLE001  (the V3 slices still run)
            figures["moonlight_error"] = traceback.format_exc()
            figures["ok"] = False
            print(figures["moonlight_error"], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    if "v3" in args.parts:
        v3_slices([int(b) for b in args.v3_batches.split(",")], args.v3_moe_layers, figures)
    took = time.perf_counter() - t0
    print(f"\nDeepSeek-family decode, {figures['gpu']}, 4-bit dummy weights, sampled ({took:.0f} s)")
    for r in figures.get("mla_short", []):
        times = ", ".join(f"{k.strip('_')} {v:.1f}" for k, v in r.items() if k.startswith("_"))
        print(f"MLA decode b1 {r['name']:14s} paged {r['paged']:d} L2 flushed {r['flush']:d}: "
              f"{times or r.get('error')}")
    for r in figures.get("moonlight", []):
        if "error" in r or r.get("decode_tok_s") is None:
            print(f"Moonlight {r['variant']:18s} batch {r['batch']:3d}: ERROR or no steady window (above)")
        else:
            print(f"Moonlight {r['variant']:18s} batch {r['batch']:3d}: {r['decode_tok_s']:8.1f} tok/s "
                  f"(floor {r['floor_decode_tok_s']:.0f})")
    for name, prof in figures.get("profiles", {}).items():
        print(f"Moonlight {name}, one replayed batch-1 step: {prof['kernels']} launches, span {prof['span_ms']:.3f} ms")
        for p in prof["top"][:10]:
            print(f"  {p['wall_ms']:8.3f} ms {p['calls']:5d}x  {p['kernel']}")
    p = figures.get("moonlight_prefill_4k", {})
    if "prefill_tok_s" in p:
        print(f"Moonlight 4k prefill: {p['prefill_tok_s']:.0f} tok/s, TTFT warm {p['ttft_warm_s']:.3f} s")
    for r in figures.get("v3_per_layer", []):
        print(f"DeepSeek-V3 batch {r['batch']}: dense slice {r['dense_slice_ms']:.2f} ms, "
              f"{r['moe_layer_ms']:.3f} ms per MoE layer, whole model ~{r['extrapolated_step_ms']:.1f} ms "
              f"= {r['extrapolated_tok_s']:.1f} tok/s on one GPU's bandwidth")
    return figures
