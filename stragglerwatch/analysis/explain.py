"""Why is a straggler slow? Its host and GPU context against its peers' over the same time. Pure.

Design: :func:`explain` takes the context samples of a run (``context.load_context``), the
verdict's stragglers (rank, ``first_step``, ``last_step``) and the time each step started and
ended (from the step log), and returns, per straggler, the context signals in which it differed
from its peers while it was slow. For each signal of :data:`SIGNALS` the straggler's value is
its median over the flagged time span (the share of samples, for a clock event reason; the
increase, for an error counter), each peer's value is the same over the same span, and the
signal is named only when the straggler's value is worse than the peers' median by at least
all of: the signal's minimum absolute difference (tiny differences are not named), a fraction of
the peers' median, and ``K`` robust standard deviations of the peers (1.4826 x their MAD). Peers
are the other ranks of its role that were not flagged themselves (all other ranks if none is
left). Without context, or when nothing differs, the list is empty: a signal is named only when
it differs.

A signal that the rank's own extra work produces is no cause: a rank that runs more CPU time is
switched out more often per second, waits for its CPU more per second under any sharing, adds its
own threads to its host's load and pressure, and a busier vCPU has more time to be stolen. So a
rate is named only when it is worse both per second and per CPU-second the rank ran (its training
thread's run-queue wait and involuntary switches per CPU-second of its process, its workers'
switches per CPU-second of theirs, steal per second its CPUs were busy: :class:`PerRun`; a process
that ran under :data:`MIN_CPU` has no such value): per second alone blames the rank that runs
more, per CPU-second alone the one that runs in short bursts (each wake-up waits a little). Load
is judged without the rank's own runnable threads, CPU pressure beyond its training thread's own
wait; CPU time other processes took on its CPUs is not the rank's own. A hot GPU is named only
with the slower clock or the thermal slowdown it causes (a busier GPU runs hotter at the same
clock).
:func:`span_values` gives a straggler's own medians over its span (for ``advice.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.record.context import REASONS, SLOWDOWNS

K = 4.0  # robust z a difference must exceed, in the peers' spread
MIN_SAMPLES = 2  # samples of the straggler in its span needed to say anything
MIN_CPU = 0.02  # CPU-seconds per second below which a per-CPU-second rate is noise (not judged)
_PHRASE = {
    "sw_power_cap": "power capping (software power cap)",
    "hw_slowdown": "hardware slowdown (HW_SLOWDOWN)",
    "sw_thermal_slowdown": "thermal slowdown (software)",
    "hw_thermal_slowdown": "thermal slowdown (hardware)",
    "hw_power_brake_slowdown": "power brake slowdown",
    "sync_boost": "sync boost (held at its group's clock)",
    "applications_clocks_setting": "clocks held by the applications clock setting",
}
#: What some XIDs mean (NVIDIA's XID catalog); others are named by number only.
XIDS = {13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
        48: "double-bit ECC error", 63: "ECC page retirement or row remapping", 64: "row remapping failure",
        74: "NVLink error", 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
        94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error"}  # fmt: skip


@dataclass(frozen=True)
class Signal:
    name: str
    column: str
    worse: int  # +1: higher is worse; -1: lower is worse
    min_diff: float  # smallest absolute difference that is named
    say: Callable[[float, float], str]  # (its value, the peers' median) -> the finding's text
    rel: float = 0.0  # the difference must also exceed this fraction of the peers' median
    agg: str = "median"  # "median" over the span, "mean" (share of samples), "increase" (counters)
    needs: tuple[str, ...] = ()  # named only with one of these signals (what makes it slow)
    per: PerRun | None = None  # named only if also worse per unit of what the rank ran


@dataclass(frozen=True)
class PerRun:
    """A rate's second test: the same rate per CPU-second (or busy second) the rank ran must be
    worse too, so that neither running more (more waits per second) nor running less (more
    wake-ups per CPU-second) is taken for contention."""

    column: str
    min_diff: float
    rel: float
    say: Callable[[float, float], str]


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


SIGNALS: tuple[Signal, ...] = (
    Signal("xid", "xid_events", 1, 1, lambda v, p: f"{v:.0f} XID error(s) reported (peers {p:.0f})", agg="increase"),
    Signal("ecc_uncorrected", "ecc_uncorrected", 1, 1,
           lambda v, p: f"{v:.0f} uncorrected ECC errors (peers {p:.0f})", agg="increase"),
    *(Signal(f"gpu_{r}", f"reason_{r}", 1, 0.5, lambda v, p, r=r: f"GPU {_PHRASE[r]} in {_pct(v)} of samples "
             f"(peers {_pct(p)})", agg="mean") for r in SLOWDOWNS),
    Signal("sm_clock", "sm_clock_mhz", -1, 100,
           lambda v, p: f"SM clock {v / 1000:.2f} GHz vs peers' {p / 1000:.2f} GHz", rel=0.05),
    Signal("temperature", "temperature_c", 1, 10, lambda v, p: f"GPU at {v:.0f} °C (peers {p:.0f} °C)",
           needs=("sm_clock", "gpu_sw_thermal_slowdown", "gpu_hw_thermal_slowdown")),
    Signal("power_limit", "power_limit_w", -1, 25, lambda v, p: f"GPU power limit {v:.0f} W (peers {p:.0f} W)",
           rel=0.05),
    Signal("pcie_replays", "pcie_replays", 1, 10,
           lambda v, p: f"{v:,.0f} PCIe replays (peers {p:,.0f}): a degraded PCIe link", agg="increase"),
    Signal("nvlink_errors", "nvlink_errors", 1, 10, lambda v, p: f"{v:,.0f} NVLink errors (peers {p:,.0f})",
           agg="increase"),
    Signal("ecc_corrected", "ecc_corrected", 1, 100, lambda v, p: f"{v:,.0f} corrected ECC errors (peers {p:,.0f})",
           agg="increase"),
    Signal("run_delay", "run_delay", 1, 0.10,
           lambda v, p: f"its training thread waited for a CPU {_pct(v)} of the time (peers {_pct(p)})", rel=0.5,
           per=PerRun("run_delay_per_cpu", 0.25, 0.25,
                      lambda v, p: f"{v:.2f} s per CPU-second its process ran (peers {p:.2f} s)")),
    Signal("cpu_pressure", "cpu_pressure_beyond", 1, 0.10,
           lambda v, p: f"CPU pressure {_pct(v)} beyond its training thread's own wait (peers {_pct(p)})", rel=0.5),
    Signal("invol_switches", "invol_switches", 1, 50,
           lambda v, p: f"{v:,.0f} involuntary context switches/s (peers {p:,.0f}/s)", rel=1.0,
           per=PerRun("invol_per_cpu", 50, 1.0, lambda v, p: f"{v:,.0f} per CPU-second its process ran "
                      f"(peers {p:,.0f})")),
    Signal("others_cpu", "others_cpu", 1, 0.25,
           lambda v, p: f"other processes used {v:.2f} of its CPUs (peers {p:.2f})"),
    Signal("steal", "steal", 1, 0.05, lambda v, p: f"hypervisor steal {_pct(v)} of its CPUs' time (peers {_pct(p)})",
           per=PerRun("steal_share", 0.05, 0.0, lambda v, p: f"{_pct(v)} of their busy time (peers {_pct(p)})")),
    Signal("load_per_cpu", "others_load_per_cpu", 1, 0.5,
           lambda v, p: f"load average {v:.1f} per CPU besides its own threads (peers {p:.1f})", rel=0.5),
    Signal("affinity_cpus", "affinity_cpus", -1, 1, lambda v, p: f"may run on {v:.0f} CPU(s) (peers {p:.0f})",
           rel=0.25),
    Signal("workers_invol_switches", "workers_invol_switches", 1, 100,
           lambda v, p: f"its data-loader workers were switched out {v:,.0f} times/s (peers {p:,.0f}/s)", rel=1.0,
           per=PerRun("workers_invol_per_cpu", 100, 1.0, lambda v, p: f"{v:,.0f} per CPU-second they ran "
                      f"(peers {p:,.0f})")),
    Signal("memory_pressure", "memory_pressure", 1, 0.05, lambda v, p: f"memory pressure {_pct(v)} (peers {_pct(p)})"),
    Signal("io_pressure", "io_pressure", 1, 0.10,
           lambda v, p: f"I/O pressure {_pct(v)} on its host: tasks waited for storage (peers {_pct(p)})", rel=0.5),
    Signal("swap_used", "swap_used_bytes", 1, 2**28,
           lambda v, p: f"{v / 2**30:.1f} GiB in swap (peers {p / 2**30:.1f} GiB)", rel=0.5),
)  # fmt: skip

StepTimes = tuple[np.ndarray, np.ndarray, np.ndarray]  # (steps, start time, end time), sorted by step


def prepare(context: pd.DataFrame) -> pd.DataFrame:
    """The context with the derived columns the signals read."""
    c = context.copy()
    with np.errstate(all="ignore"):
        cores = c["cores_busy"] * c["affinity_cpus"].where(c["affinity_cpus"] > 0)
        c["others_cpu"] = (cores - c["cpu_time"] - c["workers_cpu_time"].fillna(0.0)).clip(lower=0.0)
        own = c["cpu_time"] + c["workers_cpu_time"].fillna(0.0) + c["run_delay"]  # its runnable threads
        c["others_load_per_cpu"] = (c["load1"] - own).clip(lower=0.0) / c["cpus"].where(c["cpus"] > 0)
        ran = c["cpu_time"].where(c["cpu_time"] >= MIN_CPU)
        c["run_delay_per_cpu"] = c["run_delay"] / ran
        c["invol_per_cpu"] = c["invol_switches"] / ran
        workers_ran = c["workers_cpu_time"].where(c["workers_cpu_time"] >= MIN_CPU)
        c["workers_invol_per_cpu"] = c["workers_invol_switches"] / workers_ran
        c["steal_share"] = (c["steal"] / c["cores_busy"].where(c["cores_busy"] >= MIN_CPU)).clip(upper=1.0)
        c["cpu_pressure_beyond"] = (c["cpu_pressure"] - c["run_delay"].fillna(0.0)).clip(lower=0.0)
    c["affinity_cpus"] = c["affinity_cpus"].where(c["affinity_cpus"] > 0).astype(float)
    known = c["clock_reasons"] >= 0
    for bit, name in REASONS.items():
        c[f"reason_{name}"] = ((c["clock_reasons"] & bit) > 0).astype(float).where(known)
    return c


def _prepared(context: pd.DataFrame) -> pd.DataFrame:
    """``context`` with its derived columns (as it is when :func:`prepare` made it already)."""
    return context if "others_cpu" in context.columns else prepare(context)


def span(step_times: StepTimes, first_step: int, last_step: int | None) -> tuple[float, float] | None:
    """Unix seconds from the start of ``first_step`` to the end of ``last_step`` (None: the last step)."""
    steps, starts, ends = step_times
    if not len(steps):
        return None
    i = min(int(np.searchsorted(steps, first_step)), len(steps) - 1)
    j = len(steps) - 1 if last_step is None else min(int(np.searchsorted(steps, last_step)), len(steps) - 1)
    t0, t1 = float(starts[i]), float(ends[max(i, j)])
    return (t0, t1) if math.isfinite(t0) and math.isfinite(t1) and t1 > t0 else None


def _value(rows: pd.DataFrame, before: pd.DataFrame, sig: Signal) -> float:
    col = rows[sig.column].dropna()
    if col.empty:
        return math.nan
    if sig.agg == "median":
        return float(col.median())
    if sig.agg == "mean":
        return float(col.mean())
    base = before[sig.column].dropna()
    start = float(base.iloc[-1]) if not base.empty else float(col.iloc[0])
    return max(0.0, float(col.iloc[-1]) - start)


def _get(s: Any, key: str) -> Any:
    return s[key] if isinstance(s, Mapping) else getattr(s, key)


def _windows(
    c: pd.DataFrame, stragglers: Sequence[Any], step_times: StepTimes, roles: Mapping[int, str | None] | None
) -> Iterator[tuple[int, pd.DataFrame, pd.DataFrame, list[tuple[pd.DataFrame, pd.DataFrame]]]]:
    """Per straggler with enough samples in its span: (its index, its rows in the span, its rows
    before, [(rows in the span, rows before) of each peer with samples there])."""
    by_rank = {int(r): g for r, g in c.groupby("rank", sort=True)}
    pad = float(np.nanmedian(c["interval_s"])) if c["interval_s"].notna().any() else 1.0
    flagged = {int(_get(s, "rank")) for s in stragglers}
    roles = roles or {}
    for k, s in enumerate(stragglers):
        rank = int(_get(s, "rank"))
        window = span(step_times, int(_get(s, "first_step")), _get(s, "last_step"))
        if window is None or rank not in by_rank:
            continue
        t0, t1 = window[0], window[1] + max(pad, 0.0)
        others = [r for r in by_rank if r != rank and roles.get(r) == roles.get(rank)]
        peers = [r for r in others if r not in flagged] or others
        mine = by_rank[rank]
        rows = mine[(mine["time"] > t0) & (mine["time"] <= t1)]
        if len(rows) < MIN_SAMPLES:
            continue
        peer_rows = []
        for p in peers:
            g = by_rank[p]
            inside = (g["time"] > t0) & (g["time"] <= t1)
            if inside.any():
                peer_rows.append((g[inside], g[g["time"] <= t0]))
        yield k, rows, mine[mine["time"] <= t0], peer_rows


def explain(
    context: pd.DataFrame,
    stragglers: Sequence[Any],
    step_times: StepTimes,
    roles: Mapping[int, str | None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Per straggler (a mapping or object with ``rank``, ``first_step``, ``last_step``), the context
    signals that differ from its peers' while it was slow: ``{"signal", "value", "peers", "text"}``."""
    out: list[list[dict[str, Any]]] = [[] for _ in stragglers]
    if context is None or context.empty or not len(stragglers):
        return out
    for k, rows, before, peer_rows in _windows(_prepared(context), stragglers, step_times, roles):
        if peer_rows:
            out[k] = _findings(rows, before, peer_rows)
    return out


