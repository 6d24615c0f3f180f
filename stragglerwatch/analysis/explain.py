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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.record.context import REASONS, SLOWDOWNS

K = 4.0  # robust z a difference must exceed, in the peers' spread
MIN_SAMPLES = 2  # samples of the straggler in its span needed to say anything
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
    Signal("temperature", "temperature_c", 1, 10, lambda v, p: f"GPU at {v:.0f} °C (peers {p:.0f} °C)"),
    Signal("power_limit", "power_limit_w", -1, 25, lambda v, p: f"GPU power limit {v:.0f} W (peers {p:.0f} W)",
           rel=0.05),
    Signal("pcie_replays", "pcie_replays", 1, 10,
           lambda v, p: f"{v:,.0f} PCIe replays (peers {p:,.0f}): a degraded PCIe link", agg="increase"),
    Signal("nvlink_errors", "nvlink_errors", 1, 10, lambda v, p: f"{v:,.0f} NVLink errors (peers {p:,.0f})",
           agg="increase"),
    Signal("ecc_corrected", "ecc_corrected", 1, 100, lambda v, p: f"{v:,.0f} corrected ECC errors (peers {p:,.0f})",
           agg="increase"),
    Signal("run_delay", "run_delay", 1, 0.10,
           lambda v, p: f"its training thread waited for a CPU {_pct(v)} of the time (peers {_pct(p)})", rel=0.5),
    Signal("cpu_pressure", "cpu_pressure", 1, 0.10, lambda v, p: f"CPU pressure {_pct(v)} (peers {_pct(p)})", rel=0.5),
    Signal("invol_switches", "invol_switches", 1, 50,
           lambda v, p: f"{v:,.0f} involuntary context switches/s (peers {p:,.0f}/s)", rel=1.0),
    Signal("others_cpu", "others_cpu", 1, 0.25,
           lambda v, p: f"other processes used {v:.2f} of its CPUs (peers {p:.2f})"),
    Signal("steal", "steal", 1, 0.05, lambda v, p: f"hypervisor steal {_pct(v)} of its CPUs' time (peers {_pct(p)})"),
    Signal("load_per_cpu", "load_per_cpu", 1, 0.5, lambda v, p: f"load average {v:.1f} per CPU (peers {p:.1f})",
           rel=0.5),
    Signal("affinity_cpus", "affinity_cpus", -1, 1, lambda v, p: f"may run on {v:.0f} CPU(s) (peers {p:.0f})",
           rel=0.25),
    Signal("workers_invol_switches", "workers_invol_switches", 1, 100,
           lambda v, p: f"its data-loader workers were switched out {v:,.0f} times/s (peers {p:,.0f}/s)", rel=1.0),
    Signal("memory_pressure", "memory_pressure", 1, 0.05, lambda v, p: f"memory pressure {_pct(v)} (peers {_pct(p)})"),
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
        c["load_per_cpu"] = c["load1"] / c["cpus"].where(c["cpus"] > 0)
    c["affinity_cpus"] = c["affinity_cpus"].where(c["affinity_cpus"] > 0).astype(float)
    known = c["clock_reasons"] >= 0
    for bit, name in REASONS.items():
        c[f"reason_{name}"] = ((c["clock_reasons"] & bit) > 0).astype(float).where(known)
    return c


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
    c = prepare(context)
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
        if len(rows) < MIN_SAMPLES or not peers:
            continue
        peer_rows = []
        for p in peers:
            g = by_rank[p]
            inside = (g["time"] > t0) & (g["time"] <= t1)
            if inside.any():
                peer_rows.append((g[inside], g[g["time"] <= t0]))
        if not peer_rows:
            continue
        out[k] = _findings(rows, mine[mine["time"] <= t0], peer_rows)
    return out


def _findings(rows: pd.DataFrame, before: pd.DataFrame, peer_rows: list[tuple[pd.DataFrame, pd.DataFrame]]
              ) -> list[dict[str, Any]]:  # fmt: skip
    found = []
    for sig in SIGNALS:
        value = _value(rows, before, sig)
        peer_values = np.array([_value(r, b, sig) for r, b in peer_rows])
        peer_values = peer_values[np.isfinite(peer_values)]
        if not math.isfinite(value) or not len(peer_values):
            continue
        median = float(np.median(peer_values))
        spread = 1.4826 * float(np.median(np.abs(peer_values - median)))
        worse_by = sig.worse * (value - median)
        if not worse_by > 0 or worse_by < max(sig.min_diff, sig.rel * abs(median), K * spread):
            continue
        text = sig.say(value, median)
        if sig.name == "xid":
            code = int(rows["xid"].iloc[-1])
            text += f": last XID {code}" + (f" ({XIDS[code]})" if code in XIDS else "")
        found.append({"signal": sig.name, "value": round(value, 6), "peers": round(median, 6), "text": text})
    return found
