"""Raw read bandwidth of a disk, the floor of streaming experts from it: files dropped from the page cache, then
read with N threads of `pread`, in large sequential blocks and in expert-sized pieces at random offsets.

    python benchmarks/disk_read.py /path/to/checkpoint/*.safetensors --threads 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor


def evict(paths) -> None:
    """Drop the files from the OS page cache (written pages flushed first), so the next reads come from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(jobs, threads: int) -> float:
    """GB/s reading (path, offset, size) jobs with `threads` threads."""
    fds = {p: os.open(p, os.O_RDONLY) for p in {j[0] for j in jobs}}

    def one(job):
        path, offset, size = job
        buf = bytearray(size)
        return os.preadv(fds[path], [buf], offset)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(one, jobs))
    dt = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return n / dt / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--gb", type=float, default=4.0, help="bytes to read per pattern")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = {p: os.path.getsize(p) for p in args.files}
    out = {}
    for name, block in (("sequential_8MiB", 8 << 20), ("random_1MiB", 1 << 20), ("random_256KiB", 256 << 10)):
        evict(args.files)
        rng = random.Random(0)
        jobs, total = [], 0
        while total < args.gb * 1e9:
            p = rng.choice(args.files)
            if name.startswith("sequential"):
                offset = (total // block * block) % max(block, sizes[p] - block)
            else:
                offset = rng.randrange(0, max(1, sizes[p] - block))
            jobs.append((p, offset, block))
            total += block
        out[name] = read_all(jobs, args.threads)
        print(f"{name}: {out[name]:.2f} GB/s ({args.threads} threads)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
