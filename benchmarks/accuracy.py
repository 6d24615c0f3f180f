"""Detection accuracy on simulated clusters (not a pytest test).

For each cluster size, simulated runs with 1-3 injected stragglers (slowdown drawn
from 5-50%, onset anywhere, any cause) and straggler-free runs, all with per-step
jitter, job-wide drift and transient spikes. Reports, per slowdown band: recall
(injected stragglers flagged on the right rank), precision (flags that match an
injection), cause accuracy, detection latency and onset error in steps; and the
flags raised on straggler-free runs.

    python benchmarks/accuracy.py                      # 64..4096 ranks
    python benchmarks/accuracy.py --sizes 64 256 --trials 20
    python benchmarks/accuracy.py --models             # per noise model, fixed 5/10/20% slowdowns

``--models``: for each noise model of ``NOISE_MODELS`` (independent jitter of 3, 5 and 10%; and
the noise of real clusters: persistent per-rank offsets, heavy-tailed spikes, periodic job-wide
stalls, noise shared by a host's ranks, slow mean-reverting per-rank drift, and per-step
residuals resampled from real healthy DDP runs, ``data/healthy-residuals.csv``),
straggler-free runs (false flags, and per 1,000 rank-hours of 100 ms steps) and runs with
one straggler of 5, 10 or 20% (recall, recall within 30 steps, latency, precision). Under
offsets and drift a rank can truly be more than ``tolerance`` (5%) slower than its peers with
no straggler injected: a flag on it is still a flag (counted in "flags" and against precision),
and shown again apart ("on drifted ranks", with the median true drift of the flagged ranks at
the flag), since the detector documents ranks within ``tolerance`` as healthy, not ranks beyond it.

    python benchmarks/accuracy.py --models --trials 40 --healthy 10
    python benchmarks/accuracy.py --models --model "iid 10%" --model "real runs"
    python benchmarks/accuracy.py --long 1000          # false flags in 1,000 rank-hours per model

``--imbalance``: load imbalance (ranks given different tokens in the same step, ``SimConfig.tokens``)
under each noise model: variable-length batches without a straggler, with a compute or a data straggler
hidden in them, token-balanced batches, and a static heavy shard (``IMBALANCE_CASES``). Per row: false
flags (every flag on a rank that was not slowed, or raised before it was), the straggler found on the
right rank with the right cause, imbalance detected, and its estimated cost against the simulator's
true cost (``imbalance_truth``: the job time lost because ranks got unequal work), with the error.

    python benchmarks/accuracy.py --imbalance --trials 5
    python benchmarks/accuracy.py --imbalance --model "iid 3%" --case "static heavy shard"
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from stragglerwatch.analysis.detect import Straggler, Verdict, detect
from stragglerwatch.analysis.thresholds import DetectConfig, classic_floors
from stragglerwatch.record.simulate import (
    CAUSE_PHASES,
    Injection,
    SimConfig,
    imbalance_truth,
    simulate_arrays,
    to_frame,
)

BANDS = ((0.05, 0.10), (0.10, 0.20), (0.20, 0.501))
BASE = {"noise": 0.03, "spike_prob": 0.005, "spike_mag": 1.0}
REAL = str(Path(__file__).resolve().parent / "data" / "healthy-residuals.csv")
NOISE_MODELS = {
    "iid 3%": {},
    "offsets 2%": {"offset": 0.02},
    "offsets 4%": {"offset": 0.04},
    "heavy tail": {"spike_tail": 1.5},
    "stalls /50": {"stall_every": 50, "stall_mag": 0.5},
    "host 3%": {"host_noise": 0.03},
    "drift 2%": {"rank_drift": 0.02},
    "drift 3%": {"rank_drift": 0.03},
    "fast drift": {"rank_drift": 0.02, "drift_steps": 400},
    "iid 5%": {"noise": 0.05},
    "iid 10%": {"noise": 0.10},
    "real runs": {"noise": 0.0, "spike_prob": 0.0, "bootstrap": REAL},
}


#: Load-imbalance cases: name -> (SimConfig keywords, straggler cause and slowdown or None, what is expected:
#: imbalance detected or not). 4,096 tokens a rank per step in 8 log-normal sequences, spread 25%; the first,
#: the same runs without the imbalance model (no work recorded), for the noise model's own false flags.
TOKENS = {"tokens": 4096.0, "token_cv": 0.25, "token_seqs": 8}
IMBALANCE_CASES: dict[str, tuple[dict, tuple[str, float] | None, bool]] = {
    "no work recorded": ({"tokens": 0.0}, None, False),
    "variable lengths": (TOKENS, None, True),
    "+ compute straggler 10%": (TOKENS, ("compute", 0.10), True),
    "+ compute straggler 20%": (TOKENS, ("compute", 0.20), True),
    "+ data straggler 10%": (TOKENS, ("data", 0.10), True),
    "+ data straggler 20%": (TOKENS, ("data", 0.20), True),
    "token-balanced": ({**TOKENS, "token_mode": "balanced"}, None, False),
    "static heavy shard": ({**TOKENS, "token_cv": 0.05, "token_mode": "static", "heavy_share": 0.2}, None, True),
}
#: The cost's error counted as right: within this share of the true cost.
COST_ERROR = 0.15


@dataclass
class ImbalanceRow:
    runs: int = 0
    false_flags: int = 0  # flags on a rank not slowed, or raised before it was
    drifted_flags: int = 0  # ... of them on a rank that offsets or drift truly made slower than the tolerance
    found: int = 0  # runs with the straggler flagged on its rank, with its cause
    found_rank: int = 0  # ... on its rank, any cause
    detected: int = 0
    estimated: list[float] = field(default_factory=list)  # the verdict's imbalance cost, seconds
    true: list[float] = field(default_factory=list)  # the simulator's, seconds
    true_s: list[float] = field(default_factory=list)  # the true slowdown S from imbalance alone

    def errors(self) -> list[float]:
        return [e / t - 1.0 if t > 0 else float("nan") for e, t in zip(self.estimated, self.true, strict=True)]


def imbalance_seed(seed0: int, model: str, case: str, trial: int) -> int:
    """A run's seed from the names (a subset of models or cases gives the same figures as a full table)."""
    words = [seed0, zlib.crc32(model.encode()), zlib.crc32(case.encode()), trial]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def imbalance_config(ranks: int, steps: int, seed: int, kw: dict, case: str) -> SimConfig:
    """The simulation of one run of an imbalance case (``IMBALANCE_CASES``) under the noise ``kw``: the
    straggler's rank, its onset in [50, steps - 100] and the static heavy rank drawn from ``seed``."""
    sim, straggler, _ = IMBALANCE_CASES[case]
    rng = np.random.default_rng(seed)
    injections = []
    if straggler is not None:
        cause, slowdown = straggler
        injections = [Injection(int(rng.integers(ranks)), slowdown, int(rng.integers(50, steps - 100)), cause)]
    return SimConfig(ranks=ranks, steps=steps, seed=seed, injections=injections, heavy_rank=int(rng.integers(ranks)),
                     **{**kw, **sim})  # fmt: skip