#: The columns of :func:`span_values`.
SPAN_COLUMNS = ("cpu_time", "workers", "workers_cpu_time", "affinity_cpus", "others_cpu")


def span_values(
    context: pd.DataFrame | None,
    stragglers: Sequence[Any],
    step_times: StepTimes,
    roles: Mapping[int, str | None] | None = None,
) -> list[dict[str, float]]:
    """Per straggler, the median of each of :data:`SPAN_COLUMNS` over its samples in its span (a
    column not known there is left out; no samples: an empty dict)."""
    out: list[dict[str, float]] = [{} for _ in stragglers]
    if context is None or context.empty or not len(stragglers):
        return out
    for k, rows, _, _ in _windows(_prepared(context), stragglers, step_times, roles):
        values = {c: float(rows[c].dropna().median()) for c in SPAN_COLUMNS if rows[c].notna().any()}
        out[k] = values
    return out


def _worse(value: float, peer_values: np.ndarray, worse: int, min_diff: float, rel: float) -> float | None:
    """The peers' median when ``value`` is worse than it by the bar (else None)."""
    peer_values = peer_values[np.isfinite(peer_values)]
    if not math.isfinite(value) or not len(peer_values):
        return None
    median = float(np.median(peer_values))
    spread = 1.4826 * float(np.median(np.abs(peer_values - median)))
    worse_by = worse * (value - median)
    return median if worse_by > 0 and worse_by >= max(min_diff, rel * abs(median), K * spread) else None


