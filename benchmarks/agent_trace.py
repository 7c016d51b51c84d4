"""A multi-turn agent trace through the engine, with the prefix cache and without (issue #41).

    python -m benchmarks run agent_trace --model benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy
    python -m benchmarks run agent_trace --users 2 --turns 3 --system 300 --turn-tokens 30,120 --long 0 \
        --max-tokens 8                                                       # the demo model on the CPU, small

U users (closed loop: a user sends its next turn as soon as its last reply ends) share one system prompt; each turn
adds a user message of a random length (--turn-tokens) to the user's own history, and the reply (sampled at
temperature 1, seeded) joins the history too, as a chat client resends it. One more user (--long) brings a long
document in its first turn, so that later turns have a long history (~32k tokens). Token ids, not text: random
weights, any vocabulary.

Each request names the system prompt's end as a snapshot point, as `sluice serve` does for a chat's system message.
The same trace runs twice over the same weights, with the prefix cache and without (`prefix_cache=False`), each
engine warmed up first. Printed and returned: the prompt tokens the cache held (hit rate; beside it the share any
cache could hold: each prompt's longest common prefix with what was fed before, less its last token), time to first
token of every turn (p50, p99, and of the turns whose history is over --long-history tokens), the whole trace's time,
the ratio of the two runs' times, and the snapshot slots' bytes beside the KV cache's.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

import sluice

from .registry import checkpoint


def trace(args, vocab: int) -> list[list[list[int]]]:
    """Per user, per turn, the new user message's ids (the long user's first one with the document)."""
    rng = random.Random(args.seed)
    lo, hi = args.turn_tokens
    users = []
    for u in range(args.users + (1 if args.long else 0)):
        turns = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.turns)]
        if u == args.users:  # the long user
            turns[0] = [rng.randrange(vocab) for _ in range(args.long)] + turns[0]
        users.append(turns)
    return users


def run(model, args, users, system: list[int]) -> dict:
    """The trace through one engine: per turn (user, turn, prompt tokens, cached, TTFT), and the wall time."""
    engine = model.engine
    histories = [list(system) for _ in users]
    turn = [0] * len(users)
    live, turns = {}, []
    t0 = time.perf_counter()

    fed = []  # every request's ids whose KV was computed (its prompt, then its prompt + output but the last)

    def seen(ids) -> int:
        """The prompt tokens any cache could hold: the longest common prefix with anything fed before, less the
        last prompt token (whose logits must be computed)."""
        a, best = np.asarray(ids), 0
        for b in fed:
            n = min(len(a), len(b))
            diff = np.flatnonzero(a[:n] != b[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return min(best, len(a) - 1)

    def send(u):
        histories[u] += users[u][turn[u]]
        possible = seen(histories[u])
        seq = engine.add_request(histories[u], max_tokens=args.max_tokens, stop_ids=(), temperature=1.0,
                                 seed=1000 * u + turn[u], snapshot_at=(len(system),))  # as `sluice serve` does
        fed.append(np.asarray(histories[u]))
        live[seq.id] = (u, seq, time.perf_counter(), None, possible)

    for u in range(len(users)):
        send(u)
    while live:
        for out in engine.step():
            if out.seq.id not in live:
                continue
            u, seq, start, first, possible = live[out.seq.id]
            if first is None and out.token is not None:
                first = time.perf_counter() - start
                live[seq.id] = (u, seq, start, first, possible)
            if out.finished:
                del live[seq.id]
                turns.append({"user": u, "turn": turn[u], "prompt_tokens": len(seq.prompt), "cached": seq.cached,
                              "possible": possible, "ttft_s": first})
                fed.append(np.asarray(list(seq.prompt) + list(seq.output[:-1])))
                histories[u] += seq.output
                turn[u] += 1
                if turn[u] < args.turns:
                    send(u)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    # then the user with the longest history sends one more turn, alone: its time to first token with nothing beside
    u = max(range(len(users)), key=lambda i: len(histories[i]))
    histories[u] += users[u][-1]
    seq = engine.add_request(histories[u], max_tokens=1, stop_ids=(), temperature=1.0, seed=1)
    start = time.perf_counter()
    while not seq.output:
        engine.step()
    alone = {"prompt_tokens": len(seq.prompt), "cached": seq.cached, "ttft_s": time.perf_counter() - start}
    engine.run([seq])
    return {"turns": turns, "wall_s": wall, "alone": alone}


def summary(result: dict, long_history: int) -> dict:
    turns = result["turns"]
    ttft = sorted(t["ttft_s"] for t in turns if t["ttft_s"] is not None)
    long = [t["ttft_s"] for t in turns if t["prompt_tokens"] >= long_history and t["ttft_s"] is not None]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached"] for t in turns)
    possible = sum(t["possible"] for t in turns)
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    return {"turns": len(turns), "wall_s": round(result["wall_s"], 3), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "possible_hit_rate": round(possible / prompt, 4) if prompt else 0.0,
            "hits_of_possible": round(cached / possible, 4) if possible else 1.0,
            "ttft_p50_s": pick(ttft, 0.5), "ttft_p99_s": pick(ttft, 0.99),
            "long_turns": len(long), "long_ttft_p50_s": pick(sorted(long), 0.5),
            "long_ttft_max_s": max(long) if long else None,
            "max_prompt_tokens": max(t["prompt_tokens"] for t in turns)}


def one_run(model, args, users, system) -> dict:
    warm = model.engine.warmup()
    result = run(model, args, users, system)
    figures = {**summary(result, args.long_history), "alone": result["alone"], "warmup_s": round(warm, 1),
               "per_turn": result["turns"]}
    rows = model.engine.rows
    if rows.enabled:  # the snapshot slots beside the KV cache
        per = rows.pool.state_bytes()
        kv = rows.pool.nbytes() - per * (rows.pool.rows + 1)
        slots = 0 if rows.snapshots is None else rows.snapshots[0].shape[1]
        figures.update({"kv_bytes": kv, "snapshot_slots": slots, "snapshot_bytes": per * slots,
                        "snapshot_share": round(per * slots / kv, 4)})
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache", default="dense")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=4096, help="tokens of the shared system prompt")
    ap.add_argument("--turn-tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=(300, 2000),
                    help="a user message's tokens: lo,hi (uniform)")
    ap.add_argument("--long", type=int, default=24576,
                    help="tokens of the long user's document (0: no long user)")
    ap.add_argument("--long-history", type=int, default=28672, help="a turn with at least this many prompt tokens "
                    "counts as one with a long history")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens a reply has")
    ap.add_argument("--max-seq-len", type=int, default=None, help="default: the longest history + a reply")
    ap.add_argument("--decode-prefill-chunk", type=int, nargs="+", default=[None], metavar="N",
                    help="prompt tokens a step prefills beside decodes; several: one cached run each (default: the "
                         "engine's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("cached", "plain"), default=None, help="one of the two runs")
    args = ap.parse_args(argv)
    probe = sluice.load(args.model, load_format=args.load_format, device=args.device, kv_cache=args.kv_cache,
                        max_batch=1)
    vocab = probe.config.vocab_size
    users = trace(args, vocab)
    system = [random.Random(args.seed + 1).randrange(vocab) for _ in range(args.system)]
    # the longest history, and the turn sent alone after the trace (its last message again)
    longest = args.system + max(sum(map(len, u)) + len(u[-1]) for u in users) + args.turns * args.max_tokens + 1
    max_seq_len = args.max_seq_len or min(probe.context_length, -(-(longest + 1) // 256) * 256)
    if longest > max_seq_len:
        raise SystemExit(f"the longest history ({longest} tokens) is over max_seq_len {max_seq_len}")
    # rows for every user and as many again for the cached prefixes
    base = probe.with_engine(max_batch=2 * len(users), max_seq_len=max_seq_len)
    runs = {}
    figures = {"model": args.model, "users": args.users, "turns": args.turns, "system_tokens": args.system,
               "turn_tokens": list(args.turn_tokens), "long_tokens": args.long, "max_tokens": args.max_tokens,
               "max_seq_len": max_seq_len, "runs": runs}
    plans = [(f"cached{'' if n is None else f'/{n}'}", {"decode_prefill_chunk": n})
             for n in args.decode_prefill_chunk] + [("plain", {"prefix_cache": False})]
    for name, options in plans:
        if args.only and name.split("/")[0] != args.only:
            continue
        runs[name] = r = one_run(base.with_engine(**options), args, users, system)
        print(f"{name}: {r['turns']} turns in {r['wall_s']:.2f} s, hit rate {r['hit_rate']:.1%} (of "
              f"the {r['possible_hit_rate']:.1%} any cache could hold: {r['hits_of_possible']:.1%}), TTFT p50 "
              f"{r['ttft_p50_s']:.3f} s, p99 {r['ttft_p99_s']:.3f} s; turns over {args.long_history} tokens: "
              f"{r['long_turns']}, TTFT p50 {r['long_ttft_p50_s']} s, max {r['long_ttft_max_s']} s; one more turn "
              f"alone: {r['alone']['prompt_tokens']} tokens ({r['alone']['cached']} cached), TTFT "
              f"{r['alone']['ttft_s']:.3f} s", file=sys.stderr, flush=True)
        checkpoint(figures)
        if base.device.type == "cuda":
            torch.cuda.empty_cache()
    if "cached" in runs and "plain" in runs:
        figures["time_ratio"] = round(runs["cached"]["wall_s"] / runs["plain"]["wall_s"], 4)
        print(f"with the prefix cache the trace took {figures['time_ratio']:.2f}x the time without",
              file=sys.stderr)
    return figures
