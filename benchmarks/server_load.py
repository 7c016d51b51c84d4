"""Load test of `sluice serve` on loopback: N concurrent streaming chat clients for a bounded time.

The server runs in its own process (`python -m sluice serve` on 127.0.0.1, a free port). First each distinct prompt is
sent alone (greedy): that reply is its reference. Then N clients stream greedy chat completions of those prompts in
turn until the time is up (and at most --max-requests in all). Every stream must end with [DONE], carry no error and
equal its prompt's reference; the server's RSS is sampled every second. Printed, and written as JSON: requests/s,
tokens/s, time to first token p50 / p99, whole-request latency, errors, mismatches, RSS after warm-up (the median of
its first and last quarters, their difference in %, the peak) and every RSS sample.

    python benchmarks/server_load.py --clients 64 --duration 300          # the demo model on the CPU
    python benchmarks/server_load.py --model benchmarks/configs/qwen3-next-80b-a3b.json --load-format dummy \
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
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rivers.",
           "What is 12 times 12?", "Tell me a fact about the moon.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "What do bees make?", "Describe a cat in one sentence.",
           "How many days are in a week?", "What is the boiling point of water?", "Say hello in Spanish.",
           "What is the largest planet?", "Name a famous painter.", "What is a noun?", "Count from one to five."]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def prompt_list(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(n)]


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
    results, deadline, started = [], time.perf_counter() + args.duration, 0
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)

    async def client_task(i: int):
        nonlocal started
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
            k = i
            while time.perf_counter() < deadline and started < args.max_requests:
                started += 1
                prompt = prompts[k % args.prompts]
                k += args.clients
                try:
                    r = await stream_request(client, model, prompt, args.max_tokens, args.endpoint,
                                             args.temperature, k)
                except httpx.HTTPError as e:
                    r = {"error": f"{type(e).__name__}: {e}"}
                r["prompt"], r["end"] = prompt, time.perf_counter()
                r["match"] = r.get("error") is None and r.get("text") == references.get(prompt, r.get("text"))
                results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*[client_task(i) for i in range(args.clients)])
    return {"results": results, "wall_s": time.perf_counter() - t0, "t0": t0}


def main() -> int:
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
    ap.add_argument("--json", default="benchmarks/results/server_load.json")
    ap.add_argument("--server-log", help="where the server's stderr goes (default: the JSON's path, .server.log)")
    args = ap.parse_args()
    args.prompts = max(1, args.prompts)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sluice", "serve", "--host", "127.0.0.1", "--port", str(port), "--device",
           args.device, "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len),
           "--log-level", "warning", "--load-format", args.load_format] + (["--model", args.model] if args.model else [])
    cmd += args.serve_args.split()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads)} if args.device == "cpu" else None
    server_log = open(args.server_log or Path(args.json).with_suffix(".server.log"), "w")
    server = subprocess.Popen(cmd, env=env, stderr=server_log)
    try:
        for _ in range(1200):
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("the server exited during start-up")
                time.sleep(0.25)
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

        async def run():
            async def sample_rss():
                while True:
                    rss.append((time.perf_counter(), rss_bytes(server.pid)))
                    await asyncio.sleep(1)

            sampler = asyncio.ensure_future(sample_rss())
            try:
                return await load(url, model, args, references)
            finally:
                sampler.cancel()

        out = asyncio.run(run())
        final_health = httpx.get(url + "/health", timeout=5).json()
    finally:
        server.terminate()
        server.wait(30)
        server_log.close()

    results, wall = out["results"], out["wall_s"]
    ok = [r for r in results if r.get("error") is None]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    latency = [r["latency"] for r in ok]
    settled = out["t0"] + args.warmup * wall
    after = [b for t, b in rss if t >= settled] or [b for _, b in rss]
    quarter = max(1, len(after) // 4)
    early, late = statistics.median(after[:quarter]), statistics.median(after[-quarter:])
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
        # after warm-up: the median of the first and of the last quarter of the samples (growth = a leak), and the
        # peak (transient: activations of the largest batches)
        "rss_early_mib": round(early / 2**20, 1), "rss_late_mib": round(late / 2**20, 1),
        "rss_growth_pct": round(100 * (late - early) / early, 2), "rss_peak_mib": round(max(after) / 2**20, 1),
        "rss_samples_mib": [[round(t - out["t0"], 1), round(b / 2**20, 1)] for t, b in rss],
        "server_counters": final_health,
        "first_errors": [r["error"] for r in results if r.get("error")][:5],
        # per request, in the order they ended: when it started (s after the load began), TTFT, latency
        "timeline": [[round(r["end"] - r["latency"] - out["t0"], 2), r.get("ttft") and round(r["ttft"], 3),
                      round(r["latency"], 3)] for r in ok],
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_samples_mib", "timeline")}, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["errors"] == 0 and report["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
