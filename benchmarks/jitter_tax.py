"""The jitter tax projection checked against the simulator at known scales (not a pytest test).

For each noise kind, a straggler-free job of ``--ranks`` ranks is simulated and analysed; the report's
projection (``analysis/jittertax.py``: the expected slowest of more hosts, drawn from this run's per-step
deviations) at 2x and 8x is set against what jobs of 2x and 8x the ranks, same noise, actually lose to
jitter (the simulator's own runs, analysed the same way: ``lost_seconds / job_seconds``).

    python benchmarks/jitter_tax.py                 # 16 ranks, 600 steps, 3 seeds per kind
    python benchmarks/jitter_tax.py --ranks 32 --seeds 5
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from stragglerwatch.analysis.detect import detect
from stragglerwatch.analysis.jittertax import project
from stragglerwatch.record.simulate import SimConfig, to_frame

BASE = dict(step_ms=250.0, comm_ms=10.0, drift=0.002, offset=0.002, ranks_per_host=8)  # fmt: skip
KINDS = {
    "1% jitter": {"noise": 0.01, "spike_prob": 0.0},
    "1% + host 0.4%": {"noise": 0.01, "spike_prob": 0.0, "host_noise": 0.004},
    "0.6% + rare spikes": {"noise": 0.006, "spike_prob": 0.0005, "spike_mag": 0.5},
    "3% heavy tail": {"noise": 0.03, "spike_prob": 0.005, "spike_tail": 1.5},
}


def measured(ranks: int, steps: int, seed: int, kw: dict) -> tuple[float, object]:
    v = detect(to_frame(SimConfig(ranks=ranks, steps=steps, seed=seed, **BASE, **kw)))
    return v.lost_seconds / v.job_seconds, v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    print(f"### Jitter tax: projected from {args.ranks} ranks vs simulated jobs of that noise, {args.steps} steps, "
          f"medians of {args.seeds} seeds\n")  # fmt: skip
    print("| noise | today (measured / projected) | 2x projected (90% range) | 2x simulated "
          "| 8x projected (90% range) | 8x simulated |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, kw in KINDS.items():
        rows = []
        for seed in range(args.seeds):
            now, v = measured(args.ranks, args.steps, seed, kw)
            hosts = np.array([str(r // BASE["ranks_per_host"]) for r in range(args.ranks)])
            at = {x.ranks: x for x in project(v.slowdown, hosts, 1.0).projections}  # type: ignore[attr-defined]
            twice = measured(2 * args.ranks, args.steps, seed + 1000, kw)[0]
            eight = measured(8 * args.ranks, args.steps, seed + 2000, kw)[0]
            rows.append((now, at[args.ranks], at[2 * args.ranks], twice, at[8 * args.ranks], eight))

        cells = [_median(rows, i, attr) for i, attr in ((0, None), (1, "share"), (2, "share"), (2, "low"),
                                                          (2, "high"), (3, None), (4, "share"), (4, "low"),
                                                          (4, "high"), (5, None))]  # fmt: skip
        now, today, two, two_lo, two_hi, two_sim, eight, eight_lo, eight_hi, eight_sim = cells
        print(f"| {name} | {now:.2%} / {today:.2%} | {two:.2%} ({two_lo:.2%}-{two_hi:.2%}) | {two_sim:.2%} "
              f"| {eight:.2%} ({eight_lo:.2%}-{eight_hi:.2%}) | {eight_sim:.2%} |")


def _median(rows: list[tuple], i: int, attr: str | None) -> float:
    return statistics.median(getattr(r[i], attr) if attr else r[i] for r in rows)

if __name__ == "__main__":
    main()
