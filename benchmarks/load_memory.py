"""Host memory and time of loading a large MLX checkpoint onto a GPU, tensor by tensor.

Writes an MLX-format 4-bit checkpoint of about --gb GB to a temporary directory (the Qwen3-Next-80B-A3B config of
benchmarks/configs with as many layers as fit; sharded *.safetensors of ~--shard-gb GB with the index mlx-lm
writes, config.json, a byte-level tokenizer.json; quantized codes are random bytes, scales, biases and the other
tensors the dummy reader's values, so the loaded model is a sane one), then loads it with
`sluice.load(dir, device=...)` in fresh processes: first with the files dropped from the page cache (cold; read
from the disk), then again (warm; read from the page cache). Each process reports the load time, its peak host
RSS (VmHWM of /proc/self/status: everything the process ever held resident, the import of torch and the CUDA
context included) and its RSS before the load; the check is peak RSS < 2 GB + the largest tensor. Prints a table;
the runner's --json writes the numbers. The checkpoint is deleted at the end unless --keep.

    python -m benchmarks run load_memory --json benchmarks/results/load_memory_h100.json
    python -m benchmarks run load_memory --gb 0.05 --config tiny.json --device cpu   # a smoke test, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
from sluice.formats.dummy import DummyCheckpoint, byte_level_tokenizer  # noqa: E402

DEFAULT_CONFIG = ROOT / "benchmarks" / "configs" / "qwen3-next-80b-a3b.json"
BOUND_SLACK = 2e9  # bytes: the check is peak RSS < BOUND_SLACK + the largest tensor
_ST_DTYPES = {torch.uint32: "U32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def with_layers(config: dict, n: int) -> dict:
    """The config with its first n layers (layer_types and the per-layer quantization entries cut to match)."""
    c = json.loads(json.dumps(config))
    text = c.get("text_config", c)
    text["num_hidden_layers"] = n
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:n]
    for key in ("quantization", "quantization_config"):
        if key in c:
            c[key] = {k: v for k, v in c[key].items()
                      if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < n}
    return c


def fit_layers(config: dict, gb: float) -> dict:
    """The config with the fewest layers whose checkpoint holds at least `gb` GB (all of them if none does)."""
    text = config.get("text_config", config)
    for n in range(1, text["num_hidden_layers"] + 1):
        c = with_layers(config, n)
        if DummyCheckpoint(".", config=c).total_bytes >= gb * 1e9:
            return c
    return config


def write_checkpoint(config: dict, out: Path, shard_bytes: float) -> dict:
    """Write the MLX checkpoint of `config` to `out`; returns its size, shard count and largest tensor."""
    out.mkdir(parents=True, exist_ok=True)
    d = DummyCheckpoint(out, config=config)
    shards, cur, size = [], [], 0
    for name, spec in d.specs.items():  # model order; a shard closes once it holds shard_bytes
        cur.append(name)
        size += spec.nbytes
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = [], 0
    if cur:
        shards.append(cur)
    pool = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)  # random codes, reused
    weight_map, pos = {}, 0
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        names = sorted(names, key=lambda n: (-d.specs[n].dtype.itemsize, n))  # aligned, as safetensors writes
        header, offset = {"__metadata__": {"format": "mlx"}}, 0
        for n in names:
            s = d.specs[n]
            header[n] = {"dtype": _ST_DTYPES[s.dtype], "shape": list(s.shape),
                         "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for n in names:
                s = d.specs[n]
                if s.fill == "words":
                    left = s.nbytes
                    while left:
                        k_bytes = min(left, len(pool) - pos)
                        f.write(memoryview(pool[pos:pos + k_bytes]))
                        pos, left = (pos + k_bytes) % len(pool), left - k_bytes
                else:
                    f.write(memoryview(d.tensor(n).contiguous().view(torch.uint8).numpy()))
        weight_map.update({n: fname for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": d.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    largest = max(d.specs, key=lambda n: d.specs[n].nbytes)
    return {"bytes": d.total_bytes, "shards": len(shards), "tensors": len(d.specs),
            "largest_tensor": largest, "largest_tensor_bytes": d.specs[largest].nbytes}


def drop_from_page_cache(directory: Path) -> None:
    """Write the files back and drop their pages from the page cache, so the next read comes from the disk."""
    os.sync()
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(directory: str, device: str) -> None:
    """Runs in a fresh process: load the checkpoint, print one JSON line of measurements."""
    import sluice

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # the CUDA context, before the baseline is read
    before = _status()
    t0 = time.perf_counter()
    model = sluice.load(directory, device=dev, max_batch=1, max_seq_len=256, graphs=False)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    after = _status()
    result = {"seconds": seconds, "rss_before": before["VmRSS"], "peak_rss": after["VmHWM"],
              "rss_after": after["VmRSS"], "rss_anon_after": after["RssAnon"], "rss_file_after": after["RssFile"],
              "gpu_allocated": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0}
    try:  # after the measurement: a forward pass shows the loaded model works (its failure is reported, not fatal)
        result["finite_logits"] = bool(torch.isfinite(model.logits([[1, 2, 3]])).all())
    except Exception as e:  # noqa: BLE001
        result["forward_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(result))


def measure(directory: Path, device: str, label: str, largest: int, total: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "run", "load_memory", "--", "--child", str(directory),
                           "--device", device], capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"the {label} load failed:\n{proc.stdout}\n{proc.stderr}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(run=label, gb_per_s=total / r["seconds"] / 1e9, bound=BOUND_SLACK + largest,
             within_bound=r["peak_rss"] < BOUND_SLACK + largest)
    return r


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="an MLX-quantized model's config.json")
    ap.add_argument("--gb", type=float, default=22.0, help="checkpoint size to reach (GB; layers are dropped)")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a new temporary dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one load, in a fresh process: its result is the last line of its stdout
        child(args.child, args.device)
        return None

    config = fit_layers(json.loads(Path(args.config).read_text()), args.gb)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sluice-load-memory-"))
    try:
        t0 = time.perf_counter()
        ckpt = write_checkpoint(config, directory, args.shard_gb * 1e9)
        ckpt.update(write_seconds=time.perf_counter() - t0, config=Path(args.config).name,
                    layers=config.get("text_config", config)["num_hidden_layers"])
        print(f"wrote {ckpt['bytes'] / 1e9:.2f} GB in {ckpt['shards']} shards ({ckpt['layers']} layers of "
              f"{ckpt['config']}) in {ckpt['write_seconds']:.0f} s; largest tensor {ckpt['largest_tensor']} "
              f"({ckpt['largest_tensor_bytes'] / 1e6:.0f} MB)", flush=True)
        drop_from_page_cache(directory)
        runs = [measure(directory, args.device, label, ckpt["largest_tensor_bytes"], ckpt["bytes"])
                for label in ("cold", "warm")]
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"\n{device}; bound = 2 GB + largest tensor = {(BOUND_SLACK + ckpt['largest_tensor_bytes']) / 1e9:.2f} GB")
    print(f"{'run':5} {'load s':>7} {'GB/s':>6} {'RSS before':>11} {'peak RSS':>9} {'RSS after':>10} "
          f"{'anon':>7} {'file':>7}  within bound")
    for r in runs:
        print(f"{r['run']:5} {r['seconds']:7.1f} {r['gb_per_s']:6.2f} {r['rss_before'] / 1e9:9.2f}GB "
              f"{r['peak_rss'] / 1e9:7.2f}GB {r['rss_after'] / 1e9:8.2f}GB {r['rss_anon_after'] / 1e9:5.2f}GB "
              f"{r['rss_file_after'] / 1e9:5.2f}GB  {'yes' if r['within_bound'] else 'NO'}")
    return {"device": device, "torch": torch.__version__, "checkpoint": ckpt, "bound_slack_bytes": BOUND_SLACK,
            "runs": runs}
