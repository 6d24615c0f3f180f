"""Detection accuracy on held-out data: noise, straggler kinds and cause mixes that played no part in
choosing the detector's constants (not a pytest test).

The constants of ``DetectConfig`` were chosen on the simulator's noise models of
``benchmarks/accuracy.py`` (``NOISE_MODELS``, among them ``data/healthy-residuals.csv``), with
stragglers whose excess lies in exactly their cause's phases. Here the detector is used as it is,
on what it never saw:

- ``--part noise``: per-step residuals of real cluster traces (``data/trace-residuals-*.csv``,
  derived from ``tests/data/whatif-traces``), of jobs of other shapes recorded on this machine
  (``data/heldout-residuals.csv``), two-mode steps, and slow drift shared by a host's ranks;
  straggler-free runs and runs with one straggler of 5, 10 or 20%;
- ``--part kinds``: stragglers that come and go, that move between ranks, and a whole slow host;
- every injected straggler mixes its causes: its excess is split between phases at random, and
  its cause is right when the detector names the cause holding most of the excess (``cause
  right``; ``primary``: the cause it was injected as);
- ``--part drift``: long straggler-free runs under slow drift (of ranks, of hosts): every flag is
  counted, with the true drift of the flagged rank beside it;
- ``--part real``: the traces' own per-step series, and runs of this machine with a real injected
  straggler (``data/heldout-injected.parquet``), fed to the detector as they are;
- ``--part imbalance``: the load-imbalance cases of ``benchmarks/accuracy.py`` (``IMBALANCE_CASES``:
  ranks given unequal tokens, with and without a straggler hidden in them) under the held-out noise.

A flag counts as matched when its rank was slowed at its detection step or at most ``LAG`` steps
before; every other flag is false, whatever the rank's drift. Runs are seeded from ``--seed``,
the part, the source and the trial, so a subset (``--source``) gives the same figures as a full run.

    python benchmarks/heldout.py                       # every part (8-10 minutes on 2 cores)
    python benchmarks/heldout.py --part noise --source "trace SE" --trials 40
    python benchmarks/heldout.py --quick               # a smoke run of every part (under a minute)
    python benchmarks/heldout.py --part imbalance --imbalance-trials 5
    python benchmarks/heldout.py --derive-traces benchmarks/data   # rewrite data/trace-residuals-*.csv
    python benchmarks/heldout.py --pack RUN_DIR... --out benchmarks/data/heldout-injected.parquet
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
from accuracy import (
    IMBALANCE_CASES,
    IMBALANCE_HEADER,
    ImbalanceRow,
    brief,
    flagged,
    imbalance_cells,
    imbalance_config,
    imbalance_run,
)

from stragglerwatch.analysis.detect import MATRIX_COLUMNS, Straggler, Verdict, detect, to_matrix
from stragglerwatch.analysis.thresholds import DetectConfig, classic_floors
from stragglerwatch.record.simulate import CAUSE_PHASES, Injection, SimConfig, injected, simulate_arrays, to_frame

DATA = Path(__file__).resolve().parent / "data"
TRACES = Path(__file__).resolve().parent.parent / "tests" / "data" / "whatif-traces"
BASE = {"noise": 0.03, "spike_prob": 0.005, "spike_mag": 1.0}  # the base noise of accuracy.py
REAL = {"noise": 0.0, "spike_prob": 0.0}  # bootstrap sources: the real residuals are the only noise
LAG = 32  # steps after a slowed step within which a flag on that rank is matched to it
SLOWDOWNS = (0.05, 0.10, 0.20)

#: Held-out noise: name -> SimConfig keywords (64 ranks, 100 ms steps).
SOURCES = {
    "trace AR": {**REAL, "bootstrap": str(DATA / "trace-residuals-AR.csv"), "bootstrap_block": 8},
    "trace SE": {**REAL, "bootstrap": str(DATA / "trace-residuals-SE.csv"), "bootstrap_block": 8},
    "trace ST": {**REAL, "bootstrap": str(DATA / "trace-residuals-ST.csv"), "bootstrap_block": 8},
    "control: iid 0.5%": {**BASE, "noise": 0.005},  # as quiet as the traces AR and ST, but independent
    "here, other shapes": {**REAL, "bootstrap": str(DATA / "heldout-residuals.csv")},
    "two-mode 30% x1.25": {**BASE, "bimodal_prob": 0.3, "bimodal_mag": 0.25},
    "two-mode runs 20% x1.25": {**BASE, "bimodal_prob": 0.2, "bimodal_mag": 0.25, "bimodal_hold": 3},
    "host drift 3%": {**BASE, "host_drift": 0.03},
    "host drift 3% fast": {**BASE, "host_drift": 0.03, "host_drift_steps": 400},
}

#: Straggler kinds: name -> (ranks, keywords of the injections built by ``kind_injections``); on BASE noise.
KINDS = {
    "steady": (64, {}),
    "on-off 30/30": (64, {"period": 60, "duty": 30}),
    "on-off 20/100": (64, {"period": 120, "duty": 20}),
    "moving /150": (64, {"move_every": 150}),
    "moving /40": (64, {"move_every": 40}),
    "moving /10": (64, {"move_every": 10}),
    "slow host, 8 of 64": (64, {"host": True}),
    "slow host, 8 of 16": (16, {"host": True}),
}
#: Kinds with no rank to blame (the slowness moves on before any rank's can be told from noise): their
#: flags are neither needed nor wrong, and their causes are left out of the cause table.
NO_BLAME = {"moving /10"}

#: Long straggler-free runs for ``--part drift``: the tuning set's drift models and the held-out ones.
DRIFT_MODELS = {
    "offsets 4% (tuning)": {**BASE, "offset": 0.04},
    "drift 2% (tuning)": {**BASE, "rank_drift": 0.02},
    "drift 3% (tuning)": {**BASE, "rank_drift": 0.03},
    "fast drift 2% (tuning)": {**BASE, "rank_drift": 0.02, "drift_steps": 400},
    "host drift 3%": {**BASE, "host_drift": 0.03},
    "host drift 3% fast": {**BASE, "host_drift": 0.03, "host_drift_steps": 400},
}


def seed_of(*parts: object) -> int:
    """A stable 32-bit seed from ``--seed`` and names and indices (not Python's salted ``hash``)."""
    words = [zlib.crc32(str(p).encode()) for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def mixed(rng: np.random.Generator, cause: str) -> dict[str, float]:
    """How a straggler of ``cause`` really spends its excess: the phase columns' shares.

    - compute: split between forward and backward at random (20-80%), up to 30% of it untimed host
      work between them (``other``);
    - data: 40-100% in the data wait, the rest in another gap (a fetch between forward and backward,
      which a log without the data marker records as ``other``): ``other`` holds most of it in a sixth;
    - optimizer: 50-100% in the optimizer step, the rest after it (``other``);
    - other: 50-100% in ``other``, the rest inside the optimizer step (bookkeeping it calls).
    """
    if cause == "compute":
        split, untimed = rng.uniform(0.2, 0.8), rng.uniform(0.0, 0.3)
        return {"forward_s": (1 - untimed) * split, "backward_s": (1 - untimed) * (1 - split), "other_s": untimed}
    main = {"data": "data_wait_s", "optimizer": "optimizer_s", "other": "other_s"}[cause]
    share = rng.uniform(0.4 if cause == "data" else 0.5, 1.0)
    rest = "optimizer_s" if cause == "other" else "other_s"
    return {main: share, rest: 1.0 - share}


def random_straggler(rng: np.random.Generator, ranks: int, steps: int, slowdown: float, **kw: object) -> Injection:
    cause = str(rng.choice(list(CAUSE_PHASES)))
    return Injection(int(rng.integers(ranks)), slowdown, int(rng.integers(50, steps - 100)), cause,
                     mix=mixed(rng, cause), **kw)  # type: ignore[arg-type]  # fmt: skip


def kind_injections(rng: np.random.Generator, ranks: int, steps: int, slowdown: float, kw: dict) -> list[Injection]:
    """The injections of one run of a straggler kind (``KINDS``)."""
    kw = dict(kw)
    if kw.pop("host", False):  # every rank of one host, slowed alike from the same step
        first = random_straggler(rng, ranks // 8, steps, slowdown)
        return [replace(first, rank=first.rank * 8 + i) for i in range(8)]
    inj = random_straggler(rng, ranks, steps, slowdown, **kw)
    cycle = inj.move_every or inj.period  # whole stints and on-off periods only: none cut short by the run's end
    if cycle and steps - inj.onset >= cycle:
        inj.end = inj.onset + (steps - inj.onset) // cycle * cycle
    if inj.move_every:  # to other ranks, each once
        others = rng.permutation([r for r in range(ranks) if r != inj.rank])
        inj.moves = tuple(int(r) for r in others[: steps // inj.move_every + 1])
    return [inj]


def true_level(cfg: SimConfig) -> np.ndarray | None:
    """Steps x ranks noise-free busy over the step's median - 1 under offsets and drift (None without them)."""
    if not (cfg.offset or cfg.rank_drift or cfg.host_drift):
        return None
    clean = simulate_arrays(replace(cfg, noise=0.0, drift=0.0, spike_prob=0.0, stall_every=0, injections=[],
                                    bootstrap="", bimodal_prob=0.0, tokens=0.0))  # fmt: skip
    return clean["busy_s"] / np.median(clean["busy_s"], axis=1, keepdims=True) - 1.0


@dataclass
class Event:
    """One stretch the detector should flag: ``rank`` slowed over steps [start, end)."""

    rank: int
    start: int
    end: int
    injection: int  # index in the run's injections
    cause: str  # as injected
    main: str  # the cause holding most of the excess


def events(cfg: SimConfig) -> list[Event]:
    out = []
    for k, inj in enumerate(cfg.injections):
        for part in inj.expand(cfg.steps):
            on = np.flatnonzero(part.active(cfg.steps))
            if len(on):
                out.append(Event(part.rank, int(on[0]), int(on[-1]) + 1, k, inj.cause, inj.main_cause()))
    return out


@dataclass
class Tally:
    found: list[bool] = field(default_factory=list)  # per event
    latency: list[int] = field(default_factory=list)  # per event found: first flagged step - start
    whole: list[bool] = field(default_factory=list)  # per injection: every event of it found
    episodes: list[bool] = field(default_factory=list)  # per on-stretch of an on-off straggler: flagged
    causes: list[tuple[str, str, str]] = field(default_factory=list)  # (injected, main, said) per event found
    flags: int = 0
    matched: int = 0
    false_levels: list[float] = field(default_factory=list)  # true level at detection of each false flag
    false_brief: int = 0  # of the false flags, those the verdict keeps as details (brief, negligible cost)
    runs: int = 0
    rank_hours: float = 0.0

    @property
    def false(self) -> int:
        return len(self.false_levels)

    def false_text(self) -> str:
        """The false flags, and how many of them the verdict keeps as details (brief, of negligible cost)."""
        return f"{self.false} ({self.false_brief} brief)" if self.false_brief else str(self.false)


def covering(stragglers: list[Straggler], rank: int, step: int) -> Straggler | None:
    """The verdict on ``rank`` whose flag was raised last at or before ``step`` (else its first)."""
    mine = sorted((s for s in stragglers if s.rank == rank), key=lambda s: s.detected_step)
    before = [s for s in mine if s.detected_step <= step]
    return before[-1] if before else (mine[0] if mine else None)


def score(cfg: SimConfig, verdict: Verdict, tally: Tally, level: np.ndarray | None) -> None:
    truth = injected(cfg) > 0
    tally.runs += 1
    tally.rank_hours += cfg.ranks * cfg.steps * cfg.step_ms / 1000 / 3600
    flags, details = flagged(verdict), brief(verdict)
    for s in flags:
        d = s.detected_step
        ok = bool(truth[max(0, d - LAG) : d + 1, s.rank].any())
        tally.flags += 1
        tally.matched += ok
        if not ok:
            tally.false_levels.append(float(level[d, s.rank]) if level is not None else float("nan"))
            tally.false_brief += s in details
    per_injection: dict[int, list[bool]] = {}
    for ev in events(cfg):
        window = verdict.flags[ev.start : min(cfg.steps, ev.end + LAG), ev.rank]
        hit = bool(window.any())
        tally.found.append(hit)
        per_injection.setdefault(ev.injection, []).append(hit)
        if hit:
            first = int(np.argmax(window))
            tally.latency.append(first)
            said = covering(flags, ev.rank, ev.start + first)
            tally.causes.append((ev.cause, ev.main, said.cause if said else "-"))
    tally.whole += [all(v) for v in per_injection.values()]
    for inj in cfg.injections:
        if inj.period and inj.duty and not inj.move_every:
            on = inj.active(cfg.steps)
            starts = np.flatnonzero(on & ~np.r_[False, on[:-1]])
            for a in starts:
                b = a + inj.duty
                tally.episodes.append(bool(verdict.flags[a : min(cfg.steps, b + LAG), inj.rank].any()))


def run_one(cfg: SimConfig, tally: Tally, levels: bool = True) -> Verdict:
    verdict = detect(to_frame(cfg))
    score(cfg, verdict, tally, true_level(cfg) if levels else None)
    return verdict


def fmt_share(values: list[bool]) -> str:
    return f"{statistics.mean(values):.2f}" if values else "-"


def fmt_lat(values: list[int]) -> str:
    return f"{statistics.median(values):.0f} / {np.percentile(values, 90):.0f}" if values else "-"


def fmt_levels(levels: list[float]) -> str:
    """The true drift of falsely flagged ranks: median and range, or ``n/a`` where unknown (real noise)."""
    known = [x for x in levels if x == x]
    if not levels:
        return "-"
    if not known:
        return "n/a"
    return f"{statistics.median(known):+.1%} ({min(known):+.1%} to {max(known):+.1%})"


def causes_right(causes: list[tuple[str, str, str]], index: int) -> str:
    return f"{statistics.mean(said == c[index] for *c, said in causes):.2f}" if causes else "-"


def noise_part(args: argparse.Namespace, all_causes: list) -> None:
    names = (args.source or ([] if args.bootstrap else list(SOURCES))) + [
        f"file {Path(f).name}" for f in args.bootstrap
    ]
    print(f"### Held-out noise: {args.ranks} ranks x {args.steps} steps (100 ms); {args.healthy} straggler-free "
          f"runs of {args.healthy_steps} steps and {args.trials} runs per slowdown per source; one straggler, "
          f"random rank, onset in [50, {args.steps - 100}], cause and its mix\n")  # fmt: skip
    print("| noise | false flags | per 1,000 rank-hours | drift of falsely flagged ranks | "
          + " | ".join(f"recall {x:.0%}" for x in SLOWDOWNS)
          + " | latency at 10% (median / p90) | precision | cause right | primary |")  # fmt: skip
    print("|---" * (8 + len(SLOWDOWNS)) + "|")
    for name in names:
        t0, kw = time.perf_counter(), SOURCES[name]
        healthy = Tally()
        for i in range(args.healthy):
            cfg = SimConfig(ranks=args.ranks, steps=args.healthy_steps, seed=seed_of(args.seed, "healthy", name, i),
                            **kw)  # type: ignore[arg-type]  # fmt: skip
            run_one(cfg, healthy)
        found, at10, sick = {}, Tally(), Tally()
        for slowdown in SLOWDOWNS:
            tally = at10 if slowdown == 0.10 else Tally()
            for i in range(args.trials):
                seed = seed_of(args.seed, "noise", name, slowdown, i)
                inj = random_straggler(np.random.default_rng(seed), args.ranks, args.steps, slowdown)
                cfg = SimConfig(ranks=args.ranks, steps=args.steps, seed=seed, injections=[inj], **kw)  # type: ignore[arg-type]
                run_one(cfg, tally)
            found[slowdown] = tally.found
            sick.flags += tally.flags
            sick.matched += tally.matched
            sick.causes += tally.causes
        all_causes += sick.causes
        per = healthy.false / healthy.rank_hours * 1000 if healthy.rank_hours else 0.0
        print(f"| {name} | {healthy.false_text()} | {per:,.1f} | {fmt_levels(healthy.false_levels)} | "
              + " | ".join(fmt_share(found[x]) for x in SLOWDOWNS)
              + f" | {fmt_lat(at10.latency)} | {sick.matched / sick.flags if sick.flags else 1.0:.3f} | "
              f"{causes_right(sick.causes, 1)} | {causes_right(sick.causes, 0)} |", flush=True)  # fmt: skip
        if args.verbose:
            print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print()


def kinds_part(args: argparse.Namespace, all_causes: list) -> None:
    names = args.kind or list(KINDS)
    steps = args.kind_steps
    noise = SOURCES[args.kind_noise] if args.kind_noise else BASE
    print(f"### Straggler kinds: {steps} steps, noise {args.kind_noise or 'base (3% jitter, 0.5% spikes)'}, "
          f"{args.trials} runs per kind and slowdown; random rank(s), onset, cause and its mix\n")  # fmt: skip
    print("| kind | ranks | slowdown | recall | all found (every stint; every rank of the host) "
          "| on-off episodes flagged | latency (median / p90) | precision | false flags | cause right |")  # fmt: skip
    print("|---" * 10 + "|")
    for name in names:
        ranks, kw = KINDS[name]
        for slowdown in (0.10, 0.20):
            tally = Tally()
            for i in range(args.trials):
                seed = seed_of(args.seed, "kind", name, slowdown, i)
                injections = kind_injections(np.random.default_rng(seed), ranks, steps, slowdown, kw)
                cfg = SimConfig(ranks=ranks, steps=steps, seed=seed, injections=injections, **noise)  # type: ignore[arg-type]
                run_one(cfg, tally, levels=False)
            all_causes += [] if name in NO_BLAME else tally.causes
            label = f"{name} (no rank to blame)" if name in NO_BLAME else name
            print(f"| {label} | {ranks} | {slowdown:.0%} | {fmt_share(tally.found)} | {fmt_share(tally.whole)} | "
                  f"{fmt_share(tally.episodes)} | {fmt_lat(tally.latency)} | "
                  f"{tally.matched / tally.flags if tally.flags else 1.0:.3f} | {tally.false_text()} | "
                  f"{causes_right(tally.causes, 1)} |", flush=True)  # fmt: skip
    print()


def cause_table(all_causes: list[tuple[str, str, str]]) -> None:
    if not all_causes:
        return
    print(f"### Causes as they mix (every straggler found above, but those of {', '.join(sorted(NO_BLAME))})\n")
    print("| injected as | found | holds most of the excess | detector names that | names the injected cause "
          "| what it named instead |")  # fmt: skip
    print("|---" * 6 + "|")
    for cause in CAUSE_PHASES:
        rows = [c for c in all_causes if c[0] == cause]
        if not rows:
            continue
        held = statistics.mean(main == cause for _, main, _ in rows)
        wrong: dict[str, int] = {}
        for _, main, said in rows:
            if said != main:
                wrong[said] = wrong.get(said, 0) + 1
        instead = ", ".join(f"{k} {v}" for k, v in sorted(wrong.items(), key=lambda kv: -kv[1])) or "-"
        print(f"| {cause} | {len(rows)} | {cause}: {held:.2f} | {causes_right(rows, 1)} | {causes_right(rows, 0)} "
              f"| {instead} |")  # fmt: skip
    print()


def drift_part(args: argparse.Namespace) -> None:
    ranks, steps = 256, 10_000
    per_run = ranks * steps * 0.1 / 3600
    runs = max(1, int(np.ceil(args.rank_hours / per_run)))
    tol = classic_floors(DetectConfig()).tolerance
    print(f"### Drift, every flag counted: straggler-free runs of {ranks} ranks x {steps} steps (100 ms), "
          f"{runs} per model ({runs * per_run:.0f} rank-hours)\n")  # fmt: skip
    print(f"| model | false flags | per 1,000 rank-hours | on ranks truly > {tol:.0%} slower | "
          "true drift of flagged ranks: median (range) |")  # fmt: skip
    print("|---" * 5 + "|")
    for name, kw in DRIFT_MODELS.items():
        tally = Tally()
        for i in range(runs):
            run_one(SimConfig(ranks=ranks, steps=steps, seed=seed_of(args.seed, "drift", name, i), **kw), tally)  # type: ignore[arg-type]
        over = sum(x >= tol for x in tally.false_levels)
        print(f"| {name} | {tally.false_text()} | {tally.false / tally.rank_hours * 1000:,.1f} | {over} | "
              f"{fmt_levels(tally.false_levels)} |", flush=True)  # fmt: skip
    print()


# --- real data -----------------------------------------------------------------------------------


def trace_series(name: str, trace_dir: Path = TRACES) -> tuple[pd.DataFrame, dict[int, str]]:
    """A trace's per-worker per-step frame (``traces.worker_frame``: compute is the busy time) and stages."""
    from stragglerwatch.evidence.traces import read_trace, worker_frame

    df = read_trace(trace_dir / f"trace-{name}.parquet")
    stages = df.groupby("rank")["stage"].first()
    return worker_frame(df), {int(r): f"stage{int(s)}" for r, s in stages.items()}


def trace_residuals(name: str, trace_dir: Path = TRACES, fault: float = 0.10) -> tuple[pd.DataFrame, list[int]]:
    """Steps x workers log residuals of a trace: each worker's log busy (compute) time less the mean log of its
    pipeline stage's healthy workers at that step, scaled by sqrt(n / (n - 1)) so that a stage of n workers gives
    a worker's own jitter. Workers whose median residual (over the stage's median) exceeds ``fault`` (a persistent
    fault, not noise) are left out, and returned."""
    frame, groups = trace_series(name, trace_dir)
    busy = frame.pivot(index="step", columns="rank", values="busy_s")
    logs = np.log(busy)
    faulty: list[int] = []
    out = []
    for stage in sorted(set(groups.values())):
        cols = [r for r in busy.columns if groups[int(r)] == stage]
        robust = logs[cols].sub(logs[cols].median(axis=1), axis=0)  # a faulty worker moves no median
        faulty += [int(r) for r in cols if abs(float(robust[r].median())) > fault]
        keep = [r for r in cols if r not in faulty]
        if len(keep) >= 2:
            resid = logs[keep].sub(logs[keep].mean(axis=1), axis=0) * np.sqrt(len(keep) / (len(keep) - 1))
            out.append(resid.rename(columns=lambda r: f"{name}:rank{int(r)}"))
    return pd.concat(out, axis=1).reset_index(drop=True), sorted(set(faulty))


def derive_traces(out_dir: Path, trace_dir: Path) -> None:
    names = sorted(f.stem.removeprefix("trace-") for f in trace_dir.glob("trace-*.parquet"))
    if not names:
        raise SystemExit(f"heldout: no trace-*.parquet in {trace_dir}")
    for name in names:
        resid, faulty = trace_residuals(name, trace_dir)
        path = out_dir / f"trace-residuals-{name}.csv"
        resid.round(5).to_csv(path, index=False)
        r = resid.to_numpy()
        robust = 1.4826 * np.nanmedian(np.abs(r - np.nanmedian(r)))
        print(f"{path}: {r.shape[1]} series x {r.shape[0]} steps; sd {np.nanstd(r):.4f}, robust sd {robust:.4f}, "
              f"p99 |r| {np.nanpercentile(np.abs(r), 99):.4f}; left out as faulty: {faulty or 'none'}")  # fmt: skip


INJECTED_RUN = re.compile(r"^inj-.*?(\d+)ranks-(?:.*-)?(compute|data|optimizer|other)-rank(\d+)-from(\d+)$")


def pack_runs(run_dirs: list[str], out: Path) -> None:
    """The step logs of runs with a real injected straggler, in one Parquet file (a ``run`` column added): only
    what the detector reads. Run dirs named ``inj-<shape>-<N>ranks-<...>-<cause>-rank<R>-from<STEP>``."""
    from stragglerwatch.record.steplog import load_run

    frames = []
    for d in run_dirs:
        name = Path(d.rstrip("/")).name
        if not INJECTED_RUN.match(name):
            raise SystemExit(f"heldout: {name}: expected inj-<shape>-<N>ranks-<...>-<cause>-rank<R>-from<STEP>")
        f = load_run(d)
        cols = [c for c in MATRIX_COLUMNS if c in f.columns and f[c].fillna(0.0).abs().max() > 0]
        f = f[["rank", "step"]].join(f[cols].round(6).astype(np.float32))  # microseconds; columns of zeros or NaN
        f.insert(0, "run", name)
        frames.append(f)
    pd.concat(frames, ignore_index=True).to_parquet(out, index=False, compression="zstd")
    print(f"{out}: {sum(len(f) for f in frames)} rows of {len(frames)} runs")


def real_verdict(v: Verdict, rank: int | None, onset: int, label: dict[int, int] | None = None) -> str:
    """The table cells of a real case: every flag, the slowed rank found (and when), false flags, its cause."""

    def at(s: Straggler) -> str:
        return f"step {s.detected_step}" + (f" (row {label[s.detected_step]})" if label else "")

    spells = flagged(v)
    said = "; ".join(f"{s.rank} {s.cause} {s.slowdown:.2f}x at {at(s)}" for s in spells) or "none"
    said += "".join(f"; group {g.group} {g.slowdown:.2f}x" for g in v.groups)
    hits = sorted((s for s in spells if s.rank == rank and s.detected_step >= onset),
                  key=lambda s: s.detected_step)  # fmt: skip
    false = len(spells) - len(hits)
    when = (
        (f"row {label[hits[0].detected_step]}" if label else f"{hits[0].detected_step - onset:+d} steps")
        if hits
        else ""
    )
    found = "-" if rank is None else f"yes, {when}" if hits else "no"
    return f"{said} | {found} | {false} | {hits[0].cause if hits else '-'} |"


def real_part(args: argparse.Namespace) -> None:
    print("### Real data, fed to the detector as it is (default `DetectConfig`)\n")
    print("| data | truth | detector says (rank, cause, slowdown, flagged at) | slowed rank found | false flags "
          "| cause named |")  # fmt: skip
    print("|---" * 6 + "|")
    truths = {"AR": ("rank 0 artificially slowed (compute), from before the trace", 0),
              "SE": ("sequence-length imbalance that moves between workers: no straggler", None),
              "ST": ("pipeline-stage imbalance (stage 3): no straggler", None)}  # fmt: skip
    for name, (text, rank) in truths.items():
        frame, groups = trace_series(name)
        steps = sorted(int(x) for x in frame["step"].unique())
        v = detect(to_matrix(frame), groups=groups)
        row = {s: i + 1 for i, s in enumerate(steps)}
        print(f"| trace {name}, {len(groups)} workers x {len(steps)} recorded steps | {text} | "
              f"{real_verdict(v, rank, steps[0], row)}")  # fmt: skip
    path = DATA / "heldout-injected.parquet"
    for name, frame in pd.read_parquet(path).groupby("run", sort=False) if path.exists() else ():
        n, cause, rank, onset = INJECTED_RUN.match(str(name)).groups()  # type: ignore[union-attr]
        busy = frame.pivot(index="step", columns="rank", values="busy_s")
        after = busy.loc[busy.index >= int(onset)]
        ratio = float((after[int(rank)] / after.drop(columns=int(rank)).median(axis=1)).median())
        v = detect(frame.drop(columns="run"))
        print(f"| `{name}` | rank {rank} of {n}, {cause}, from step {onset} (then busy {ratio:.2f}x its peers') | "
              f"{real_verdict(v, int(rank), int(onset))}")  # fmt: skip
    print()


def imbalance_part(args: argparse.Namespace) -> None:
    names = args.source or list(SOURCES)
    print(f"### Load imbalance under held-out noise ({args.ranks} ranks x {args.steps} steps, "
          f"{args.imbalance_trials} runs per row)\n")  # fmt: skip
    print("| noise | case | " + " | ".join(IMBALANCE_HEADER) + " |")
    print("|---" * (2 + len(IMBALANCE_HEADER)) + "|")
    for name in names:
        for case in IMBALANCE_CASES:
            row = ImbalanceRow()
            for t in range(args.imbalance_trials):
                seed = seed_of(args.seed, "imbalance", name, case, t)
                imbalance_run(imbalance_config(args.ranks, args.steps, seed, SOURCES[name], case), row, true_level)
            print(f"| {name} | {case} | " + " | ".join(imbalance_cells(row, case)) + " |", flush=True)
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", action="append", choices=["noise", "kinds", "drift", "real", "imbalance"],
                   help="only these parts (default: all)")  # fmt: skip
    p.add_argument("--source", action="append", choices=list(SOURCES),
                   help="with --part noise or imbalance: only these")  # fmt: skip
    p.add_argument("--bootstrap", action="append", default=[], metavar="CSV",
                   help="with --part noise: also resample this CSV (as record_noise.py writes it)")  # fmt: skip
    p.add_argument("--block", type=int, default=25, help="steps per resampled block of --bootstrap (default 25)")
    p.add_argument("--kind", action="append", choices=list(KINDS), help="with --part kinds: only these")
    p.add_argument("--kind-noise", choices=list(SOURCES), help="with --part kinds: this noise (default: base)")
    p.add_argument("--trials", type=int, default=40, help="runs per slowdown per source or kind (default 40)")
    p.add_argument("--imbalance-trials", type=int, default=5, help="runs per row of --part imbalance (default 5)")
    p.add_argument("--healthy", type=int, default=10, help="straggler-free runs per source (default 10)")
    p.add_argument("--healthy-steps", type=int, default=4000, help="steps of each (default 4000)")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=400, help="steps of a run with a straggler (default 400)")
    p.add_argument("--kind-steps", type=int, default=600, help="steps of a straggler-kind run (default 600)")
    p.add_argument("--rank-hours", type=float, default=500, help="--part drift: rank-hours per model (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 trials, 1 short healthy run, 20 rank-hours")
    p.add_argument("--verbose", action="store_true", help="seconds per source")
    p.add_argument("--derive-traces", type=Path, metavar="DIR", help="write DIR/trace-residuals-NAME.csv")
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=TRACES,
        help="with --derive-traces: the folder of trace-NAME.parquet (default: tests/data/whatif-traces)",
    )
    p.add_argument("--pack", nargs="+", metavar="RUN_DIR", help="pack runs with an injected straggler into --out")
    p.add_argument("--out", type=Path, help="with --pack: the Parquet file to write")
    args = p.parse_args()
    if args.derive_traces:
        derive_traces(args.derive_traces, args.trace_dir)
        return
    if args.pack:
        if not args.out:
            p.error("--pack needs --out")
        pack_runs(args.pack, args.out)
        return
    for f in args.bootstrap:
        SOURCES[f"file {Path(f).name}"] = {**REAL, "bootstrap": str(f), "bootstrap_block": args.block}
    if args.quick:
        args.trials, args.healthy, args.healthy_steps, args.rank_hours, args.imbalance_trials = 3, 1, 1000, 20, 1
    parts = args.part or ["noise", "kinds", "drift", "real", "imbalance"]
    t0, all_causes = time.perf_counter(), []
    if "noise" in parts:
        noise_part(args, all_causes)
    if "kinds" in parts:
        kinds_part(args, all_causes)
    if "noise" in parts or "kinds" in parts:
        cause_table(all_causes)
    if "drift" in parts:
        drift_part(args)
    if "real" in parts:
        real_part(args)
    if "imbalance" in parts:
        imbalance_part(args)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
