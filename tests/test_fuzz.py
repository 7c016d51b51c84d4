"""Fuzzing the loaders (issue #26): seeded mutants of tiny real checkpoints (GGUF F32/Q8_0/Q4_0, HF and MLX
directories of Llama and Qwen3-Next) are loaded, and run one short generation when they load, each in a child
process with a memory cap and a timeout. Any outcome but success or a SluiceError fails.

The children are forked from one server process (`python tests/test_fuzz.py --serve`) that imported sluice once,
so a mutant costs a fork and a load, not a Python start. `python -m benchmarks run fuzz_campaign` runs longer
campaigns with the same mutator and runner.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

OUTCOMES = ("ok", "ok_nonfinite", "sluice_error", "other_exception", "memory", "hang", "crash")
ACCEPTED = {"ok", "ok_nonfinite", "sluice_error"}  # nonfinite logits from damaged tensor bytes: not a load error
INTERESTING = [0, 1, 2, 3, 7, 31, 32, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53,
               2**63 - 1, 2**63, 2**64 - 1]
CONFIG_VALUES = [0, -1, 1, 3, 2**31, 2**32, 2**63, 10**30, 0.5, 1.5, -0.0, float("nan"), float("inf"), "64", None,
                 True, [], {}, [1, 2], "\udcff"]


# -- base checkpoints ----------------------------------------------------------------------------------------------

def build_bases(root: Path) -> dict[str, Path]:
    """The tiny checkpoints mutants are made from."""
    import shutil

    import gguf

    from helpers import save_hf_dir, save_llama_gguf, tiny_llama
    from sluice.formats.convert import convert
    from test_qwen3_next import qwen3_next, save

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    llama = tiny_llama(seed=7, num_hidden_layers=1, vocab_size=270)
    bases = {"gguf-f32": save_llama_gguf(llama, root / "f32.gguf"),
             "gguf-q8_0": save_llama_gguf(llama, root / "q8.gguf", gguf.GGMLQuantizationType.Q8_0),
             "gguf-q4_0": save_llama_gguf(llama, root / "q4.gguf", gguf.GGMLQuantizationType.Q4_0),
             "hf-llama": save_hf_dir(llama, root / "hf-llama")}
    bases["hf-qwen3-next"] = save(qwen3_next(seed=2, num_hidden_layers=2), root / "hf-qwen")
    bases["mlx-qwen3-next"] = convert(bases["hf-qwen3-next"], root / "mlx-qwen", bits=4, group_size=32, quiet=True)
    return bases


# -- the mutator ---------------------------------------------------------------------------------------------------

def _gguf_spots(path: Path) -> tuple[int, list[int], list[int]]:
    """(header length, offsets of metadata value types, offsets of tensor-info numbers) of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(path)
    types = [f.offset + 8 + len(f.name.encode()) for f in r.fields.values() if not f.name.startswith("GGUF.")]
    infos = []
    for t in r.tensors:
        pos = t.field.offset
        for p in t.field.parts:
            if p.dtype.itemsize >= 4:
                infos.append(pos)
            pos += p.nbytes
    return r.data_offset, types, infos


