"""What the work adjustment costs the detector (not a pytest test).

Simulates a run with variable-length work (``--tokens``, each rank its own batch every step) and one
straggler, pivots it once into the steps x ranks matrix, then times ``detect()`` on it in turns with and
without its work columns (the same busy times: without work the imbalance fit and the second detection
pass are skipped), ``--repeat`` times each, and prints the medians, their ratio and where the time with
work went (cProfile of one run, the imbalance module's functions and the detection passes).

    python benchmarks/detect_cost.py [--ranks 256 --steps 10000 --tokens 4096 --repeat 3]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from stragglerwatch.analysis.detect import StepMatrix, detect, to_matrix
from stragglerwatch.record.simulate import Injection, SimConfig, write_run
from stragglerwatch.record.steplog import load_run

#: The functions whose cumulative time the profile prints (the fit, the adjustment, the detection passes).
WATCHED = ("measure", "_als", "ranks_slope", "steps_level", "ranks_cut", "steps_rowmed", "model", "assess",
           "adjust", "_flag", "basis", "verdict")


def without_work(mat: StepMatrix) -> StepMatrix:
    return dataclasses.replace(mat, values={k: v for k, v in mat.values.items() if not k.startswith("work")},
                               work_unit="")  # fmt: skip


def timed(mat: StepMatrix) -> tuple[float, list[tuple[int, str]]]:
    t0 = time.perf_counter()
    verdict = detect(mat)
    return time.perf_counter() - t0, [(s.rank, s.cause) for s in verdict.stragglers]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--tokens", type=float, default=4096.0, help="mean tokens per rank per step (default 4096)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of each (default 3)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cfg = SimConfig(ranks=args.ranks, steps=args.steps, seed=3, tokens=args.tokens,
                        injections=[Injection(args.ranks // 3, 0.15, args.steps // 4, "compute")])  # fmt: skip
        run = write_run(Path(tmp) / "run", cfg)
        mat = to_matrix(load_run(run))
        print(f"simulated and pivoted {args.ranks} ranks x {args.steps} steps ({args.tokens:g} tokens a rank a "
              f"step, rank {args.ranks // 3} 15% slower in compute from step {args.steps // 4}) in "
              f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    plain = without_work(mat)
    timed(plain)  # a first run: imports and caches
    withs, withouts = [], []
    for _ in range(args.repeat):
        withs.append(timed(mat))
        withouts.append(timed(plain))
    w, wo = statistics.median(t for t, _ in withs), statistics.median(t for t, _ in withouts)
    print(f"detect() with work: {w:.2f} s (flagged {withs[-1][1]}); without: {wo:.2f} s (flagged {withouts[-1][1]})")
    pairs = statistics.median(a[0] / b[0] for a, b in zip(withs, withouts, strict=True))
    print(f"medians of {args.repeat} interleaved runs each; with / without: {w / wo:.1f}x (median of the pairs' "
          f"ratios {pairs:.1f}x)")
    prof = cProfile.Profile()
    prof.runcall(detect, mat)
    stats = pstats.Stats(prof)
    rows = [(func[2], func[0].rsplit("/", 2)[-1], v[3], v[1]) for func, v in stats.stats.items()  # type: ignore[attr-defined]
            if func[2] in WATCHED and "stragglerwatch" in func[0]]  # fmt: skip
    print("where the time with work went (cumulative seconds under cProfile, calls):")
    for name, where, cum, calls in sorted(rows, key=lambda r: -r[2]):
        print(f"  {where}:{name:<16} {cum:7.2f} s  {calls:4d} calls")


if __name__ == "__main__":
    main()
