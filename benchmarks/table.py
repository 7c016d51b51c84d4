"""`python -m benchmarks table [--check] [--perf PATH] [--results DIR]`: docs/PERF.md's current-numbers table, made
from the newest result JSON of each row and written between the `<!-- current-numbers:begin -->` and
`<!-- current-numbers:end -->` markers (--check: exit 1 when the file is not what the JSONs say).

Each row names the benchmark whose figures it shows. Its source is the newest record of that benchmark in the
results folder (the runner's schema: `benchmark`, `date`, `gpu`, `command`, `figures`) that holds the row's figure,
else the legacy file named for the row (results written before the runner, each in its own format: the small
adapters below read them). Figures are shown as the JSON holds them, rounded; nothing is recomputed except ratios
named as such.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- current-numbers:begin -->", "<!-- current-numbers:end -->"


@dataclass
class Source:
    """One result as the table reads it: the figures, and what ran them."""

    figures: object
    file: str
    date: str | None
    gpu: str | None
    command: str | None


def _legacy_command(cmd: str | None) -> str | None:
    """An old `benchmarks/NAME.py ARGS` command in the runner's form (its --json dropped)."""
    if not cmd:
        return None
    words = shlex.split(cmd)
    m = re.fullmatch(r"(?:benchmarks/)?(\w+)\.py", words[0]) if words else None
    if not m:
        return cmd
    rest, out = words[1:], []
    while rest:
        w = rest.pop(0)
        if w == "--json":
            rest = rest[1:]
        elif not w.startswith("--json="):
            out.append(w)
    return shlex.join(["python", "-m", "benchmarks", "run", m.group(1), *out])


def load(path: Path, legacy: dict | None = None) -> Source:
    """A result file: a runner record as it is, a legacy file through what its row says of it (`legacy`: date, gpu,
    command where the file does not carry them)."""
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and "benchmark" in doc and "figures" in doc:
        return Source(doc["figures"], path.name, (doc.get("date") or "")[:10] or None, doc.get("gpu"),
                      doc.get("command"))
    legacy = legacy or {}
    meta = doc if isinstance(doc, dict) else {}
    gpu = legacy.get("gpu") or meta.get("gpu") or (meta.get("device") if meta.get("device") not in ("cuda", None)
                                                   else None)
    return Source(doc, path.name, legacy.get("date") or meta.get("date"), gpu,
                  legacy.get("command") or _legacy_command(meta.get("command")))


@dataclass
class Row:
    what: str
    benchmark: str  # the runner's name: its newest record with this row's figure wins over the legacy file
    figure: Callable[[object], str | None]  # the figures -> the cell (None: not in this result)
    legacy: str | None = None  # results/ file name
    legacy_meta: dict = field(default_factory=dict)
    floor: str | Callable[[object], str | None] = ""  # the floor or the bar, where known
    match: Callable[[dict], bool] = lambda rec: True  # which records of the benchmark may serve (args, kv cache)


def _num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def _pick(rows, **want):
    for r in rows or ():
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def decode(batch: int):
    def cell(f):
        r = _pick(f.get("decode") if isinstance(f, dict) else None, batch=batch)
        return r and f"**{_num(r['decode_tok_s'])} tok/s** ({r['step_ms']:.2f} ms a step)"
    return cell


def engine_floor(batch: int):
    def cell(f):
        r = _pick(f.get("rows") if isinstance(f, dict) else None, batch=batch, kv_cache="dense")
        return r and r.get("floor_decode_tok_s") and (f"HBM floor {_num(r['floor_decode_tok_s'], 0)} tok/s "
                                                      f"({f.get('gpu', '?')}, `engine_gpu`)")
    return cell


def prefill(tokens: int):
    def cell(f):
        r = _pick(f.get("prefill") if isinstance(f, dict) else None, prompt_tokens=tokens)
        return r and f"**TTFT {r['ttft_warm_s']:.3f} s** (warm)"
    return cell