def _mutate_gguf(data: bytearray, spots, rng: random.Random) -> str:
    header_len, types, infos = spots
    op = rng.choice(["flip", "int", "type", "count", "value", "value", "tensor", "truncate", "data"])
    if op == "value":  # a numeric metadata value (head counts, lengths, epsilon, token ids) set to an edge
        pos = rng.choice(types)
        fmt = {4: "<I", 5: "<i", 6: "<f", 10: "<Q", 11: "<q", 12: "<d"}.get(struct.unpack_from("<I", data, pos)[0])
        if fmt is None:
            op = "int"
        elif fmt in ("<f", "<d"):
            struct.pack_into(fmt, data, pos + 4, rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30, -1e-6]))
        else:
            v = rng.choice(INTERESTING) % (2**32 if fmt in ("<I", "<i") else 2**64)
            struct.pack_into(fmt.upper(), data, pos + 4, v)
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(header_len)] ^= 1 << rng.randrange(8)
    elif op == "int":
        pos = rng.randrange(header_len - 8)
        fmt = rng.choice(["<Q", "<I"])
        struct.pack_into(fmt, data, pos, rng.choice(INTERESTING) % (2**64 if fmt == "<Q" else 2**32))
    elif op == "type":
        struct.pack_into("<I", data, rng.choice(types), rng.randrange(14))
    elif op == "count":  # a string length or an array's item type / count
        pos = rng.choice(types) + 4 + rng.choice([0, 4])
        struct.pack_into("<Q", data, pos, rng.choice(INTERESTING))
    elif op == "tensor":  # n_dims, a dim, the type or the offset of one tensor
        fmt = "<Q" if rng.random() < .6 else "<I"
        struct.pack_into(fmt, data, rng.choice(infos), rng.choice(INTERESTING) % (2**64 if fmt == "<Q" else 2**32))
    elif op == "truncate":
        del data[rng.randrange(len(data)):]
    else:
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(header_len, len(data))] = rng.randrange(256)
    return op


def _edit_json(obj, rng: random.Random):
    """Replace, drop or add one value somewhere in a JSON document (walks into nested objects and lists)."""
    while True:
        if isinstance(obj, dict) and obj:
            key = rng.choice(list(obj))
        elif isinstance(obj, list) and obj:
            key = rng.randrange(len(obj))
        else:
            return
        if isinstance(obj[key], (dict, list)) and obj[key] and rng.random() < .6:
            obj = obj[key]
            continue
        r = rng.random()
        if r < .15 and isinstance(obj, dict):
            del obj[key]
        else:
            obj[key] = rng.choice(CONFIG_VALUES) if r < .85 else [obj[key]] * rng.randint(0, 3)
        return


def _mutate_dir(d: Path, rng: random.Random) -> str:
    target = rng.choice(["config", "config", "config", "header", "header", "tokenizer", "bytes", "truncate"])
    files = {"config": d / "config.json", "tokenizer": d / "tokenizer.json"}
    st = rng.choice(sorted(d.glob("*.safetensors")))
    if target in files:
        doc = json.loads(files[target].read_text())
        for _ in range(rng.randint(1, 3)):
            _edit_json(doc, rng)
        files[target].write_text(json.dumps(doc, ensure_ascii=False, allow_nan=True), errors="surrogateescape")
        return target
    if target == "header":
        data = bytearray(st.read_bytes())
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + n])
        _edit_json(header, rng)
        raw = json.dumps(header, separators=(",", ":")).encode()
        st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
        return target
    path = rng.choice([files["config"], files["tokenizer"], st])
    data = bytearray(path.read_bytes())
    if target == "truncate":
        del data[rng.randrange(len(data)):]
    else:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(min(len(data), 4096))] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return target + ":" + path.name


def make_mutant(bases: dict[str, Path], out: Path, seed: int, index: int) -> tuple[Path, str]:
    """Mutant `index` of campaign `seed`, written under `out`: (its path, "<base>/<operation>")."""
    import shutil

    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(sorted(bases))
    base = bases[name]
    if base.is_dir():
        dst = out / f"m{index}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(base, dst)
        return dst, f"{name}/{_mutate_dir(dst, rng)}"
    spots = _SPOTS.get(base) or _SPOTS.setdefault(base, _gguf_spots(base))
    data = bytearray(base.read_bytes())
    op = _mutate_gguf(data, spots, rng)
    dst = out / f"m{index}.gguf"
    dst.write_bytes(bytes(data))
    return dst, f"{name}/{op}"


_SPOTS: dict[Path, tuple] = {}


# -- the runner: a fork server ---------------------------------------------------------------------------------------

