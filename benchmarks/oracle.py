"""Detection delay against an oracle, on the same series at the same false-alarm rate (not a pytest test).

The oracle knows what no detector can: the noise model without the straggler (each rank's mean excess
over its peers in the straggler-free twin of the run, same seed) and the true shift. It runs the
CUSUM that is optimal for that knowledge (Page's, reference at half the shift, each step clipped at the
shift plus four robust standard deviations of the healthy noise) on the straggler's excess
``e = busy / median(other ranks' busy) - 1``, the series our detector reads too. Its alarm level is set
on the straggler-free twins so that it raises no more false alarms there than our detector raised flags:
both are judged at the same false-alarm rate (zero, where we raised none: then the level is the highest
the oracle's CUSUM reached on any healthy rank, which flatters it).

Noise kinds (none of them the detector's tuning set, ``benchmarks/accuracy.py``):

- ``trace AR``, ``trace SE``, ``trace ST``: the published traces' per-step residuals, resampled;
- ``here``: residuals of real gloo runs of this project's own test jobs, resampled;
- ``GC bursts``: quiet noise (0.5%) with heavy-tailed slow steps now and then (1% of steps, Pareto);
- ``two-mode``: 20% of steps 25% slower, in runs of three;
- ``host drift``: slow drift shared by a host's ranks (3%).

One rank of 32 becomes 2, 3, 5, 10 or 20% busier at step 600 of 1,200 (100 ms steps). Per noise kind
and size: how often each finds it before the run ends, the median delay (steps after the onset; a miss
counts as never), their ratio, and our onset estimate's median error. Goal: ours within 2x the oracle's.

    python benchmarks/oracle.py                 # every kind, 8 trials a cell (a few minutes on 2 cores)
    python benchmarks/oracle.py --quick         # 3 trials a cell
    python benchmarks/oracle.py --kind "trace SE" --trials 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import flagged  # noqa: E402
from heldout import BASE, SOURCES, seed_of  # noqa: E402

from stragglerwatch.analysis.detect import detect  # noqa: E402
from stragglerwatch.record.simulate import Injection, SimConfig, simulate_arrays, to_frame  # noqa: E402

KINDS = {
    "trace AR": SOURCES["trace AR"],
    "trace SE": SOURCES["trace SE"],
    "trace ST": SOURCES["trace ST"],
    "here": SOURCES["here, other shapes"],
    "GC bursts": {**BASE, "noise": 0.005, "spike_prob": 0.01, "spike_mag": 0.3, "spike_tail": 1.5},
    "two-mode": SOURCES["two-mode runs 20% x1.25"],
    "host drift": SOURCES["host drift 3%"],
}
SIZES = (0.02, 0.03, 0.05, 0.10, 0.20)
RANKS, STEPS, ONSET, SLOW = 32, 1200, 600, 5


def excess(busy: np.ndarray) -> np.ndarray:
    """Steps x ranks: each rank's busy time over the median of the other ranks' (what the detector reads)."""
    out = np.empty_like(busy)
    for j in range(busy.shape[1]):
        out[:, j] = busy[:, j] / np.median(np.delete(busy, j, axis=1), axis=1) - 1.0
    return out


def cusum(x: np.ndarray, reference: float, clip: float) -> np.ndarray:
    """Page's one-sided CUSUM of ``x`` (centred on its healthy mean) with ``reference``, each step clipped to
    ``+-clip`` (robust to the noise's tails: the oracle knows them)."""
    s, out = 0.0, np.empty(len(x))
    for t, v in enumerate(np.clip(x, -clip, clip)):
        s = max(0.0, s + v - reference)
        out[t] = s
    return out


def config(kind: str, trial: int, size: float | None) -> SimConfig:
    cfg = SimConfig(ranks=RANKS, steps=STEPS, seed=seed_of("oracle", kind, trial), **KINDS[kind])
    return cfg if size is None else replace(cfg, injections=[Injection(SLOW, size, onset=ONSET)])


def ours(cfg: SimConfig) -> tuple[int | None, int | None]:
    """Our delay (steps after the onset at which the flag rose) and onset error; None: not found."""
    hits = [s for s in flagged(detect(to_frame(cfg))) if s.rank == SLOW and s.detected_step >= ONSET - 5]
    if not hits:
        return None, None
    first = min(hits, key=lambda s: s.detected_step)
    return first.detected_step - ONSET, first.first_step - ONSET


def median_delay(delays: list[int | None]) -> float:
    """The median with a miss counted as never (inf)."""
    return float(statistics.median([np.inf if d is None else d for d in delays])) if delays else np.nan


def run_kind(kind: str, trials: int) -> list[dict]:
    healthy = [config(kind, t, None) for t in range(trials)]
    mean = [excess(simulate_arrays(c)["busy_s"]) for c in healthy]  # the oracle's noise model, per trial
    false_ours = sum(len(flagged(detect(to_frame(c)))) for c in healthy)
    rows = []
    # the healthy noise's spread (robust), for the oracle's clip: 4 of them above the shift
    spread = float(np.median([1.4826 * np.median(np.abs(e - np.median(e, axis=0)), axis=0) for e in mean]))
    for size in SIZES:
        clip = size + 4.0 * spread
        # the oracle's level: on the healthy twins, as many false alarms as we raised flags (at least none)
        peaks = sorted((float(cusum(e[:, j] - e[:, j].mean(), size / 2, clip).max()) for e in mean
                        for j in range(RANKS)), reverse=True)  # fmt: skip
        level = peaks[min(false_ours, len(peaks) - 1)] + 1e-12
        mine, oracle, onset = [], [], []
        for t in range(trials):
            cfg = config(kind, t, size)
            e = excess(simulate_arrays(cfg)["busy_s"])[:, SLOW] - mean[t][:, SLOW].mean()
            s = cusum(e, size / 2, clip)
            above = np.flatnonzero(s[ONSET:] > level)
            oracle.append(int(above[0]) if above.size else None)
            delay, err = ours(cfg)
            mine.append(delay)
            if err is not None:
                onset.append(err)
        m, o = median_delay(mine), median_delay(oracle)
        rows.append({"kind": kind, "size": size, "found": sum(d is not None for d in mine),
                     "oracle_found": sum(d is not None for d in oracle), "trials": trials, "ours": m, "oracle": o,
                     "ratio": m / o if np.isfinite(m) and np.isfinite(o) and o > 0 else
                     (1.0 if m == o else np.inf), "onset_error": statistics.median(onset) if onset else None,
                     "false_flags": false_ours})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", action="append", choices=list(KINDS), help="a noise kind (default: every one)")
    p.add_argument("--trials", type=int, default=8, help="runs per noise kind and size (default 8)")
    p.add_argument("--quick", action="store_true", help="3 trials a cell")
    args = p.parse_args()
    trials = 3 if args.quick else args.trials
    print(f"### Detection delay vs the oracle: {RANKS} ranks x {STEPS} steps, one rank slowed at step {ONSET}, "
          f"{trials} runs per cell\n")  # fmt: skip
    print("| noise | size | found (ours / oracle) | median delay, ours | oracle | ratio | onset error (median) "
          "| our false flags on the healthy twins |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for kind in args.kind or list(KINDS):
        t0 = time.perf_counter()
        for r in run_kind(kind, trials):
            worst = max(worst, r["ratio"])
            err = "-" if r["onset_error"] is None else f"{r['onset_error']:+.0f}"
            print(f"| {kind} | {r['size']:.0%} | {r['found']}/{r['trials']} / {r['oracle_found']}/{r['trials']} "
                  f"| {r['ours']:.0f} | {r['oracle']:.0f} | {r['ratio']:.1f}x | {err} | {r['false_flags']} |")
        print(f"<!-- {kind}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)
    print(f"\nlargest ratio: {worst:.1f}x (goal: 2x or less in every cell)")


if __name__ == "__main__":
    main()
