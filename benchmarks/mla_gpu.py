"""MLA decode attention on the GPU: the absorbed split-K Triton kernel (`kernels/mla/triton.py`) over a bf16 latent
cache, against the torch path it replaces (the latents gathered per row, `reference.absorbed_attention`'s einsums on
q_lat) and against the bandwidth floor.

    python -m benchmarks run mla_gpu [--json out.json] [--sweep] [--contexts 4096,32768] [--batches 1,16,64]

Shapes: Moonlight-16B-A3B / DeepSeek-V2-Lite (16 heads) and DeepSeek-V3 (128 heads), kv_lora_rank 512, rope 64
(576 bf16 values a position). One query per sequence at the last position, every sequence in its own cache row.
Cold L2 (the caches rotate over enough copies), CUDA-graph replay. Bytes counted: the latents of every visible
position (B * S * 1152) plus q and the output. Columns: time, GB/s, that over the measured read ceiling
(`gpu.read_ceiling` of the same bytes) and over half the device copy bandwidth (read + write counted there).
FlashMLA's published figure for comparison: ~3,000 GB/s on an H800 (bf16 latents, 64+ heads; issue 42).
--sweep (instead of the table; issue 42): a small grid of launch variants (`SWEEP`: heads a program, positions a
step, warps, stages, the shortest split, programs an SM for the split plan; the previous design's sizes as "old")
at 16 and 128 heads over --batches x --contexts, each checked against fp32 attention and timed; per shape the best,
and per head count the variant with the least total time relative to the default (what the defaults should be).
About 3 minutes on an H200 (most of it compiling the variants):

    python -m benchmarks run mla_gpu --sweep --json benchmarks/results/mla_gpu_sweep_h200.json

Correctness first, at real shapes (and a paged cache at 128 heads), against fp32 attention over the same latents.
"""

from __future__ import annotations

import itertools
import math
import traceback

import torch

from .gpu import copies_for, copy_bandwidth, end_run, graph_time, read_ceiling, rel_err, start_run
from sluice.kernels.mla.triton import mla_decode

SHAPES = {"moonlight 16 heads": 16, "deepseek-v3 128 heads": 128}
R, P = 512, 64
BF16 = torch.bfloat16


def inputs(B, H, S, g):
    cache = torch.randn(B, S, R + P, device="cuda", generator=g, dtype=BF16)
    q_lat = torch.randn(B, H, R, device="cuda", generator=g, dtype=BF16)
    q_pe = torch.randn(B, H, P, device="cuda", generator=g, dtype=BF16)
    return q_lat, q_pe, cache


