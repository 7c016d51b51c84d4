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
--sweep: launch options (heads a program, positions a step, warps, stages, shortest split) at 32k, batch 1 and 16.
Correctness first, at real shapes, against fp32 attention over the same latents.
"""

from __future__ import annotations

import itertools
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


def torch_path(q_lat, q_pe, cache, rows, pos, S, scale):
    """What `LatentCache.attend` ran before the kernel: the rows gathered, scores, mask, softmax, the product."""
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
    res["ok"] = all(c["ok"] for c in res["correctness"])
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
    if args.sweep:
        S = 32768
        for (name, H), B in itertools.product(SHAPES.items(), (1, 16)):
            nbytes = B * S * (R + P) * 2
            bufs = [inputs(B, H, S, g) for _ in range(copies_for(nbytes))]
            rows = torch.arange(B, device="cuda", dtype=torch.int32)
            pos = torch.full((B,), S - 1, device="cuda", dtype=torch.int32)
            for bh, bn, warps, stages, mps in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (2, 3),
                                                                (64, 128, 256, 512)):
                kw = dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages, min_per_split=mps)
                try:
                    t = graph_time([lambda b=b: mla_decode(*b, rows, pos, S, scale, **kw) for b in bufs])
                except Exception as e:  # noqa: BLE001 (out of shared memory / registers: skipped)
                    res["sweep"].append({"shape": name, "B": B, **kw, "error": repr(e)[:200]})
                    continue
                res["sweep"].append({"shape": name, "B": B, **kw, "us": t * 1e6, "gb_s": nbytes / t / 1e9})
            best = min((s for s in res["sweep"] if s.get("shape") == name and s["B"] == B and "us" in s),
                       key=lambda s: s["us"], default=None)
            print(f"sweep best {name} B={B}: {best}")
            del bufs
    print(f"{'shape':24} {'B':>3} {'S':>6} {'us':>8} {'GB/s':>7} {'ceil':>5} {'copy':>5} {'torch us':>9}")
    for r in res["rows"]:
        print(f"{r['shape']:24} {r['B']:>3} {r['S']:>6} {r['us']:8.1f} {r['gb_s']:7.0f} {r['of_read_ceiling']:5.2f} "
              f"{r['of_copy']:5.2f} {r.get('torch_us', float('nan')):9.1f}")
    end_run(res)
    return res
