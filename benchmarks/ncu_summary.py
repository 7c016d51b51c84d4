"""Summaries of an ncu report for reading without the GUI (device runs bring back text only):

    python benchmarks/ncu_summary.py metrics REPORT.ncu-rep   # per kernel: time, throughput, stall reasons
    python benchmarks/ncu_summary.py sass REPORT.ncu-rep      # per kernel: stall samples by SASS region
    python benchmarks/ncu_summary.py lines REPORT.ncu-rep     # per kernel: stall samples by source line
"""

import csv
import io
import subprocess
import sys

KEYS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
        "launch__occupancy_limit_registers", "launch__grid_size")


def ncu_csv(report, *args):
    out = subprocess.run(["ncu", "-i", report, "--csv", *args], capture_output=True, text=True).stdout
    return list(csv.reader(io.StringIO(out)))


def metrics(report):
    rows = ncu_csv(report, "--page", "raw")
    h = rows[0]
    for v in rows[2:]:
        print("---", v[h.index("Kernel Name")][:40])
        for a, c in zip(h, v):
            stall = "stalled" in a and a.endswith("ratio")
            if a in KEYS or stall:
                try:
                    if stall and float(c) < 0.1:
                        continue
                except ValueError:
                    pass
                print(f"  {a} {c}")


def source_blocks(report, view):
    """The source page of each kernel: [name, header, rows...]."""
    rows = ncu_csv(report, "--page", "source", "--print-source", view)
    blocks, cur = [], None
    for r in rows:
        if r and r[0] == "Kernel Name":
            cur = [r[1]]
            blocks.append(cur)
        elif cur is not None:
            cur.append(r)
    return blocks


def sass(report, width=100):
    blocks = source_blocks(report, "sass")
    for b in blocks:
        name, hdr, data = b[0], b[1], b[2:]
        i_s, i_src = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source")
        vals = [int(r[i_s]) if len(r) > i_s and r[i_s].isdigit() else 0 for r in data]
        tot = sum(vals) or 1
        print(f"== {name}: {tot} samples, {len(data)} instructions")
        for a in range(0, len(data), width):
            s = sum(vals[a:a + width])
            if s < tot * 0.02:
                continue
            kinds = {}
            for r in data[a:a + width]:
                t = r[i_src].split()
                if t:
                    op = (t[1] if t[0].startswith("@") and len(t) > 1 else t[0]).split(".")[0]
                    kinds[op] = kinds.get(op, 0) + 1
            top = sorted(range(a, min(a + width, len(data))), key=lambda i: -vals[i])[:2]
            print(f"{a:5d} {s:6d} ({100 * s / tot:4.1f}%) {sorted(kinds.items(), key=lambda x: -x[1])[:6]}")
            for i in top:
                print(f"        {i} {vals[i]} {data[i][i_src].strip()[:60]}")


def lines(report, top=40):
    """Stall samples per line of the kernel's source (Triton keeps line info; needs `--import-source yes`)."""
    blocks = source_blocks(report, "cuda")
    for b in blocks:
        name, hdr, data = b[0], b[1], b[2:]
        if "Warp Stall Sampling (All Samples)" not in hdr:
            print(f"== {name}: no stall samples in {hdr[:6]}")
            continue
        i_s, i_src = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source")
        i_line = hdr.index("Line") if "Line" in hdr else None
        vals = [int(r[i_s]) if len(r) > i_s and r[i_s].isdigit() else 0 for r in data]
        tot = sum(vals) or 1
        print(f"== {name}: {tot} samples, {len(data)} lines")
        for i in sorted(range(len(data)), key=lambda i: -vals[i])[:top]:
            line = data[i][i_line] if i_line is not None else i
            print(f"  {line:>5} {vals[i]:7d} ({100 * vals[i] / tot:4.1f}%) {data[i][i_src].strip()[:90]}")


if __name__ == "__main__":
    {"metrics": metrics, "sass": sass, "lines": lines}[sys.argv[1]](sys.argv[2])