def imbalance_run(cfg: SimConfig, row: ImbalanceRow, level_of: Callable[[SimConfig], np.ndarray | None] | None = None
                  ) -> None:  # fmt: skip
    """Detect on ``cfg`` and score the verdict into ``row``; ``level_of``: the true drift of each rank
    (default :func:`true_level`), to tell the false flags on drifted ranks."""
    verdict = detect(to_frame(cfg))
    truth = imbalance_truth(cfg)
    level, tol = (level_of or true_level)(cfg), classic_floors(DetectConfig()).tolerance
    row.runs += 1
    slowed = {i.rank: i.onset for i in cfg.injections}
    flags = flagged(verdict)
    for s in flags:
        if not (s.rank in slowed and s.detected_step >= slowed[s.rank]):
            row.false_flags += 1
            row.drifted_flags += drifted(s, level, tol)
    for inj in cfg.injections:
        mine = [s for s in flags if s.rank == inj.rank and s.detected_step >= inj.onset]
        row.found_rank += bool(mine)
        row.found += any(s.cause == inj.cause for s in mine)
    found = getattr(verdict, "imbalance", None)
    row.detected += bool(found is not None and found.detected)
    row.estimated.append(float(found.lost_seconds or 0.0) if found is not None else float("nan"))
    row.true.append(truth.lost_seconds if truth is not None else float("nan"))
    row.true_s.append(truth.slowdown if truth is not None else float("nan"))


