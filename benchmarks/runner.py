"""`python -m benchmarks run NAME [--json PATH] [--base REF] [ARGS...]`: one benchmark, its record, and optionally
the same benchmark on an older tree beside it.

--base REF: a git ref (its `src/` is taken with `git archive` into a temporary folder) or a folder holding a `src/`
(a tree copied by hand, e.g. `.base` on a machine without git). The benchmark code is this tree's; the package it
measures is REF's: the run is a subprocess with PYTHONPATH at REF's `src`. Both figures are printed side by side
and the record carries REF's under "base".
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import registry

ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "SLUICE_BENCH_COMMIT"  # the commit of the measured src, when it is not this tree's (--base)


def git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    """The measured tree's commit (short), "+dirty" when src/ or benchmarks/ differ from it; None without git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    head = git("rev-parse", "--short=12", "HEAD")
    if head and git("status", "--porcelain", "--", "src", "benchmarks"):
        head += "+dirty"
    return head


def gpu_name() -> str | None:
    torch = sys.modules.get("torch")  # a benchmark that used the GPU imported torch; others say it through nvidia-smi
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - a broken CUDA context must not lose the figures
            pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
            names = out.stdout.strip().splitlines()
            return names[0] if out.returncode == 0 and names else None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


def record(name: str, args: list[str], figures: dict, partial: bool = False) -> dict:
    rec = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count()}, "gpu": gpu_name(), "commit": commit(),
           "command": shlex.join(["python", "-m", "benchmarks", "run", name, *args]), "args": args,
           "figures": figures}
    if partial:
        rec["partial"] = True
    return rec


def write(path: str | Path, rec: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(path)


def parse(argv: list[str]) -> tuple[str, str | None, str | None, list[str]]:
    """NAME, --json, --base and the benchmark's own arguments (everything else; all of it after a `--`)."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m benchmarks run NAME [--json PATH] [--base REF] [ARGS...]")
    name, rest, out, base, own = argv[0], argv[1:], None, None, []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--":
            own += rest[i + 1:]
            break
        key, eq, value = a.partition("=")
        if key in ("--json", "--base"):
            if not eq:
                if i + 1 >= len(rest):
                    raise SystemExit(f"{key} needs a value")
                i, value = i + 1, rest[i + 1]
            out, base = (value, base) if key == "--json" else (out, value)
        else:
            own.append(a)
        i += 1
    return name, out, base, own


def lookup(name: str) -> registry.Benchmark:
    try:
        return registry.REGISTRY[name]
    except KeyError:
        raise SystemExit(f"no benchmark {name!r}; `python -m benchmarks list` lists them") from None


def child(name: str, own: list[str], out: Path, src: Path | None, extra: tuple[str, ...] = (),
          commit_id: str | None = None) -> int:
    """The benchmark in a subprocess: this package, `src` as the measured sluice (None: the one this process would
    import), `extra` repository folders importable."""
    env = dict(os.environ)
    ours = {str((ROOT / "src").resolve())}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src is not None:
        paths = [str(src)] + [p for p in paths if str(Path(p).resolve()) not in ours]
    paths = [str(ROOT / e) for e in extra] + paths
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SLUICE_BENCH_CHILD"] = "1"
    if commit_id:
        env[COMMIT_ENV] = commit_id
    cmd = [sys.executable, "-m", "benchmarks", "run", name, "--json", str(out), "--", *own]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def base_tree(ref: str, tmp: Path) -> tuple[Path, str]:
    """(the `src` folder of REF, its commit): a folder with a src/ as it is, else `git archive REF src`."""
    if (Path(ref) / "src").is_dir():
        return (Path(ref) / "src").resolve(), f"{ref} (folder)"
    sha = git("rev-parse", "--short=12", f"{ref}^{{commit}}")
    if sha is None:
        raise SystemExit(f"--base {ref}: neither a folder with a src/ nor a git ref of this repository")
    archive = subprocess.run(["git", "archive", sha, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp / "src", sha


def flatten(figures, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a figures dict, by dotted path (lists by index or by their rows' first string)."""
    out = {}
    items = figures.items() if isinstance(figures, dict) else enumerate(figures) if isinstance(figures, list) else ()
    for k, v in items:
        if isinstance(v, dict) and isinstance(figures, list):
            label = next((str(x) for x in v.values() if isinstance(x, str)), str(k))
            k = f"{k}:{label}"
        key = f"{prefix}{k}"
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = v
        elif isinstance(v, (dict, list)) and len(str(v)) < 200_000:
            out.update(flatten(v, key + "."))
    return out


def side_by_side(ours: dict, base: dict, ref: str) -> str:
    a, b = flatten(ours), flatten(base)
    keys = [k for k in a if k in b] + [k for k in a if k not in b] + [k for k in b if k not in a]
    width = min(70, max((len(k) for k in keys), default=10))
    lines = [f"{'figure':{width}s} {'this tree':>14s} {ref[:14]:>14s} {'ratio':>7s}"]
    for k in keys:
        x, y = a.get(k), b.get(k)
        ratio = f"{x / y:6.3f}x" if x is not None and y not in (None, 0) else ""
        fmt = lambda v: "" if v is None else f"{v:14.6g}"  # noqa: E731
        lines.append(f"{k[-width:]:{width}s} {fmt(x):>14s} {fmt(y):>14s} {ratio:>7s}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    name, out, base, own = parse(argv)
    bench = lookup(name)
    if bench.pythonpath and not os.environ.get("SLUICE_BENCH_CHILD"):
        # a benchmark that needs, say, tests/ importable runs in a child with it on PYTHONPATH (the import path is
        # never edited in process)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(out) if out else Path(tmp) / "record.json"
            status = child(name, own, path, None, bench.pythonpath)
            if not out and path.exists():
                print(json.dumps(json.loads(path.read_text())["figures"], default=str)[:4000])
        return status

    base_rec = None
    if base:
        with tempfile.TemporaryDirectory() as tmp:
            src, sha = base_tree(base, Path(tmp))
            print(f"# {name} on {base} ({sha}): {src}", flush=True)
            status = child(name, own, Path(tmp) / "base.json", src, bench.pythonpath, sha)
            path = Path(tmp) / "base.json"
            base_rec = json.loads(path.read_text()) if path.exists() else None
            if base_rec is None:
                print(f"# the run on {base} wrote nothing (exit status {status})", flush=True)
        print(f"# {name} on this tree", flush=True)

    if out:
        registry._writer = lambda figures: write(out, record(name, own, figures, partial=True))
    try:
        figures = bench.load()(own)
    finally:
        registry._writer = None
    figures = figures if isinstance(figures, dict) else {"result": figures}
    rec = record(name, own, figures)
    if base:
        rec["base"] = {"ref": base, "commit": base_rec and base_rec["commit"],
                       "figures": base_rec and base_rec["figures"], "partial": bool(base_rec and
                                                                                   base_rec.get("partial"))}
        if base_rec:
            print("\n" + side_by_side(figures, base_rec["figures"], base), flush=True)
    if out:
        write(out, rec)
        print(f"# wrote {out}", flush=True)
    return 1 if figures.get("ok") is False else 0
