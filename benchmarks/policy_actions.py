"""Does the straggler policy ever act on a healthy job, and does it act on a real straggler?

Every noise model of the accuracy benchmarks (``accuracy.py``'s ``NOISE_MODELS``; ``heldout.py``'s
``SOURCES`` and ``DRIFT_MODELS``: real traces' noise, this machine's other job shapes, two-mode steps,
host and rank drift) is simulated straggler-free, written as a run dir, analysed as ``analyze`` does and
put through the policy's rule (``analysis.policy.due``): every action there is a false action. The same
models with one injected straggler (compute or data, onset step 50) count the actions on the slowed rank
(and any other as false). The rule is the default one except ``after_s``, which is 0 here: the runs are
minutes long, and the other gates (still flagged, ``min_steps``, ``min_slowdown``, the cause) are what is
measured; a real job adds the 300 s on top.

    python benchmarks/policy_actions.py [--ranks 32] [--steps 800] [--trials 3] [--model NAME ...]
    python benchmarks/policy_actions.py --cost [--ranks 64] [--steps 6000] [--every 600]

Prints one row per model and a total line; the same functions serve ``tests/test_policies.py``.
``--cost``: what rank 0's policy thread costs. A run grows as a job writes it (``GrowingRun``: one Arrow
stream per rank, ``--every`` steps a flush, 30 s of 50 ms steps by default), and after each flush the
thread's check (``StragglerPolicy.check``: read what is new, follow the analysis, apply the rule) is
timed: its median and worst seconds, and the share of one core it takes at ``policy_interval_s`` 30.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from stragglerwatch.analysis.policy import ActRule, due
from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.record.events import EventFile
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig, write_run
from stragglerwatch.runtime.actions.stragglerpolicy import StragglerPolicy

HERE = Path(__file__).resolve().parent
SLOWDOWNS = (0.20, 0.30)  # injected stragglers the policy should act on (its min_slowdown is 1.15)


def _load(name: str) -> Any:
    """A benchmark module of this folder (they import each other by name), from a test too."""
    added = str(HERE) not in sys.path
    if added:
        sys.path.insert(0, str(HERE))
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(str(HERE))


def models() -> dict[str, dict[str, Any]]:
    """Every noise model of the accuracy benchmarks, as SimConfig keywords (the held-out ones by their names)."""
    accuracy, heldout = _load("accuracy"), _load("heldout")
    out = {name: {**accuracy.BASE, **kw} for name, kw in accuracy.NOISE_MODELS.items()}
    out.update({f"held out: {name}": kw for name, kw in heldout.SOURCES.items()})
    out.update({f"held out: {name}": kw for name, kw in heldout.DRIFT_MODELS.items()})
    return out


def acted(cfg: SimConfig, rule: ActRule, tmp: Path) -> tuple[list[dict[str, Any]], int]:
    """The verdicts the rule acts on at the end of the simulated run ``cfg``, and the detector's flags."""
    run = write_run(tmp / f"run-{cfg.seed}-{len(cfg.injections)}", cfg)
    report = analyze_run(run).report
    return due(report, rule), len(report["stragglers"])


def seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode()) % 100_000


def cost(ranks: int, steps: int, every: int, interval_s: float = 30.0) -> None:
    """Time the policy thread's check on a run that grows as a job writes it."""
    slow = Injection(ranks // 2, 0.3, steps // 3)
    cfg = SimConfig(ranks=ranks, steps=steps, seed=11, step_ms=50.0, injections=[slow])
    with tempfile.TemporaryDirectory() as tmp:
        run = GrowingRun(Path(tmp) / "run", cfg)
        policy = StragglerPolicy(run.out, ActRule(), [lambda v: None], EventFile(run.out / "events-00000.jsonl"), ranks)
        times, acted_at = [], None
        for upto in range(every, steps + 1, every):
            run.flush(upto)
            t0 = time.perf_counter()
            if policy.check() and acted_at is None:
                acted_at = upto
            times.append(time.perf_counter() - t0)
        run.close()
    ordered = sorted(times)
    print(f"{ranks} ranks, {steps} steps of 50 ms, a check every {every} steps ({every * 0.05:g} s of the job): "
          f"{len(times)} checks, median {statistics.median(times) * 1e3:.0f} ms, worst {ordered[-1] * 1e3:.0f} ms "
          f"(the first, which reads everything: {times[0] * 1e3:.0f} ms); at one check per {interval_s:g} s, "
          f"{statistics.median(times) / interval_s:.2%} of one core; the 30% straggler from step {steps // 3} "
          f"acted on at step {acted_at}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--trials", type=int, default=3, help="runs per model and kind")
    p.add_argument("--model", action="append", help="only these models (default: all)")
    p.add_argument("--cost", action="store_true", help="time rank 0's policy thread instead (see above)")
    p.add_argument("--every", type=int, default=600, help="with --cost: steps between two checks")
    args = p.parse_args()
    if args.cost:
        cost(args.ranks, args.steps, args.every)
        return
    rule = replace(ActRule(), after_s=0.0)
    chosen = {k: v for k, v in models().items() if not args.model or k in args.model}
    print(f"{args.ranks} ranks x {args.steps} steps of 100 ms; {args.trials} runs per model and kind; rule {rule}")
    print(f"{'model':<34} {'healthy: flags':>14} {'false actions':>13} {'straggler acted on':>19} {'other ranks':>12}")
    false_total = found_total = injected_total = flags_total = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in chosen.items():
            false_healthy = found = wrong = flags = 0
            for t in range(args.trials):
                base = SimConfig(ranks=args.ranks, steps=args.steps, seed=seed(name, t), **kw)
                actions, flagged = acted(base, rule, Path(tmp))
                false_healthy, flags = false_healthy + len(actions), flags + flagged
                for i, slowdown in enumerate(SLOWDOWNS):
                    cause = ("compute", "data")[(t + i) % 2]
                    rank = seed(name, t, i) % args.ranks
                    sick = replace(base, injections=[Injection(rank, slowdown, 50, cause)])
                    verdicts, _ = acted(sick, rule, Path(tmp))
                    found += any(v["rank"] == rank for v in verdicts)
                    wrong += sum(v["rank"] != rank for v in verdicts)
            injected = args.trials * len(SLOWDOWNS)
            print(f"{name:<34} {flags:>14} {false_healthy:>13} {found:>13}/{injected:<5} {wrong:>12}")
            false_total, flags_total = false_total + false_healthy + wrong, flags_total + flags
            found_total += found
            injected_total += injected
    print(f"total: {false_total} false action(s) where the detector flagged {flags_total} healthy rank(s); "
          f"{found_total} of {injected_total} injected stragglers acted on ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
