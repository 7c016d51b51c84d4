"""Soak test of `sluice serve`: N clients send a mix of requests for a long time while the server's RSS is sampled
every second; after warm-up it should stay flat (the issue's bar: within 3 %).

    python -m benchmarks run soak --clients 8 --duration 300           # the demo model on the CPU
    python -m benchmarks run soak --clients 64 --duration 1800

Each client cycles through the kinds: a streamed and a whole greedy chat, a streamed completion, seeded sampling with
penalties, logprobs, a JSON-object reply (a grammar), a client that disconnects mid-stream, and a bad request (400).
Every reply of a deterministic kind must equal the first reply to the same request. Printed, and written as JSON:
requests and errors per kind, mismatches, RSS after warm-up (the medians of its first and last quarters and their
difference in %, the slope in MiB per minute of their 30-second floors, the peak), every sample, and the server's
counters.
The server and the samples are those of `server_load.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time

import httpx

from .serve import prompt_list, rss_summary, sampling_rss, start_server

PLAIN = {"temperature": 0}
KINDS = {  # name -> (path, extra body, streamed, deterministic)
    "chat_stream": ("/v1/chat/completions", PLAIN, True, True),
    "chat_whole": ("/v1/chat/completions", PLAIN, False, True),
    "completion_stream": ("/v1/completions", PLAIN, True, True),
    "seeded_penalties": ("/v1/chat/completions", {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7,
                                                  "presence_penalty": 0.5, "repetition_penalty": 1.1}, True, True),
    "logprobs": ("/v1/chat/completions", {"temperature": 0, "logprobs": True, "top_logprobs": 3}, False, True),
    "json_object": ("/v1/chat/completions", {"temperature": 0, "response_format": {"type": "json_object"}}, False,
                    True),
    "disconnect": ("/v1/chat/completions", PLAIN, True, False),
    "bad_request": ("/v1/chat/completions", {"temperature": float("nan")}, False, False),
}


def body_for(kind: str, model: str, prompt: str, max_tokens: int) -> dict:
    path, extra, streamed, _ = KINDS[kind]
    body = {"model": model, "max_tokens": max_tokens, "stream": streamed, **extra}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one(client: httpx.AsyncClient, kind: str, body: dict) -> dict:
    """Send one request of a kind: its outcome (the reply's text for comparison, or an error)."""
    path, _, streamed, _ = KINDS[kind]
    content = json.dumps(body).encode()  # NaN is written as NaN: the bad request
    headers = {"Content-Type": "application/json"}
    if kind == "bad_request":
        r = await client.post(path, content=content, headers=headers)
        ok = r.status_code == 400 and r.json().get("error", {}).get("param") == "temperature"
        return {"error": None if ok else f"HTTP {r.status_code}: {r.text[:200]}"}
    if not streamed:
        r = await client.post(path, content=content, headers=headers)
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        # the tokens, not their log probabilities: those move in the last bits with the batch
        tokens = [t["token"] for t in ((choice.get("logprobs") or {}).get("content") or [])]
        return {"error": None, "text": json.dumps([text, tokens])}
    parts, done = [], False
    async with client.stream("POST", path, content=content, headers=headers) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            for choice in chunk["choices"]:
                parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            if kind == "disconnect" and len(parts) >= 3:
                return {"error": None}  # leaving the stream closes the connection: the server must abort it
    return {"error": None if done else "the stream ended without [DONE]", "text": "".join(parts)}


async def soak(url: str, model: str, args) -> dict:
    prompts = prompt_list(args.prompts)
    results, first = [], {}
    deadline = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)

    async def client_task(i: int):
        kinds = itertools.cycle(list(KINDS)[i % len(KINDS):] + list(KINDS)[:i % len(KINDS)])
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
            for n in itertools.count():
                if time.perf_counter() >= deadline:
                    return
                kind, prompt = next(kinds), prompts[(i + n) % len(prompts)]
                try:
                    r = await one(client, kind, body_for(kind, model, prompt, args.max_tokens))
                except httpx.HTTPError as e:
                    r = {"error": f"{type(e).__name__}: {e}"}
                r["kind"] = kind
                if r["error"] is None and KINDS[kind][3]:
                    r["match"] = first.setdefault((kind, prompt), r["text"]) == r["text"]
                results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*[client_task(i) for i in range(args.clients)])
    return {"results": results, "wall_s": time.perf_counter() - t0, "t0": t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model to serve (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="auto", help="passed to sluice serve (dummy: random weights)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=300, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--server-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="CPU threads of the server (OMP_NUM_THREADS; the rest is left to the clients)")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS is taken as settled")
    ap.add_argument("--serve-args", default="", help="more options of sluice serve, e.g. '--deterministic'")
    ap.add_argument("--server-log", default=None, help="where the server's stderr goes (default: this process's)")
    args = ap.parse_args(argv)

    server, url, health = start_server(
        ["--device", args.device, "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len),
         "--load-format", args.load_format] + (["--model", args.model] if args.model else [])
        + args.serve_args.split(),
        args.server_threads if args.device == "cpu" else None,
        stderr=open(args.server_log, "w") if args.server_log else None)
    model, rss = health["model"], []
    try:
        out = asyncio.run(sampling_rss(server.pid, soak(url, model, args), rss))
        counters = httpx.get(url + "/health", timeout=5).json()
    finally:
        server.terminate()
        server.wait(30)

    results, wall = out["results"], out["wall_s"]
    by_kind = {k: {"requests": 0, "errors": 0, "mismatches": 0} for k in KINDS}
    for r in results:
        row = by_kind[r["kind"]]
        row["requests"] += 1
        row["errors"] += r["error"] is not None
        row["mismatches"] += r.get("match") is False
    report = {
        "date": time.strftime("%Y-%m-%d"), "device": args.device, "model": model, "clients": args.clients,
        "duration_s": round(wall, 1), "max_tokens": args.max_tokens, "max_batch": args.max_batch,
        "serve_args": args.serve_args,
        "server_threads": args.server_threads, "cpu_count": os.cpu_count(), "requests": len(results),
        "errors": sum(r["error"] is not None for r in results), "mismatches": sum(r.get("match") is False
                                                                                   for r in results),
        "by_kind": by_kind,
        **rss_summary(rss, out["t0"], wall, args.warmup),
        "server_counters": counters,
        "first_errors": [f"{r['kind']}: {r['error']}" for r in results if r["error"]][:5],
    }
    report["ok"] = report["errors"] == 0 and report["mismatches"] == 0
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples_mib"}, indent=2))
    return report