def _findings(rows: pd.DataFrame, before: pd.DataFrame, peer_rows: list[tuple[pd.DataFrame, pd.DataFrame]]
              ) -> list[dict[str, Any]]:  # fmt: skip
    found = []
    for sig in SIGNALS:
        value = _value(rows, before, sig)
        median = _worse(value, np.array([_value(r, b, sig) for r, b in peer_rows]), sig.worse, sig.min_diff, sig.rel)
        if median is None:
            continue
        text = sig.say(value, median)
        if sig.per is not None:
            per = Signal(sig.name, sig.per.column, sig.worse, sig.per.min_diff, sig.per.say)
            mine = _value(rows, before, per)
            theirs = _worse(mine, np.array([_value(r, b, per) for r, b in peer_rows]), sig.worse, per.min_diff,
                            sig.per.rel)  # fmt: skip
            if theirs is None:
                continue
            text += ", " + sig.per.say(mine, theirs)
        if sig.name == "xid":
            code = int(rows["xid"].iloc[-1])
            text += f": last XID {code}" + (f" ({XIDS[code]})" if code in XIDS else "")
        found.append({"signal": sig.name, "value": round(value, 6), "peers": round(median, 6), "text": text})
    named = {f["signal"] for f in found}
    needs = {sig.name: sig.needs for sig in SIGNALS if sig.needs}
    return [f for f in found if not needs.get(f["signal"]) or named & set(needs[f["signal"]])]