def triton_cdiv(a, b):
    return -(-a // b)


# launch variants the sweep times: name -> mla_decode keywords (the defaults: `default_sizes`, `plan_splits`)
SWEEP = {
    16: {"default": {},  # 16 heads a program, 32 positions a step, 4 warps, 2 stages, waves of resident programs
         "bn16": {"block_n": 16}, "bn64": {"block_n": 64}, "stages3": {"num_stages": 3},
         "bn16_stages3": {"block_n": 16, "num_stages": 3}, "split256": {"min_per_split": 256},
         "old": {"programs_per_sm": 2}},  # the split plan of about two programs an SM (the previous one's count)
    128: {"default": {},  # 64 heads a program (wgmma), 32 positions, 8 warps, 2 stages, one program an SM
          "bn64": {"block_n": 64}, "bn16": {"block_n": 16}, "stages3": {"num_stages": 3},
          "warps16": {"num_warps": 16}, "split512": {"min_per_split": 512}, "per_sm2": {"programs_per_sm": 2},
          "old": {"block_h": 32, "num_warps": 8, "programs_per_sm": 2}},  # the previous design: 32 heads, mma.sync
}


def sweep(res, batches, contexts, g, scale):
    """Every variant of SWEEP at every (heads, batch, context): correct (against fp32 attention on one of the
    rotated caches) and its time; the best per shape; per head count the variants' total time over the default's."""
    res["sweep"], res["sweep_best"], res["sweep_summary"] = [], [], []
    for H, variants in SWEEP.items():
        for S, B in itertools.product(contexts, batches):
            nbytes = B * S * (R + P) * 2
            n = copies_for(nbytes)
            bufs = [inputs(B, H, S, g) for _ in range(n)]
            rows = torch.arange(B, device="cuda", dtype=torch.int32)
            pos = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
            ref = reference(*bufs[0], scale)
            ceiling = read_ceiling(nbytes, n)
            shape = []
            for name, kw in variants.items():
                try:
                    err = rel_err(mla_decode(*bufs[0], rows, pos, S, scale, **kw), ref)
                    t = graph_time([lambda b=b: mla_decode(*b, rows, pos, S, scale, **kw) for b in bufs], reps=10)
                except Exception as e:  # noqa: BLE001 (out of shared memory / registers: noted, skipped)
                    res["sweep"].append({"H": H, "B": B, "S": S, "variant": name, **kw, "error": repr(e)[:300]})
                    print(f"sweep H={H} B={B} S={S} {name}: {e!r}"[:300])
                    continue
                row = {"H": H, "B": B, "S": S, "variant": name, **kw, "us": t * 1e6, "gb_s": nbytes / t / 1e9,
                       "of_read_ceiling": ceiling / t, "rel_err": err, "ok": err < 1e-2}
                res["sweep"].append(row)
                shape.append(row)
                print(f"sweep H={H:3} B={B:2} S={S:5} {name:13} {t * 1e6:9.1f} us {nbytes / t / 1e9:6.0f} GB/s "
                      f"{ceiling / t:5.2f} of ceiling  err {err:.1e}")
            del bufs, ref
            good = [r for r in shape if r["ok"]]
            if good:
                best = min(good, key=lambda r: r["us"])
                default = next((r for r in good if r["variant"] == "default"), None)
                res["sweep_best"].append({"H": H, "B": B, "S": S, "best": best["variant"], "us": best["us"],
                                          "of_read_ceiling": best["of_read_ceiling"],
                                          "default_us": default and default["us"]})
                print(f"best H={H} B={B} S={S}: {best['variant']} {best['us']:.1f} us "
                      f"({best['of_read_ceiling']:.2f} of ceiling; default {default and round(default['us'], 1)} us)")
            if any(not r["ok"] for r in shape):
                res["ok"] = False
                res["errors"].append(f"sweep H={H} B={B} S={S}: wrong result from "
                                     f"{[r['variant'] for r in shape if not r['ok']]}")
        # which variant a default should be: the geometric mean over the shapes of its time / the default's
        rows = [r for r in res["sweep"] if r["H"] == H and "us" in r and r["ok"]]
        base = {(r["B"], r["S"]): r["us"] for r in rows if r["variant"] == "default"}
        for name in variants:
            ratios = [r["us"] / base[(r["B"], r["S"])] for r in rows
                      if r["variant"] == name and (r["B"], r["S"]) in base]
            if ratios:
                gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                res["sweep_summary"].append({"H": H, "variant": name, "time_vs_default": gm, "shapes": len(ratios),
                                             "worst": max(ratios), "best": min(ratios)})
        for r in sorted((r for r in res["sweep_summary"] if r["H"] == H), key=lambda r: r["time_vs_default"]):
            print(f"summary H={H:3} {r['variant']:13} time / default: geo-mean {r['time_vs_default']:.3f} "
                  f"(best {r['best']:.2f}, worst {r['worst']:.2f}, {r['shapes']} shapes)")


def torch_path(q_lat, q_pe, cache, rows, pos, S, scale):
    """What `MLAAttention.forward` ran before the kernel: the rows gathered, scores, mask, softmax, the product."""
    kv = cache[rows.long(), :S]
    c, k_pe = kv[..., :R], kv[..., R:]
    s = (torch.einsum("bhr,bsr->bhs", q_lat, c) + torch.einsum("bhp,bsp->bhs", q_pe, k_pe)).float() * scale
    hidden = torch.arange(S, device=cache.device)[None, :] > pos[:, None].long()
    s = s.masked_fill(hidden[:, None], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", torch.softmax(s, -1).to(BF16), c)


def reference(q_lat, q_pe, cache, scale):
    c = cache.float()
    s = (torch.einsum("bhr,bsr->bhs", q_lat.float(), c[..., :R]) + torch.einsum("bhp,bsp->bhs", q_pe.float(),
                                                                                 c[..., R:])) * scale
    return torch.einsum("bhs,bsr->bhr", torch.softmax(s, -1), c[..., :R])


def main(argv=None):
    args, dev, res = start_run(argv, "rows", "sweep", "correctness", "errors", flags=("--sweep",),
                               values=("--contexts", "--batches"))
    contexts = [int(x) for x in (args.contexts or "4096,32768").split(",")]
    batches = [int(x) for x in (args.batches or "1,16,64").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = 1 / (R + P) ** 0.5
    copy = copy_bandwidth(dev)
    res["copy_tb_s"] = copy / 1e12
    for name, H in SHAPES.items():  # correctness at real shapes, splits and all
        for B, S in ((3, 5000), (16, 32768)):
            q_lat, q_pe, cache = inputs(B, H, S, g)
            rows = torch.arange(B, device="cuda", dtype=torch.int32)
            pos = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
            err = rel_err(mla_decode(q_lat, q_pe, cache, rows, pos, S, scale), reference(q_lat, q_pe, cache, scale))
            res["correctness"].append({"shape": name, "B": B, "S": S, "rel_err": err, "ok": err < 1e-2})
            del q_lat, q_pe, cache
    for H in SHAPES.values():  # paged (blocks of 64 in a shuffled order), the same latents
        B, S, page = 3, 5000, 64
        q_lat, q_pe, cache = inputs(B, H, S, g)
        nblk = triton_cdiv(S, page)
        paged = torch.zeros(B * nblk + 1, page, R + P, device="cuda", dtype=BF16)
        table = torch.randperm(B * nblk, device="cuda", generator=g).to(torch.int32).view(B, nblk)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, nblk * page - S))
        paged[table.flatten().long()] = padded.reshape(B * nblk, page, R + P)
        rows = torch.arange(B, device="cuda", dtype=torch.int32)
        pos = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
        err = rel_err(mla_decode(q_lat, q_pe, paged, rows, pos, S, scale, table=table),
                      reference(q_lat, q_pe, cache, scale))
        res["correctness"].append({"shape": f"{H} heads, paged {page}", "B": B, "S": S, "rel_err": err,
                                   "ok": err < 1e-2})
        del q_lat, q_pe, cache, paged
    res["ok"] = all(c["ok"] for c in res["correctness"])
    if args.sweep:
        sweep(res, batches, contexts, g, scale)
        end_run(res)
        return res
    for (name, H), S, B in itertools.product(SHAPES.items(), contexts, batches):
        try:
            nbytes = B * S * (R + P) * 2
            n = copies_for(nbytes)
            bufs = [inputs(B, H, S, g) for _ in range(n)]
            rows = torch.arange(B, device="cuda", dtype=torch.int32)
            pos = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
            t = graph_time([lambda b=b: mla_decode(*b, rows, pos, S, scale) for b in bufs])
            moved = nbytes + 2 * B * H * (R + P) * 2
            row = {"shape": name, "B": B, "S": S, "us": t * 1e6, "gb_s": moved / t / 1e9,
                   "of_read_ceiling": read_ceiling(nbytes, n) / t, "of_copy": moved / t / (copy / 2)}
            if B * S <= 16 * 32768 and H <= 16:  # the torch path materialises [B, H, S] scores and a gather
                row["torch_us"] = graph_time([lambda b=b: torch_path(*b, rows, pos, S, scale) for b in bufs[:2]]) * 1e6
            res["rows"].append(row)
            print(row)
            del bufs
        except Exception as e:  # noqa: BLE001 (one shape failing keeps the others)
            res["errors"].append(f"{name} B={B} S={S}: {e!r}")
            traceback.print_exc()
    print(f"{'shape':24} {'B':>3} {'S':>6} {'us':>8} {'GB/s':>7} {'ceil':>5} {'copy':>5} {'torch us':>9}")
    for r in res["rows"]:
        print(f"{r['shape']:24} {r['B']:>3} {r['S']:>6} {r['us']:8.1f} {r['gb_s']:7.0f} {r['of_read_ceiling']:5.2f} "
              f"{r['of_copy']:5.2f} {r.get('torch_us', float('nan')):9.1f}")
    end_run(res)
    return res