def closed(f):
    r = f.get("closed") if isinstance(f, dict) else None
    return r and (f"**{_num(r['output_tok_s'])} tok/s**, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                  f"p99 {r['ttft_p99_s']:.3f} s; step p50 {r['step_ms_p50']:.1f} ms")


def http(f):
    if not isinstance(f, dict) or "completion_tokens_per_s" not in f:
        return None
    return (f"**{_num(f['completion_tokens_per_s'])} tok/s**, TTFT p50 {f['ttft_p50_s']:.3f} s, p99 "
            f"{f['ttft_p99_s']:.3f} s, {f['errors']} errors ({f['requests']} requests, {f['duration_s']} s)")


def _default_policy(rows):
    """The run at the engine's default step budget beside decodes: "default", or the budget that is the default now
    (`sluice.config.GPU_DECODE_PREFILL_CHUNK`; older files' "default" was theirs)."""
    from sluice.config import GPU_DECODE_PREFILL_CHUNK

    return _pick(rows, policy="default") or _pick(rows, policy=str(GPU_DECODE_PREFILL_CHUNK))


def burst(f):
    r = _default_policy(f.get("burst") if isinstance(f, dict) else None)
    return r and (f"last first token **{r['last_first_token_s']:.3f} s**, p50 {r['first_token_p50_s']:.3f} s "
                  f"({r['steps']} steps)")


def join(f):
    r = _default_policy(f.get("join") if isinstance(f, dict) else None)
    return r and (f"TTFT **{r['ttft_s']:.2f} s**; step p99 {r['join_p99_ms']:.1f} ms = **{r['p99_over_normal']:.1f}×** "
                  f"normal ({r['normal_step_ms']:.1f} ms)")


def streaming(f):
    runs = f.get("runs") if isinstance(f, dict) else None
    if not runs:
        return None
    rates = " / ".join(_num(r["decode_tok_s"]) for r in runs)
    hits = " / ".join(f"{100 * r['hit_rate_run']:.0f} %" for r in runs)
    return (f"**{rates} tok/s** (batch {' / '.join(str(r['batch']) for r in runs)}), hit rate {hits}, "
            f"{f.get('gpu_memory')} budget")


def agent(plain_file: str):
    """The agent trace with the prefix cache (its first cached run) beside the same trace without it."""
    def cell(f):
        from sluice.config import GPU_DECODE_PREFILL_CHUNK

        runs = (f.get("runs") if isinstance(f, dict) else None) or {}
        cached = runs.get("cached") or runs.get(f"cached/{GPU_DECODE_PREFILL_CHUNK}") or \
            next((r for name, r in runs.items() if name.startswith("cached")), None)
        if cached is None or not (RESULTS / plain_file).exists():
            return None
        plain = json.loads((RESULTS / plain_file).read_text())["figures"]["runs"]["plain"]
        possible = (f" (of the {100 * cached['possible_hit_rate']:.1f} % any cache could hold)"
                    if "possible_hit_rate" in cached else "")
        return (f"**{cached['wall_s']:.1f} s** vs {plain['wall_s']:.1f} s without the cache "
                f"(**{cached['wall_s'] / plain['wall_s']:.2f}×**); hit rate {100 * cached['hit_rate']:.1f} "
                f"%{possible}; TTFT of turns over 28k tokens p50 {cached['long_ttft_p50_s']:.3f} s; "
                f"a {cached['alone']['prompt_tokens']}-token turn alone {cached['alone']['ttft_s']:.3f} s "
                f"(without: {plain['alone']['ttft_s']:.3f} s); snapshots "
                f"{100 * cached['snapshot_share']:.1f} % of the KV bytes")
    return cell


def llamacpp(test: str, ours: Callable[[object], float | None], ours_file: str):
    """llama.cpp's llama-bench figure (tg128, pp4096) beside ours from the same session's file."""
    def cell(f):
        if not isinstance(f, list):
            return None
        n_prompt, n_gen = (0, int(test[2:])) if test.startswith("tg") else (int(test[2:]), 0)
        peer = next((r["avg_ts"] for r in f if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen), None)
        mine = ours(json.loads((RESULTS / ours_file).read_text()))
        if peer is None or mine is None:
            return None
        return f"llama.cpp {test} {_num(peer)} tok/s; sluice **{_num(mine)}** (`{ours_file}`): **{mine / peer:.2f}×**"
    return cell


def cpu(f):
    if not isinstance(f, dict) or "llama.cpp" not in f:
        return None
    s, ref = f["sluice"], f["llama.cpp"]
    return (f"prefill **{_num(s['prefill_tok_s'])}** vs {_num(ref['prefill_tok_s'])} tok/s "
            f"({f['ratio']['prefill']:.2f}×); decode **{_num(s['decode_tok_s'])}** vs {_num(ref['decode_tok_s'])} "
            f"({f['ratio']['decode']:.2f}×)")


def paged(f):
    if not isinstance(f, dict) or "blocks" not in f:
        return None
    return (f"**{f['finished']}/{f['sequences']} finished** in {f['wall_s']:.1f} s: prompts of {f['lengths'][0]}–"
            f"{f['lengths'][1]} tokens ({f['prompt_tokens']} in all) + {f['max_tokens']} each in {f['blocks']} blocks "
            f"of {f['page']} = {f['kv_gib']} GiB of KV (rows of {f['max_seq_len']}: {f['rows_layout_kv_gib']} GiB); "
            f"{f['preemptions']} preemptions")


def budget(f):
    if not isinstance(f, dict) or "peak_bytes" not in f:
        return None
    g = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    return (f"peak **{g(f['peak_bytes'])}** under a {g(f['gpu_memory'])} budget ({'within' if f['within'] else 'over'}"
            f"); after the load {g(f['loaded_bytes'])}, after the warm-up {g(f['warm_bytes'])}; "
            f"{f['finished']}/{f['sequences']} finished")


def moonlight_decode(batch: int):
    def cell(f):
        rows = f.get("moonlight") if isinstance(f, dict) else None  # the default path: fused/mma (from session 9),
        r = (_pick(rows, batch=batch, variant="fused/mma")  # fused/grouped, or where a run of both skipped it (the
             or _pick(rows, batch=batch, variant="fused/grouped")  # same path), fused/gemv
             or _pick(rows, batch=batch, variant="fused/gemv"))
        return r and r.get("decode_tok_s") and (f"**{_num(r['decode_tok_s'])} tok/s** (HBM floor "
                                                f"{_num(r['floor_decode_tok_s'], 0)})")
    return cell


def moonlight_prefill(f):
    """TTFT, and 4,096 tokens over it (the bench's own prefill rate of files before session 7 was timed without
    waiting for the GPU)."""
    r = f.get("moonlight_prefill_4k") if isinstance(f, dict) else None
    return r and "ttft_warm_s" in r and (f"**TTFT {r['ttft_warm_s']:.3f} s** (warm): 4,096 tokens / TTFT = "
                                         f"**{_num(4096 / r['ttft_warm_s'], 0)} tok/s**")


def mla_kernel(f):
    r = _pick(f.get("rows") if isinstance(f, dict) else None, shape="moonlight 16 heads", B=16, S=32768)
    return r and (f"**{r['of_read_ceiling']:.2f} of the read ceiling** ({_num(r['gb_s'], 0)} GB/s, "
                  f"{r['us']:.1f} µs)")


def v3_slices(f):
    """The slices' steps and what their difference extrapolates to (the dense slice's run-to-run spread moves the
    difference: both steps are shown)."""
    per = f.get("v3_per_layer") if isinstance(f, dict) else None
    if not per:
        return None
    steps = {(r["batch"], r["layers"]): r["step_ms"] for r in f.get("v3_slices", []) if "step_ms" in r}

    def slices(b):
        mine = sorted((layers, ms) for (batch, layers), ms in steps.items() if batch == b)
        return " / ".join(f"{ms:.2f}" for _, ms in mine) + " ms (" + " / ".join(str(n) for n, _ in mine) + " layers)"
    return "; ".join(f"batch {r['batch']}: steps {slices(r['batch'])}, {r['moe_layer_ms']:.3f} ms a MoE layer, "
                     f"61 layers ~{r['extrapolated_step_ms']:.1f} ms = **{_num(r['extrapolated_tok_s'])} tok/s**"
                     for r in per)


def engine_pair(model: str, batch: int, before_variant: str, now_variant: str, floor: bool = True):
    """Issue #43: the decode step of two `moe_mma_gpu` engine variants of one run, the one before and now."""
    def cell(f):
        rows = f.get("engine") if isinstance(f, dict) else None
        before = _pick(rows, model=model, batch=batch, variant=before_variant)
        now = _pick(rows, model=model, batch=batch, variant=now_variant)
        if not (before and now and "decode_tok_s" in before and "decode_tok_s" in now):
            return None
        return (f"{_num(before['decode_tok_s'])} → **{_num(now['decode_tok_s'])} tok/s**"
                + (f" (HBM floor {_num(now['floor_decode_tok_s'], 0)})" if floor else ""))
    return cell


def mma_decode(model: str, batch: int):
    """The CUDA grouped expert GEMM beside the paths before it (session 9)."""
    return engine_pair(model, batch, "before (gemv + triton grouped)", "mma")


def mma_dense(model: str, batch: int):
    """The dense projections of 9-16 rows on the CUDA mma kernel beside the Triton GEMM (session 10)."""
    return engine_pair(model, batch, "mma/dense-triton-past-8", "mma", floor=False)


def mma_layer(model: str, T: int):
    """Issue #43: the routed experts of one layer, each path against the hit experts' bytes at copy bandwidth."""
    def cell(f):
        rows = [r for r in (f.get("layer") or []) if r.get("model") == model and r.get("T") == T and "us" in r] \
            if isinstance(f, dict) else []
        paths = {r["path"]: r for r in rows}
        if "mma" not in paths or "gemv" not in paths:
            return None
        order = ("gemv", "triton grouped", "mma")
        return "; ".join(f"{p} {paths[p]['us']:.1f} µs ({paths[p]['pct_floor']:.0f} %)" if p != "mma" else
                         f"**CUDA mma {paths[p]['us']:.1f} µs ({paths[p]['pct_floor']:.0f} %)**"
                         for p in order if p in paths) + f" of a {paths['mma']['floor_us']:.0f} µs floor"
    return cell


RESULTS = ROOT / "benchmarks" / "results"
DENSE = {"date": "2026-11-28"}  # the session-2 serving files carry no date; PERF's section does
SESSION5 = {"date": "2026-11-26", "gpu": "NVIDIA H100 80GB HBM3"}
_rows_h100 = lambda key, **want: lambda d: (_pick(d.get("rows"), **want) or {}).get(key)  # noqa: E731
DENSE_KV = lambda rec: "turboquant4" not in rec.get("command", "")  # noqa: E731
TQ_KV = lambda rec: "turboquant4" in rec.get("command", "")  # noqa: E731
CLIENTS = lambda n: lambda rec: (f"--clients {n}" in rec.get("command", "") and "cuda" in rec.get("command", "")  # noqa: E731
                                 and "--temperature 1" in rec.get("command", "")
                                 and "--deterministic" not in rec.get("command", ""))

ROWS = [
    *[Row(f"decode, batch {b} (dense KV, in process)", "serving_gpu", decode(b), "serving_dense_session2_h200.json",
          DENSE, floor=engine_floor(b), match=DENSE_KV) for b in (1, 16, 64)],
    *[Row(f"prefill, one {n // 1024}k prompt (dense KV)", "serving_gpu", prefill(n), "serving_dense_session2_h200.json",
          DENSE, match=DENSE_KV) for n in (4096, 32768)],
    Row("closed loop, 64 clients in process (dense KV)", "serving_gpu", closed, "serving_dense_session2_h200.json",
        DENSE, floor="bar ≥ 2,100 tok/s, TTFT p50 / p99 ≤ 0.1 / 0.3 s", match=DENSE_KV),
    Row("closed loop, 64 clients in process (TurboQuant KV)", "serving_gpu", closed,
        "serving_tq_closed_session2_h200.json", DENSE, match=TQ_KV),
    Row("HTTP, 64 streaming clients (`sluice serve`)", "server_load", http, "server_load_64_session2_h200.json",
        {"gpu": "NVIDIA H200"}, floor="bar ≥ 1,800 tok/s, TTFT p50 / p99 ≤ 0.15 / 0.5 s", match=CLIENTS(64)),
    Row("HTTP, 16 streaming clients", "server_load", http, "server_load_16_session2_h200.json", {"gpu": "NVIDIA H200"},
        match=CLIENTS(16)),
    Row("burst: 64 prompts of 512 tokens at once", "serving_gpu", burst, "serving_dense_session2_h200.json", DENSE,
        floor="bar ≤ 1.5 s", match=DENSE_KV),
    Row("join: a 32k prompt joins 8 decoding", "serving_gpu", join, "serving_dense_session2_h200.json", DENSE,
        floor="bar ≤ 2.0 s and ≤ 5×", match=DENSE_KV),
    Row("agent trace: 8 users x 10 turns behind a 4k system prompt, + one long history (prefix cache)", "agent_trace",
        agent("agent_trace_plain_h200.json"), None, {},
        floor="bar ≤ 0.3× the time, ≥ 90 % hits, TTFT ≤ 0.15 s at 32k, snapshots ≤ 10 %",
        match=lambda rec: bool(rec.get("gpu"))),
    Row("paged KV: 64 sequences of 128–32k tokens in a quarter of the rows layout's KV", "paged_kv", paged, None, {},
        floor="bar: every request finishes",
        match=lambda rec: bool(rec.get("gpu")) and "--blocks-share" not in rec.get("command", "")),
    Row("paged KV running out: 64 sequences of 1k–16k tokens + 1,024 generated each in a tenth of it", "paged_kv",
        paged, None, {}, floor="bar: preempted, every request finishes",
        match=lambda rec: bool(rec.get("gpu")) and "--blocks-share" in rec.get("command", "")),
    Row("one memory budget: Qwen3-Next-80B under `--gpu-memory 40GiB`", "memory_budget", budget, None, {},
        floor="bar: peak within the budget", match=lambda rec: bool(rec.get("gpu"))),
    *[Row(f"Moonlight-16B-A3B (MLA, DeepSeek-V3 layout) decode, batch {b}", "deepseek_gpu", moonlight_decode(b),
          floor=bar) for b, bar in ((1, "bar ≥ 600 tok/s"), (16, ""), (64, "bar ≥ 3,000 tok/s"))],
    Row("Moonlight-16B-A3B prefill, one 4k prompt", "deepseek_gpu", moonlight_prefill, floor="bar ≥ 20,000 tok/s"),
    Row("MLA decode kernel, 16 heads (Moonlight), 32k context, batch 16", "mla_gpu", mla_kernel,
        floor="bar ≥ 0.80; FlashMLA publishes ~3,000 GB/s on an H800 (~0.9 of its read rate)",
        match=lambda rec: "--sweep" not in rec.get("command", "")),
    Row("DeepSeek-V3 671B slices (3 dense + 8 MoE layers) on one GPU, extrapolated", "deepseek_gpu", v3_slices,
        floor="the whole model needs several GPUs (issue #44)"),
    *[Row(f"Qwen3-Next-80B decode, batch {b}: expert GEMVs / Triton grouped GEMMs → CUDA grouped mma (#43)",
          "moe_mma_gpu", mma_decode("qwen3-next", b), floor=bar)
      for b, bar in ((16, "bar ≥ 2,400 (H100)"), (64, "bar ≥ 3,600 (H100)"), (128, "bar ≥ 4,500 (H100)"))],
    *[Row(f"Moonlight-16B-A3B decode, batch {b}: before → CUDA grouped mma (#43)", "moe_mma_gpu",
          mma_decode("moonlight", b)) for b in (8, 16, 64, 128)],
    *[Row(f"{name} decode, batch 16: dense projections on the Triton GEMM → the CUDA mma kernel to 16 rows (#43)",
          "moe_mma_gpu", mma_dense(m, 16)) for m, name in (("qwen3-next", "Qwen3-Next-80B"),
                                                          ("moonlight", "Moonlight-16B-A3B"))],
    *[Row(f"MoE experts of one layer, {m}, {T} tokens (% of floor)", "moe_mma_gpu", mma_layer(m, T))
      for m, T in (("qwen3-next", 64), ("qwen3-next", 128), ("moonlight", 16))],
    Row("expert streaming, Qwen3.5-122B-A10B (experts in host memory)", "stream_gpu", streaming,
        "stream_122b_h100.json", {"command": "python -m benchmarks run stream_gpu --config "
                                             "benchmarks/configs/qwen3.5-122b-a10b.json --gpu-memory 24GiB"},
        floor="PCIe floor 36.9 / 38.9 tok/s (docs/perf-log.md, 2026-11-25)",
        match=lambda rec: "122b" in rec.get("command", "")),
    Row("llama.cpp side by side: decode (tg128 vs batch 1)", "llamacpp_bench",
        llamacpp("tg128", _rows_h100("decode_tok_s", batch=1, kv_cache="dense"), "engine_session5_h100.json"),
        "llamacpp_session5_h100.json", {**SESSION5, "command": "bash benchmarks/gpu_run.sh bench"}),
    Row("llama.cpp side by side: prefill (pp4096 vs a 4k prompt)", "llamacpp_bench",
        llamacpp("pp4096", _rows_h100("prefill_tok_s", prompt_tokens=4096), "prefill_session5_h100.json"),
        "llamacpp_session5_h100.json", {**SESSION5, "command": "bash benchmarks/gpu_run.sh bench"}),
    Row("CPU, demo model (SmolLM2-135M Q4_1, 2 threads) vs llama.cpp", "cpu_speed", cpu, "cpu_speed_demo.json",
        {"date": "2026-11-21", "gpu": "CPU", "command": "python -m benchmarks run cpu_speed"},
        floor="bar: decode ≥ 0.5×, prefill ≥ 1×"),
]


def records(results: Path) -> dict[str, list[tuple[dict, Path]]]:
    """The runner's records in the folder, by benchmark, newest first."""
    out: dict[str, list] = {}
    for p in results.glob("*.json"):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "benchmark" in doc and "figures" in doc and not doc.get("partial"):
            out.setdefault(doc["benchmark"], []).append((doc, p))
    for v in out.values():
        v.sort(key=lambda x: x[0].get("date") or "", reverse=True)
    return out


def source_for(row: Row, recs: dict, results: Path) -> tuple[Source, str] | None:
    for doc, p in recs.get(row.benchmark, []):
        if row.match(doc):
            src = load(p)
            cell = row.figure(src.figures)
            if cell:
                return src, cell
    if row.legacy and (results / row.legacy).exists():
        src = load(results / row.legacy, row.legacy_meta)
        cell = row.figure(src.figures)
        if cell:
            return src, cell
    return None


def floor_cell(row: Row, recs: dict, results: Path) -> str:
    if isinstance(row.floor, str):
        return row.floor
    for doc, _ in recs.get("engine_gpu", []):
        if "qwen3-next-80b" not in doc.get("command", ""):  # the table's model
            continue
        cell = row.floor(doc["figures"])
        if cell:
            return cell
    legacy = results / "engine_session5_h100.json"  # the newest engine_gpu file from before the runner
    return (row.floor(load(legacy).figures) or "") if legacy.exists() else ""


def table(results: Path = RESULTS) -> str:
    recs = records(results)
    lines = ["| what | now | floor / bar | GPU | date | source, command |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        found = source_for(row, recs, results)
        if found is None:
            lines.append(f"| {row.what} | (no result) | | | | |")
            continue
        src, cell = found
        gpu = (src.gpu or "?").replace("NVIDIA ", "")
        cmd = f"`{src.command}`" if src.command else ""
        lines.append(f"| {row.what} | {cell} | {floor_cell(row, recs, results)} | {gpu} | {src.date or '?'} | "
                     f"`{src.file}` {cmd} |")
    return "\n".join(lines)


def rewrite(text: str, body: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"the markers {BEGIN} / {END} are not in the file")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks table", description=__doc__.splitlines()[0])
    ap.add_argument("--perf", type=Path, default=ROOT / "docs" / "PERF.md")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="exit 1 if the table in the file is stale; write nothing")
    ap.add_argument("--print", action="store_true", help="print the table; write nothing")
    args = ap.parse_args(argv)
    body = table(args.results)
    if args.print:
        print(body)
        return 0
    text = args.perf.read_text()
    new = rewrite(text, body)
    if args.check:
        if new != text:
            print(f"{args.perf}: the current-numbers table is stale: run `python -m benchmarks table`")
            return 1
        return 0
    if new != text:
        args.perf.write_text(new)
        print(f"rewrote the current-numbers table of {args.perf}")
    return 0
