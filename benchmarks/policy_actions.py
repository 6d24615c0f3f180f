"""Does the straggler policy ever act on a healthy job, and does it act on a real straggler?

Every noise model of the accuracy benchmarks (``accuracy.py``'s ``NOISE_MODELS``; ``heldout.py``'s
``SOURCES`` and ``DRIFT_MODELS``: real traces' noise, this machine's other job shapes, two-mode steps,
host and rank drift), and healthy jobs whose ranks truly differ (``DESIGN_MODELS``: persistent per-rank
offsets up to 10%, rank 0 or every node's first rank logging each step, pipeline stages nobody
labelled), is simulated straggler-free with host and GPU context, written as a run dir, analysed as
``analyze`` does, turned into the view the live analysis gives (``policyfeed.view_of_run``) and put
through the policy's rule (``analysis.policy.due``): every verdict there is a false action (told to the
callables), and every one the *exclude* action would act on a false exclusion. The same models with one
injected straggler (compute or data, onset step 50): at 20% and 30% with the signal of its node in its
context (a slower SM clock or hypervisor steal for compute, I/O pressure on its host for data), which
should be excluded, and at 30% with none, which the callables are told of and *exclude* leaves alone.
The rule is the default one except ``after_s``, which is 0 here: the runs are minutes long, and the
other gates (still flagged, ``min_steps``, ``min_slowdown``, the cause, by design, the evidence) are what
is measured; a real job adds the 300 s on top.

    python benchmarks/policy_actions.py [--ranks 32] [--steps 800] [--trials 3] [--model NAME ...]
    python benchmarks/policy_actions.py --cost [--ranks 64] [--steps 6000] [--every 600] [--window 2000]

Prints one row per model and a total line; the same functions serve ``tests/test_policies.py``.
``--cost``: what the policy's analysis costs. A run grows as a job writes it (``GrowingRun``: one Arrow
stream per rank, ``--every`` steps a flush, 30 s of 50 ms steps by default), and after each flush the
windowed analysis the policy's process runs (``WindowRun.update``: read what is new, detect on the
window) is timed: its median and worst seconds, the share of one core it takes at ``policy_interval_s``
30, and the cells it holds. (What rank 0's own process spends on it: ``benchmarks/policy_gil.py``.)
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
from stragglerwatch.analysis.policyfeed import WindowRun, view_of_run
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig, write_run

HERE = Path(__file__).resolve().parent
SLOWDOWNS = (0.20, 0.30)  # injected stragglers with evidence, which the policy should exclude (min_slowdown 1.15)
BARE = 0.30  # an injected straggler with no signal of its node: told to the callables, not excluded
EVIDENCE = {"compute": ("sm_clock", "steal"), "data": ("io",)}
CONTEXT = {"context_every": 10}  # a context sample every second of 100 ms steps
#: Healthy jobs whose ranks differ by design (with the base noise of the accuracy benchmarks).
DESIGN_MODELS: dict[str, dict[str, Any]] = {
    "offsets 10%": {"offset": 0.10},
    "rank 0 logs 12 ms of 50 ms steps": {"step_ms": 50.0, "duty_ms": 12.0},
    "rank 0 logs 20 ms": {"duty_ms": 20.0},
    "rank 0 logs 20 ms, I/O pressure": {"duty_ms": 20.0, "duty_evidence": "io"},
    "rank 0 .item() 20 ms in other": {"duty_ms": 20.0, "duty_phase": "other_s"},
    "local rank 0s log 20 ms": {"duty_ms": 20.0, "duty_ranks": "local0"},
    "unlabelled stages 2, 20% apart": {"groups": 2, "group_skew": 0.2, "roles": False},
    "unlabelled stages 4, 30% apart": {"groups": 4, "group_skew": 0.3, "roles": False},
    "offsets 10% + rank 0 logs 20 ms": {"offset": 0.10, "duty_ms": 20.0},
}


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


def models(design: bool = True) -> dict[str, dict[str, Any]]:
    """Every noise model of the accuracy benchmarks, as SimConfig keywords (the held-out ones by their names),
    and (``design``) the healthy jobs whose ranks differ by design."""
    accuracy, heldout = _load("accuracy"), _load("heldout")
    out = {name: {**accuracy.BASE, **kw} for name, kw in accuracy.NOISE_MODELS.items()}
    out.update({f"held out: {name}": kw for name, kw in heldout.SOURCES.items()})
    out.update({f"held out: {name}": kw for name, kw in heldout.DRIFT_MODELS.items()})
    if design:
        out.update({f"by design: {name}": {**accuracy.BASE, **kw} for name, kw in DESIGN_MODELS.items()})
    return out


def acted(cfg: SimConfig, rule: ActRule, tmp: Path) -> tuple[list[dict[str, Any]], int]:
    """The verdicts the rule acts on at the end of the simulated run ``cfg`` (each says whether *exclude*
    would act on it), and the detector's flags."""
    run = write_run(tmp / f"run-{cfg.seed}-{len(cfg.injections)}", cfg)
    v = view_of_run(run)
    return due(v, rule), len(v["stragglers"])


def seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode()) % 100_000


def cost(ranks: int, steps: int, every: int, window: int, interval_s: float = 30.0) -> None:
    """Time the windowed analysis on a run that grows as a job writes it."""
    slow = Injection(ranks // 2, 0.3, steps // 3)
    cfg = SimConfig(ranks=ranks, steps=steps, seed=11, step_ms=50.0, injections=[slow])
    with tempfile.TemporaryDirectory() as tmp:
        run = GrowingRun(Path(tmp) / "run", cfg)
        live = WindowRun(run.out, window)
        times, found_at, cells = [], None, 0
        for upto in range(every, steps + 1, every):
            run.flush(upto)
            t0 = time.perf_counter()
            v = live.update()
            times.append(time.perf_counter() - t0)
            cells = max(cells, live.cells)
            open_now = {s["rank"] for s in (v or {}).get("stragglers", []) if s["last_step"] is None}
            if found_at is None and slow.rank in open_now:
                found_at = upto
        run.close()
    print(f"{ranks} ranks, {steps} steps of 50 ms, window {window} steps, a look every {every} steps "
          f"({every * 0.05:g} s of the job): {len(times)} looks, median {statistics.median(times) * 1e3:.0f} ms, "
          f"worst {max(times) * 1e3:.0f} ms (the first: {times[0] * 1e3:.0f} ms); at one look per {interval_s:g} s, "
          f"{statistics.median(times) / interval_s:.2%} of one core, in the policy's own process; at most {cells:,} "
          f"cells (steps x ranks) held; the 30% straggler from step {steps // 3} flagged at the look of step "
          f"{found_at}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--trials", type=int, default=3, help="runs per model and kind")
    p.add_argument("--model", action="append", help="only these models (default: all)")
    p.add_argument("--cost", action="store_true", help="time the policy's analysis instead (see above)")
    p.add_argument("--every", type=int, default=600, help="with --cost: steps between two looks")
    p.add_argument("--window", type=int, default=2000, help="with --cost: steps of the analysis' window")
    args = p.parse_args()
    if args.cost:
        cost(args.ranks, args.steps, args.every, args.window)
        return
    rule = replace(ActRule(), after_s=0.0)
    chosen = {k: v for k, v in models().items() if not args.model or k in args.model}
    print(f"{args.ranks} ranks x {args.steps} steps; {args.trials} runs per model and kind; rule {rule}")
    print(f"{'model':<46} {'healthy: flags':>14} {'told':>5} {'excluded':>8} {'with evidence: excluded':>24} "
          f"{'without: told, excluded':>24} {'other ranks':>11}")  # fmt: skip
    total = {"flags": 0, "told": 0, "excluded": 0, "found": 0, "injected": 0, "bare_told": 0, "bare_excl": 0,
             "bare": 0, "wrong": 0}  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in chosen.items():
            row = dict.fromkeys(total, 0)
            for t in range(args.trials):
                base = SimConfig(ranks=args.ranks, steps=args.steps, seed=seed(name, t), **{**CONTEXT, **kw})
                verdicts, flagged = acted(base, rule, Path(tmp))
                row["flags"] += flagged
                row["told"] += len(verdicts)
                row["excluded"] += sum(v["exclude"] for v in verdicts)
                for i, slowdown in enumerate((*SLOWDOWNS, BARE)):
                    cause = ("compute", "data")[(t + i) % 2]
                    rank = seed(name, t, i) % args.ranks
                    bare = i == len(SLOWDOWNS)
                    evidence = "" if bare else EVIDENCE[cause][(t + i) % len(EVIDENCE[cause])]
                    sick = replace(base, injections=[Injection(rank, slowdown, 50, cause, evidence=evidence)])
                    verdicts, _ = acted(sick, rule, Path(tmp))
                    mine = [v for v in verdicts if v["rank"] == rank]
                    row["wrong"] += sum(v["rank"] != rank for v in verdicts)
                    if bare:
                        row["bare"] += 1
                        row["bare_told"] += bool(mine)
                        row["bare_excl"] += any(v["exclude"] for v in mine)
                    else:
                        row["injected"] += 1
                        row["found"] += any(v["exclude"] for v in mine)
            print(f"{name:<46} {row['flags']:>14} {row['told']:>5} {row['excluded']:>8} "
                  f"{row['found']:>18}/{row['injected']:<5} {row['bare_told']:>13}/{row['bare']}, "
                  f"{row['bare_excl']:<6} {row['wrong']:>11}")  # fmt: skip
            for k in total:
                total[k] += row[k]
    print(f"total: healthy jobs: {total['told']} told to the callables, {total['excluded']} excluded, where the "
          f"detector flagged {total['flags']} healthy rank(s); stragglers with the signal of their node: "
          f"{total['found']} of {total['injected']} excluded; without: {total['bare_told']} of {total['bare']} told, "
          f"{total['bare_excl']} excluded; {total['wrong']} verdict(s) on other ranks "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