def imbalance_table(ranks: int, steps: int, trials: int, models: dict[str, dict], cases: list[str],
                    seed0: int = 50_000) -> dict[tuple[str, str], ImbalanceRow]:  # fmt: skip
    """Per noise model and imbalance case: flags, straggler found, imbalance detected, cost error."""
    print(f"{ranks} ranks x {steps} steps (100 ms), {trials} runs per row; {TOKENS['tokens']:.0f} tokens a rank per "
          f"step in {TOKENS['token_seqs']} log-normal sequences (spread {TOKENS['token_cv']:.0%}); stragglers from a "
          f"random step in [50, {steps - 100}]; cost right within {COST_ERROR:.0%}")  # fmt: skip
    print(f"{'noise model':>18} {'case':>24} " + " ".join(f"{h:>{w}}" for h, w in IMBALANCE_HEADER.items()))
    out = {}
    for name, kw in models.items():
        for case in cases:
            row = ImbalanceRow()
            for t in range(trials):
                imbalance_run(imbalance_config(ranks, steps, imbalance_seed(seed0, name, case, t), kw, case), row)
            out[name, case] = row
            cells = " ".join(f"{c:>{w}}" for c, w in zip(imbalance_cells(row, case), IMBALANCE_HEADER.values(),
                                                         strict=True))  # fmt: skip
            print(f"{name:>18} {case:>24} {cells}", flush=True)
    return out


def imbalance_cells(row: ImbalanceRow, case: str) -> list[str]:
    """The figures of one row of :func:`imbalance_table` (``IMBALANCE_HEADER``), after its noise model and case."""
    _, straggler, expected = IMBALANCE_CASES[case]
    flags = f"{row.false_flags}" + (f" ({row.drifted_flags} dr.)" if row.drifted_flags else "")
    found = "-"
    if straggler is not None:
        found = f"{row.found}/{row.runs}" + (f" ({row.found_rank})" if row.found_rank != row.found else "")
    known = [t for t in row.true if t == t]
    cost = f"{statistics.median(row.estimated):.2f} / {statistics.median(known):.2f}" if known else "-"
    true_s = f"{statistics.median(row.true_s):.3f}" if known else "-"
    errors = row.errors()
    err, within = "-", "-"
    if expected and errors and all(e == e for e in errors):
        err = f"{statistics.median(errors):+.1%} / {max(errors, key=abs):+.1%}"
        within = f"{sum(abs(e) <= COST_ERROR for e in errors)}/{row.runs}"
    return [flags, found, f"{row.detected}/{row.runs}", true_s, cost, err, within]


#: The columns of :func:`imbalance_cells`, and their widths in the printed table.
IMBALANCE_HEADER = {"false flags": 11, "found (cause)": 13, "imbalance": 9, "true S": 6, "est / true s (median)": 21,
                    "error med / worst": 17, "within": 6}  # fmt: skip


#: The noise models of ``--imbalance`` (all of ``NOISE_MODELS`` but the slow drifts, which are about flags
#: on drifted ranks, not about work).
IMBALANCE_MODELS = ["iid 3%", "offsets 2%", "heavy tail", "stalls /50", "host 3%", "fast drift", "iid 5%", "iid 10%",
                    "real runs"]  # fmt: skip


def band_of(slowdown: float) -> str:
    for lo, hi in BANDS:
        if lo <= slowdown < hi:
            return f"{lo:.0%}-{min(hi, 0.5):.0%}"
    return "other"


def trial(ranks: int, steps: int, seed: int, noise: float, healthy: bool) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    injections = []
    if not healthy:
        for rank in rng.choice(ranks, size=int(rng.integers(1, 4)), replace=False):
            injections.append(
                Injection(
                    rank=int(rank),
                    slowdown=float(rng.uniform(0.05, 0.5)),
                    onset=int(rng.integers(0, steps - 60)),
                    cause=str(rng.choice(list(CAUSE_PHASES))),
                )
            )
    cfg = SimConfig(ranks=ranks, steps=steps, seed=seed, noise=noise, spike_prob=0.005, spike_mag=1.0,
                    injections=injections)  # fmt: skip
    verdict = detect(to_frame(cfg))
    return injections, flagged(verdict)


