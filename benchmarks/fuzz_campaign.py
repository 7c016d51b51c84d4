"""A long fuzz campaign of the loaders (issue #26): the mutator and fork-server runner of tests/test_fuzz.py over N
mutants per seed; counts by outcome per seed, and every mutant that escaped the SluiceError promise kept on disk.

    python -m benchmarks run fuzz_campaign [--json results.json] --seeds 1 2 3 --n 2000 --out /tmp/fuzz

Outcomes: ok, ok_nonfinite (loaded and ran; damaged tensor bytes gave NaN/inf logits), sluice_error, and the
failures other_exception, memory (an allocation past the cap), hang (past --timeout), crash (a signal)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path




def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--n", type=int, default=1000, help="mutants per seed")
    ap.add_argument("--out", type=Path, default=Path("/tmp/sluice-fuzz"))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per mutant before it counts as a hang")
    args = ap.parse_args(argv)
    # tests/ is importable here: the registry runs this benchmark with it on PYTHONPATH
    from test_fuzz import ACCEPTED, OUTCOMES, Runner, build_bases, campaign

    bases = build_bases(args.out / "bases")
    runner = Runner(timeout=args.timeout)
    results, failures = {}, 0
    print("seed " + " ".join(f"{o:>15}" for o in OUTCOMES) + "  seconds")
    for seed in args.seeds:
        out = args.out / f"seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()

        def report(i, what, path, outcome):
            if outcome not in ACCEPTED:
                print(f"  seed {seed} mutant {i} ({what}): {outcome}, kept at {path}", flush=True)

        counts = campaign(bases, out, seed, args.n, runner, on_result=report)
        results[seed] = counts
        failures += sum(v for k, v in counts.items() if k not in ACCEPTED)
        print(f"{seed:>4} " + " ".join(f"{counts[o]:>15}" for o in OUTCOMES) + f"  {time.time() - t0:7.0f}",
              flush=True)
    runner.close()
    total = {o: sum(c[o] for c in results.values()) for o in OUTCOMES}
    print("all  " + " ".join(f"{total[o]:>15}" for o in OUTCOMES))
    return {"n_per_seed": args.n, "per_seed": results, "total": total, "ok": not failures}
