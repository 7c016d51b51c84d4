"""Load test of `sluice serve` on loopback: N concurrent streaming chat clients for a bounded time.

The server runs in its own process (`python -m sluice serve` on 127.0.0.1, a free port). First each distinct prompt is
sent alone (greedy): that reply is its reference. Then N clients stream greedy chat completions of those prompts in
turn until the time is up (and at most --max-requests in all). Every stream must end with [DONE], carry no error and
equal its prompt's reference; the server's RSS is sampled every second. Printed, and written as JSON: requests/s,
tokens/s, time to first token p50 / p99, whole-request latency, errors, mismatches, RSS after warm-up (the median of
its first and last quarters, their difference in %, the peak) and every RSS sample.

    python -m benchmarks run server_load --clients 64 --duration 300          # the demo model on the CPU
    python -m benchmarks run server_load --model benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy \
        --device cuda --endpoint completions --prompts 64 --clients 16 --duration 60   # a GPU, random weights

--endpoint completions streams raw-text completions (a model without a chat template: dummy weights); --prompts
beyond the 16 built-in ones are those with a number appended, so that N clients can each send their own prompt
(identical prompts route to the same experts and hide the cost of a batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from .serve import PROMPTS, percentile, prompt_list, rss_summary, sampling_rss, start_server

def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, stream: bool, temperature: float = 0,
                 seed: int = 0) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    if temperature:
        body["seed"] = seed
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                         endpoint: str = "chat", temperature: float = 0, seed: int = 0) -> dict:
    """One streamed chat (or text) completion: its text, time to first token, total time, errors."""
    body = request_body(endpoint, model, prompt, max_tokens, True, temperature, seed)
    t0, ttft, parts, done, error, tokens = time.perf_counter(), None, [], False, None, 0
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            text = (choice["delta"].get("content") if "delta" in choice else choice.get("text")) or ""
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
    if not done and error is None:
        error = "the stream ended without [DONE]"
    return {"text": "".join(parts), "ttft": ttft, "latency": time.perf_counter() - t0, "error": error,
            "tokens": tokens}


async def load(url: str, model: str, args, references: dict[str, str]) -> dict:
    prompts = prompt_list(args.prompts)
    results, started = [], 0
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)

    async def client_task(i: int, client: httpx.AsyncClient):
        nonlocal started
        k = i
        while time.perf_counter() < deadline and started < args.max_requests:
            started += 1
            prompt = prompts[k % args.prompts]
            k += args.clients
            try:
                r = await stream_request(client, model, prompt, args.max_tokens, args.endpoint, args.temperature, k)
            except httpx.HTTPError as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            r["prompt"], r["end"] = prompt, time.perf_counter()
            r["match"] = r.get("error") is None and r.get("text") == references.get(prompt, r.get("text"))
            results.append(r)

    # One connection pool for every client, made before the clock starts: an httpx.AsyncClient takes ~40 ms to
    # make (its SSL context), on the event loop. Made per client (until 2026-11-29) they held the loop for ~2.2 s
    # at 64 clients, and no first-wave response was read before the last was made: that wave's TTFT was the
    # benchmark's own (docs/perf-log.md, session 10).
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        await asyncio.gather(*[client_task(i, client) for i in range(args.clients)])
        return {"results": results, "wall_s": time.perf_counter() - t0, "t0": t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model to serve (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300, help="seconds of load")
    ap.add_argument("--max-requests", type=int, default=100_000, help="bound on the requests started")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, each reply checked against the prompt sent alone; above: sampled, seeded per "
                         "request (random weights decode greedily into a few tokens that route to a few experts), "
                         "not checked")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="distinct prompts")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--load-format", default="auto", help="passed to sluice serve (dummy: random weights)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--server-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="CPU threads of the server (OMP_NUM_THREADS; the rest is left to the clients)")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS is taken as settled")
    ap.add_argument("--serve-args", default="", help="more options of sluice serve, e.g. '--kv-cache turboquant4'")
    ap.add_argument("--server-log", help="where the server's stderr goes (default: a file in the temporary folder)")
    args = ap.parse_args(argv)
    args.prompts = max(1, args.prompts)

    log_path = args.server_log or Path(tempfile.gettempdir()) / f"sluice-server-load-{os.getpid()}.log"
    print(f"# the server's log: {log_path}", flush=True)
    server_log = open(log_path, "w")
    serve_args = ["--device", args.device, "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len),
                  "--load-format", args.load_format] + (["--model", args.model] if args.model else [])
    try:
        server, url, health = start_server(serve_args + args.serve_args.split(),
                                           args.server_threads if args.device == "cpu" else None, stderr=server_log)
    except BaseException:
        server_log.close()
        raise
    try:
        model = health["model"]
        # the references: each prompt alone (greedy), through the same server
        references = {}
        with httpx.Client(base_url=url, timeout=600) as c:
            for p in prompt_list(args.prompts) if not args.temperature else prompt_list(1):
                path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
                r = c.post(path, json=request_body(args.endpoint, model, p, args.max_tokens, False))
                r.raise_for_status()
                choice = r.json()["choices"][0]
                if not args.temperature:
                    references[p] = choice["message"]["content"] if args.endpoint == "chat" else choice["text"]

        rss: list[tuple[float, int]] = []
        out = asyncio.run(sampling_rss(server.pid, load(url, model, args, references), rss))
        final_health = httpx.get(url + "/health", timeout=5).json()
    finally:
        server.terminate()
        server.wait(30)
        server_log.close()

    results, wall = out["results"], out["wall_s"]
    ok = [r for r in results if r.get("error") is None]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    latency = [r["latency"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    report = {
        "date": time.strftime("%Y-%m-%d"), "device": args.device, "model": model, "clients": args.clients,
        "duration_s": round(wall, 1), "max_tokens": args.max_tokens, "distinct_prompts": args.prompts,
        "max_batch": args.max_batch, "server_threads": args.server_threads, "cpu_count": os.cpu_count(),
        "temperature": args.temperature,
        "requests": len(results), "errors": len(results) - len(ok),
        "mismatches": sum(1 for r in ok if not r["match"]),
        "requests_per_s": round(len(results) / wall, 3),
        "completion_tokens": tokens, "completion_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
        "latency_p50_s": round(percentile(latency, 50), 3), "latency_p99_s": round(percentile(latency, 99), 3),
        **rss_summary(rss, out["t0"], wall, args.warmup),
        "server_counters": final_health,
        "first_errors": [r["error"] for r in results if r.get("error")][:5],
        # per request, in the order they ended: when it started (s after the load began), TTFT, latency
        "timeline": [[round(r["end"] - r["latency"] - out["t0"], 2), r.get("ttft") and round(r["ttft"], 3),
                      round(r["latency"], 3)] for r in ok],
    }
    report["ok"] = report["errors"] == 0 and report["mismatches"] == 0
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_samples_mib", "timeline")}, indent=2))
    return report