def flagged(verdict: Verdict) -> list[Straggler]:
    """Each flag of ``verdict``: a straggler's episodes a short pause apart joined (``Straggler.spells``), so
    that a flag raised before an injection's onset and one raised after it are told apart, as the
    verdicts of earlier releases (one per spell) told them. The brief flags of negligible cost that the
    verdict keeps as details (``Verdict.minor``) are flags too: they are counted, not hidden."""
    return [spell for s in verdict.stragglers + verdict.minor for spell in s.spells(DetectConfig().window)]


def brief(verdict: Verdict) -> list[Straggler]:
    """The flags of :func:`flagged` that the verdict keeps as details (brief, of negligible cost)."""
    return [spell for s in verdict.minor for spell in s.spells(DetectConfig().window)]


def true_level(cfg: SimConfig) -> np.ndarray | None:
    """Steps x ranks noise-free busy over the step's median - 1 (offsets and drift only), or None when
    the noise model has neither: then every rank of a straggler-free run is healthy by construction."""
    if not (cfg.offset or cfg.rank_drift):
        return None
    clean = simulate_arrays(replace(cfg, noise=0.0, drift=0.0, spike_prob=0.0, stall_every=0, injections=[],
                                    tokens=0.0))  # fmt: skip
    return clean["busy_s"] / np.median(clean["busy_s"], axis=1, keepdims=True) - 1.0


def drifted(flag: Straggler, level: np.ndarray | None, tolerance: float) -> bool:
    """A flag on a rank that offsets or drift made truly slower than ``tolerance`` (a gray zone the
    detector may flag: it documents ranks within ``tolerance`` as healthy, not ranks above it)."""
    return level is not None and level[flag.detected_step, flag.rank] >= tolerance


def drift_of(flag: Straggler, level: np.ndarray | None) -> float:
    """How much slower than its peers offsets and drift truly made the flagged rank at the flag."""
    return float(level[flag.detected_step, flag.rank]) if level is not None else 0.0


def drift_note(drifts: list[float]) -> str:
    return f"{len(drifts)} (+{statistics.median(drifts):.1%})" if drifts else "0"


def oracle_recall(noise: float, shift: float, decision: float, horizon: int = 30, trials: int = 20_000) -> float:
    """Share of changes found within ``horizon`` steps by the best possible test: a CUSUM that knows the
    baseline, the size of the change and that the noise is Gaussian and independent, alarming at the same
    ``decision`` (nats) as the detector. No detector can do much better at the same false-alarm rate."""
    rng = np.random.default_rng(0)
    k, h = shift / 2.0, decision * noise**2 / shift
    cusum, found = np.zeros(trials), np.zeros(trials, dtype=bool)
    for _ in range(horizon):
        cusum = np.maximum(0.0, cusum + rng.normal(shift, noise, trials) - k)
        found |= cusum >= h
    return float(found.mean())