def _child(path: str, cap: int) -> int:
    """In the forked child: load `path` and generate two tokens; the exit status says what happened."""
    import resource

    import torch

    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import sluice
    from sluice.errors import SluiceError

    try:
        model = sluice.load(path, device="cpu")
        logits = model.logits(model.tokenizer.encode("hi")[:4] or [0])
        model.generate("hello", max_tokens=2, temperature=0)
        return 0 if bool(torch.isfinite(logits).all()) else 1
    except SluiceError:
        return 2
    except MemoryError:
        return 4
    except BaseException as e:  # noqa: BLE001 - classifying every escape is the point
        text = f"{type(e).__name__}: {e}"
        if "alloc" in text and "memory" in text:
            return 4
        sys.stderr.write(f"FUZZ-ESCAPE {path} {text[:300]}\n")
        return 3


def serve() -> None:
    """Read {"path", "timeout"} lines on stdin; fork a child per mutant; answer {"outcome", "seconds"} lines."""
    import signal

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    import gguf  # noqa: F401 - imported once, before the forks (a child then costs a load, not imports)
    import tokenizers  # noqa: F401

    import sluice  # noqa: F401
    import sluice.engine.loader  # noqa: F401
    import sluice.formats.gguf  # noqa: F401
    import sluice.formats.hf  # noqa: F401
    from sluice.kernels.cpu import lib

    torch.set_num_threads(1)
    lib()
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    cap = vm + (int(os.environ.get("SLUICE_FUZZ_MEM_MB", "1536")) << 20)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _child(job["path"], cap)
            finally:
                sys.stderr.flush()
                os._exit(code)
        deadline, status = t0 + job["timeout"], None
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "hang"
            else:
                time.sleep(0.002)
        if status == "hang":
            outcome = "hang"
        elif os.WIFSIGNALED(status):
            outcome = "crash"
        else:
            outcome = {0: "ok", 1: "ok_nonfinite", 2: "sluice_error", 4: "memory"}.get(os.WEXITSTATUS(status),
                                                                                      "other_exception")
        print(json.dumps({"outcome": outcome, "seconds": round(time.monotonic() - t0, 3)}), flush=True)


class Runner:
    """A fork server in a subprocess (so the forking process has run no OpenMP code); `run(path)` -> outcome."""

    def __init__(self, timeout: float = 20.0):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, path: Path) -> str:
        self.proc.stdin.write(json.dumps({"path": str(path), "timeout": self.timeout}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["outcome"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def campaign(bases, out: Path, seed: int, n: int, runner: Runner, on_result=None) -> dict[str, int]:
    """Run mutants 0..n-1 of `seed`; counts by outcome. on_result(index, what, path, outcome) is called on each."""
    import shutil

    counts = dict.fromkeys(OUTCOMES, 0)
    for i in range(n):
        path, what = make_mutant(bases, out, seed, i)
        outcome = runner.run(path)
        counts[outcome] += 1
        if on_result:
            on_result(i, what, path, outcome)
        if outcome in ACCEPTED:  # keep the bad ones to look at
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    return counts


# -- the test --------------------------------------------------------------------------------------------------------

N_MUTANTS = int(os.environ.get("SLUICE_FUZZ_N", "240"))


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


def test_fuzz_loaders(tmp_path_factory, runner):
    bases = build_bases(tmp_path_factory.mktemp("bases"))
    out = tmp_path_factory.mktemp("mutants")
    for name, base in bases.items():  # the bases themselves load and run
        assert runner.run(base) == "ok", name
    bad = []
    counts = campaign(bases, out, seed=26, n=N_MUTANTS, runner=runner,
                      on_result=lambda i, what, path, outcome: outcome not in ACCEPTED and bad.append(
                          (i, what, outcome)))
    print("fuzz outcomes:", counts)
    assert not bad, f"mutants escaping the SluiceError promise (index, base/operation, outcome): {bad}"
    assert counts["sluice_error"] > N_MUTANTS // 4  # the mutator does reach the checks


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
