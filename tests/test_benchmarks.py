"""The benchmark runner (`python -m benchmarks`), on the CPU: the registry lists, a registered benchmark runs and
writes the one record schema (and beside it the same benchmark on a `--base` tree), the PERF table is made from the
newest record, and no module under benchmarks/ edits sys.path. Everything through `python -m benchmarks` in a
subprocess: the tests import nothing from benchmarks/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, **kw)


def test_list_names_the_registered_benchmarks():
    out = bench("list")
    assert out.returncode == 0, out.stderr
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    assert {"serving_gpu", "engine_gpu", "prefill_gpu", "server_load", "soak", "hostile", "load_memory",
            "fuzz_campaign", "llamacpp_agreement", "cpu_speed", "stream_gpu", "moe_gpu", "qmatmul_gpu",
            "attention_gpu", "gdn_gpu", "tiny_cpu"} <= names
    assert bench("run", "no_such_benchmark").returncode != 0


def test_run_writes_the_record_and_the_base_beside_it(tmp_path):
    out = tmp_path / "tiny.json"
    run = bench("run", "tiny_cpu", "--json", str(out), "--base", str(ROOT), "--batch", "1", "--gen-tokens", "4",
                "--prompt-tokens", "16")
    assert run.returncode == 0, run.stdout + run.stderr
    rec = json.loads(out.read_text())
    assert {"benchmark", "date", "machine", "gpu", "commit", "command", "figures"} <= set(rec)
    assert rec["benchmark"] == "tiny_cpu" and rec["gpu"] is None and rec["machine"]["cpus"] >= 1
    assert rec["command"].startswith("python -m benchmarks run tiny_cpu") and "--gen-tokens 4" in rec["command"]
    assert rec["figures"]["batch"] == 1 and rec["figures"]["decode_tok_s"] > 0
    assert rec["base"]["ref"] == str(ROOT) and rec["base"]["figures"]["decode_tok_s"] > 0
    assert "decode_tok_s" in run.stdout and "ratio" in run.stdout  # the side-by-side table


def test_table_takes_the_newest_record(tmp_path):
    record = {"benchmark": "serving_gpu", "date": "2099-01-01T00:00:00+00:00", "machine": {"host": "h", "cpus": 1},
              "gpu": "Test GPU", "commit": "abc", "command": "python -m benchmarks run serving_gpu --scenarios decode",
              "args": [], "figures": {"decode": [{"batch": 1, "decode_tok_s": 1234.5, "step_ms": 0.81}]}}
    (tmp_path / "serving_test.json").write_text(json.dumps(record))
    out = bench("table", "--print", "--results", str(tmp_path))
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| decode, batch 1 "))
    assert "1,234.5 tok/s" in row and "Test GPU" in row and "2099-01-01" in row and "serving_test.json" in row
    assert "| decode, batch 16 (dense KV, in process) | (no result) |" in out.stdout
    # the committed PERF.md is what the committed results say
    assert bench("table", "--check").returncode == 0


def test_no_sys_path_edits_and_no_script_paths():
    for p in (ROOT / "benchmarks").rglob("*.py"):
        assert "sys.path" not in p.read_text(), p
    for p in (ROOT / "tests").glob("*.py"):  # a benchmark runs as `python -m benchmarks run NAME`, not by its path
        assert not re.search(r'"benchmarks"\s*/\s*"\w+\.py"|"benchmarks/\w+\.py"', p.read_text()), p
