"""A long fuzz campaign of the loaders (issue #26): the mutator and fork-server runner of tests/test_fuzz.py over N
mutants per seed; counts by outcome per seed, and every mutant that escaped the SluiceError promise kept on disk.

    python benchmarks/fuzz_campaign.py --seeds 1 2 3 --n 2000 --out /tmp/fuzz [--json results.json]

Outcomes: ok, ok_nonfinite (loaded and ran; damaged tensor bytes gave NaN/inf logits), sluice_error, and the
failures other_exception, memory (an allocation past the cap), hang (past --timeout), crash (a signal)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from test_fuzz import ACCEPTED, OUTCOMES, Runner, build_bases, campaign


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--n", type=int, default=1000, help="mutants per seed")
    ap.add_argument("--out", type=Path, default=Path("/tmp/sluice-fuzz"))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per mutant before it counts as a hang")
    ap.add_argument("--json", type=Path, help="write the per-seed counts here")
    args = ap.parse_args()
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
    if args.json:
        args.json.write_text(json.dumps({"n_per_seed": args.n, "per_seed": results, "total": total}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