def model_table(ranks: int, steps: int, trials: int, healthy: int, models: list[str]) -> None:
    """Per noise model: false flags on straggler-free runs, and recall/latency/precision at fixed slowdowns."""
    print(f"{ranks} ranks x {steps} steps (100 ms steps), {healthy} straggler-free runs and {trials} runs per "
          f"slowdown per model; one straggler, random rank, cause and onset in [50, {steps - 100}]")  # fmt: skip
    print(f"{'noise model':>11} {'flags':>7} {'per 1k rank-h':>13} {'on drifted ranks':>16} "
          + " ".join(f"{'recall ' + f'{x:.0%}':>10}" for x in (0.05, 0.10, 0.20))
          + f" {'<=30 steps @10%':>15} {'@20%':>5} {'latency @10% med/p90':>20} {'precision':>9}")  # fmt: skip
    rank_hours = ranks * steps * 0.1 / 3600
    tol = classic_floors(DetectConfig()).tolerance
    seed = 10_000
    for name in models:
        kw = {**BASE, **NOISE_MODELS[name]}
        false, gray = 0, []
        for _ in range(healthy):
            seed += 1
            cfg = SimConfig(ranks=ranks, steps=steps, seed=seed, **kw)
            level = true_level(cfg)
            for flag in flagged(detect(to_frame(cfg))):
                false += 1
                if drifted(flag, level, tol):
                    gray.append(drift_of(flag, level))
        recall, quick, lat10, flags, matched = {}, defaultdict(list), [], 0, 0
        for slowdown in (0.05, 0.10, 0.20):
            hits = []
            for _ in range(trials):
                seed += 1
                rng = np.random.default_rng(seed)
                inj = Injection(int(rng.integers(ranks)), slowdown, int(rng.integers(50, steps - 100)),
                                str(rng.choice(list(CAUSE_PHASES))))  # fmt: skip
                cfg = SimConfig(ranks=ranks, steps=steps, seed=seed, injections=[inj], **kw)
                found = detect(to_frame(cfg))
                spells = flagged(found)
                right = [s for s in spells if s.rank == inj.rank and s.detected_step >= inj.onset]
                flags += len(right) + sum(s.rank != inj.rank for s in spells)
                matched += len(right)
                hits.append(bool(right))
                quick[slowdown].append(bool(right) and right[0].detected_step - inj.onset <= 30)
                if slowdown == 0.10 and right:
                    lat10.append(right[0].detected_step - inj.onset)
            recall[slowdown] = statistics.mean(hits)
        lat = f"{statistics.median(lat10):.0f}/{np.percentile(lat10, 90):.0f}" if lat10 else "-"
        print(f"{name:>11} {false:>7} {false / (healthy * rank_hours) * 1000:>13.1f} {drift_note(gray):>16} "
              + " ".join(f"{recall[x]:>10.2f}" for x in (0.05, 0.10, 0.20))
              + f" {statistics.mean(quick[0.10]):>15.2f} {statistics.mean(quick[0.20]):>5.2f} {lat:>20} "
              f"{matched / flags if flags else 1.0:>9.3f}", flush=True)  # fmt: skip
    decision = DetectConfig().decision
    print("the limit: a 10% change found within 30 steps by an oracle CUSUM at the same decision "
          f"({decision:g} nats): " + ", ".join(f"{oracle_recall(n, 0.10, decision):.2f} at {n:.0%} noise"
                                                for n in (0.03, 0.05, 0.10)))  # fmt: skip


