"""What the server benchmarks share (server_load, soak, hostile): `sluice serve` started on a free loopback port, the
built-in prompts, percentiles, and the server's RSS sampled every second while the load runs, summarised the same
way everywhere (after warm-up: the medians of the first and last quarters, their growth, the slope of the floor, the
peak)."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rivers.",
           "What is 12 times 12?", "Tell me a fact about the moon.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "What do bees make?", "Describe a cat in one sentence.",
           "How many days are in a week?", "What is the boiling point of water?", "Say hello in Spanish.",
           "What is the largest planet?", "Name a famous painter.", "What is a noun?", "Count from one to five."]


def free_port() -> int:
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


def start_server(serve_args: list[str], threads: int | None = None,
                 stderr=None) -> tuple[subprocess.Popen, str, dict]:
    """`python -m sluice serve` on a free loopback port with these arguments (OMP_NUM_THREADS=threads), once /health
    answers: the process, its URL and that answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sluice", "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
           "warning", *serve_args]
    server = subprocess.Popen(cmd, stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": str(threads)} if threads
                              else None)
    for _ in range(1200):
        try:
            return server, url, httpx.get(url + "/health", timeout=2).json()
        except httpx.HTTPError:
            if server.poll() is not None:
                raise SystemExit("the server exited during start-up")
            time.sleep(0.25)
    server.kill()
    raise SystemExit("the server did not answer within 5 minutes")


async def sampling_rss(pid: int, work, samples: list[tuple[float, int]]):
    """Await `work` while (time, RSS of `pid`) is appended to `samples` every second."""
    async def sample():
        while True:
            samples.append((time.perf_counter(), rss_bytes(pid)))
            await asyncio.sleep(1)

    sampler = asyncio.ensure_future(sample())
    try:
        return await work
    finally:
        sampler.cancel()


def slope_mib_per_min(samples: list[tuple[float, int]], window: float = 30) -> float:
    """The least-squares slope through the lowest sample of each whole `window`-second stretch (the floor: a leak
    raises it, the transient peaks of the largest batches' activations do not)."""
    groups: dict[int, list] = {}
    for t, b in samples:
        groups.setdefault(int(t // window), []).append((t, b))
    points = [(statistics.median(t for t, _ in g), min(b for _, b in g)) for g in groups.values()
              if len(g) >= window / 2]
    if len(points) < 2:
        return 0.0
    ts, bs = [t for t, _ in points], [b / 2**20 for _, b in points]
    tm, bm = statistics.fmean(ts), statistics.fmean(bs)
    var = sum((t - tm) ** 2 for t in ts)
    return 60 * sum((t - tm) * (b - bm) for t, b in zip(ts, bs)) / var if var else 0.0


def rss_summary(samples: list[tuple[float, int]], t0: float, wall: float, warmup: float) -> dict:
    """After warm-up (the first `warmup` fraction of the run): the median of the first and of the last quarter of the
    samples (growth = a leak), the slope of the floor, and the peak (transient: activations of the largest batches);
    then every sample, (seconds after t0, MiB)."""
    settled = [(t, b) for t, b in samples if t >= t0 + warmup * wall] or samples
    quarter = max(1, len(settled) // 4)
    early = statistics.median(b for _, b in settled[:quarter])
    late = statistics.median(b for _, b in settled[-quarter:])
    return {"rss_early_mib": round(early / 2**20, 1), "rss_late_mib": round(late / 2**20, 1),
            "rss_growth_pct": round(100 * (late - early) / early, 2),
            "rss_slope_mib_per_min": round(slope_mib_per_min(settled), 3),
            "rss_peak_mib": round(max(b for _, b in settled) / 2**20, 1),
            "rss_samples_mib": [[round(t - t0, 1), round(b / 2**20, 1)] for t, b in samples]}