def long_healthy(rank_hours: float, models: list[str], ranks: int = 256, steps: int = 10_000) -> None:
    """False flags on long straggler-free runs: ``rank_hours`` of 100 ms steps per noise model."""
    per_run = ranks * steps * 0.1 / 3600
    runs = max(1, int(np.ceil(rank_hours / per_run)))
    print(f"straggler-free runs of {ranks} ranks x {steps} steps (100 ms): {runs} per model, "
          f"{runs * per_run:.0f} rank-hours")  # fmt: skip
    print(f"{'noise model':>11} {'flags':>7} {'per 1k rank-h':>13} {'on drifted ranks':>16} {'seconds':>8}")
    tol = classic_floors(DetectConfig()).tolerance
    for name in models:
        t0, flags, gray = time.perf_counter(), 0, []
        for i in range(runs):
            cfg = SimConfig(ranks=ranks, steps=steps, seed=90_000 + i, **{**BASE, **NOISE_MODELS[name]})
            level = true_level(cfg)
            for flag in flagged(detect(to_frame(cfg))):
                flags += 1
                if drifted(flag, level, tol):
                    gray.append(drift_of(flag, level))
        print(f"{name:>11} {flags:>7} {flags / (runs * per_run) * 1000:>13.1f} {drift_note(gray):>16} "
              f"{time.perf_counter() - t0:>8.0f}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--trials", type=int, help="runs with stragglers per size (default 12; --imbalance: per row, 5)")
    p.add_argument("--healthy", type=int, default=4, help="straggler-free runs per size (default 4)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--noise", type=float, default=0.03, help="per-step jitter (default 0.03)")
    p.add_argument("--models", action="store_true", help="the per-noise-model table (first of --sizes ranks)")
    p.add_argument("--model", action="append", choices=list(NOISE_MODELS), help="with --models: only these")
    p.add_argument("--imbalance", action="store_true", help="the load-imbalance table (first of --sizes ranks; "
                   "--trials: runs per row, default 5)")  # fmt: skip
    p.add_argument("--case", action="append", choices=list(IMBALANCE_CASES), help="with --imbalance: only these")
    p.add_argument("--long", type=float, metavar="RANK_HOURS",
                   help="false flags on long straggler-free runs (256 ranks x 10,000 steps), this many rank-hours "
                   "per noise model (of --model, default all)")  # fmt: skip
    args = p.parse_args()
    if args.imbalance:
        models = {m: {**BASE, **NOISE_MODELS[m]} for m in args.model or IMBALANCE_MODELS}
        imbalance_table(args.sizes[0] if args.sizes != [64, 256, 1024, 4096] else 64, args.steps, args.trials or 5,
                        models, args.case or list(IMBALANCE_CASES))  # fmt: skip
        return
    args.trials = 12 if args.trials is None else args.trials
    if args.long:
        long_healthy(args.long, args.model or list(NOISE_MODELS))
        return
    if args.models:
        model_table(args.sizes[0] if args.sizes != [64, 256, 1024, 4096] else 64, args.steps, args.trials,
                    args.healthy, args.model or list(NOISE_MODELS))  # fmt: skip
        return

    found: dict[str, list[int]] = defaultdict(list)  # band -> [hit 0/1]
    cause_ok: dict[str, list[int]] = defaultdict(list)
    latency: dict[str, list[int]] = defaultdict(list)
    onset_err: dict[str, list[int]] = defaultdict(list)
    flags_total = flags_matched = 0
    healthy_flags = healthy_runs = 0
    t0 = time.perf_counter()
    seed = 0
    for ranks in args.sizes:
        for i in range(args.trials + args.healthy):
            seed += 1
            healthy = i >= args.trials
            injections, flagged = trial(ranks, args.steps, seed, args.noise, healthy)
            if healthy:
                healthy_runs += 1
                healthy_flags += len(flagged)
                continue
            by_rank = {inj.rank: inj for inj in injections}
            for s in flagged:
                flags_total += 1
                inj = by_rank.get(s.rank)
                flags_matched += int(inj is not None and s.detected_step >= inj.onset)
            for inj in injections:
                band = band_of(inj.slowdown)
                hits = [s for s in flagged if s.rank == inj.rank and s.detected_step >= inj.onset]
                found[band].append(int(bool(hits)))
                if hits:
                    cause_ok[band].append(int(hits[0].cause == inj.cause))
                    latency[band].append(hits[0].detected_step - inj.onset)
                    onset_err[band].append(abs(hits[0].first_step - inj.onset))
        print(f"... {ranks} ranks done ({time.perf_counter() - t0:.0f} s)", flush=True)

    print(f"\nsizes {args.sizes}, {args.steps} steps, noise {args.noise:.0%}, spikes 0.5%/step of 1x a step")
    print(f"{'slowdown':>9} {'n':>4} {'recall':>7} {'cause ok':>9} {'latency med/p90':>16} {'onset err med/max':>18}")
    for lo, _ in BANDS:
        band = band_of(lo)
        n = len(found[band])
        if not n:
            continue
        lat, err = latency[band] or [0], onset_err[band] or [0]
        print(
            f"{band:>9} {n:>4} {statistics.mean(found[band]):>7.3f} {statistics.mean(cause_ok[band] or [0]):>9.3f} "
            f"{statistics.median(lat):>8.0f}/{np.percentile(lat, 90):<7.0f} "
            f"{statistics.median(err):>9.0f}/{max(err):<8}"
        )
    precision = flags_matched / flags_total if flags_total else 1.0
    print(f"precision (all flags on runs with stragglers): {precision:.3f} ({flags_matched}/{flags_total})")
    print(f"flags on straggler-free runs: {healthy_flags} in {healthy_runs} runs")
    ge10 = [h for b in ("10%-20%", "20%-50%") for h in found[b]]
    lat10 = [x for b in ("10%-20%", "20%-50%") for x in latency[b]]
    if ge10:
        recall = statistics.mean(ge10)
        print(f"slowdown >= 10%: recall {recall:.3f}, median latency {statistics.median(lat10):.0f} steps")


if __name__ == "__main__":
    main()
