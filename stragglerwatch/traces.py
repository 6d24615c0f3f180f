"""Import op-level traces of hybrid-parallel jobs (the OSDI'25 what-if artifact's format) and
analyse them with the same report as a run dir, plus the what-if job slowdown and its attribution.

A trace has one row per op per worker: ``dp_rank``, ``stage``, ``rank``, ``step``, ``optype``,
``start_ts``, ``duration``, ``seq_id`` (and ``mc``, ``gmc``, ``mb_id``); its meta YAML gives
``dp_size``, ``pp_size``, ``tp_size``, ``world_size``. What is read:
- per worker and step, the step anatomy: forward and backward compute summed over micro-batches,
  optimizer, communication (its recorded time, waiting included) and the step span; ``busy`` is the
  compute, which is what is compared between the workers of one pipeline stage (the peer group);
- the what-if replay (``whatif.py``) of every step, for ``S`` and its attribution to workers,
  stages and op types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .analysis import Analysis, build_report
from .detect import DetectConfig, detect, to_matrix
from .whatif import COMPUTE, P2P, build_graph, makespan

P2P_OPS = (*P2P, *(recv for recv, _ in P2P.values()))

REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id")
INTEGERS = ("dp_rank", "stage", "rank", "step", "seq_id")


class TraceError(Exception):
    """A trace or meta file that cannot be read; the message is one line."""


def read_meta(path: str | Path) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() and not line.startswith((" ", "#")):
                value = value.strip().strip("'\"")
                meta[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    for key in ("dp_size", "pp_size", "world_size"):
        if not isinstance(meta.get(key), int):
            raise TraceError(f"{path}: no integer {key!r} (is this a trace's meta YAML?)")
    return meta


def read_trace(path: str | Path) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several kinds for a non-Parquet file
        raise TraceError(f"{path}: not a readable Parquet trace ({type(exc).__name__})") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise TraceError(f"{path}: missing columns {missing}")
    try:
        for col in REQUIRED:
            if col != "optype":
                df[col] = pd.to_numeric(df[col], errors="coerce")
        df["optype"] = df["optype"].astype(str)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{path}: columns of the wrong type ({exc})") from None
    bad = df[list(INTEGERS)].isna().any(axis=1) | ~np.isfinite(df["duration"]) | (df["duration"] < 0)
    bad |= ~np.isfinite(df["start_ts"])
    df = df.loc[~bad].reset_index(drop=True)
    if df.empty:
        raise TraceError(f"{path}: no operation with a valid start and duration")
    df[list(INTEGERS)] = df[list(INTEGERS)].astype(np.int64)
    return df


def worker_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (worker, step) in load_run's shape; the worker's global rank is ``rank``."""
    kind = np.where(df["optype"] == "forward-compute", "forward_s",
           np.where(df["optype"] == "backward-compute", "backward_s",
           np.where(df["optype"] == "optimizer", "optimizer_s", "allreduce_wait_s")))  # fmt: skip
    parts = df.assign(kind=kind).pivot_table(index=["rank", "step"], columns="kind", values="duration", aggfunc="sum")
    span = df.assign(end=df["start_ts"] + df["duration"]).groupby(["rank", "step"]).agg(
        start=("start_ts", "min"), end=("end", "max"))  # fmt: skip
    frame = parts.reindex(columns=["forward_s", "backward_s", "optimizer_s", "allreduce_wait_s"]).fillna(0.0)
    frame["data_wait_s"] = 0.0
    frame["step_s"] = (span["end"] - span["start"]).reindex(frame.index)
    frame["busy_s"] = frame["forward_s"] + frame["backward_s"] + frame["optimizer_s"]
    # batched sends and receives overlap: communication and waiting are the rest of the span, all of
    # it collectives of every kind (pipeline p2p, data-parallel gathers and reductions), none DDP's
    frame["comm_wait_s"] = (frame["step_s"] - frame["busy_s"]).clip(lower=0.0)
    frame["collective_wait_s"] = frame["comm_wait_s"]
    frame["allreduce_wait_s"] = frame["eval_s"] = frame["other_s"] = 0.0
    return frame.reset_index()


class Replay:
    """Every step's graph and duration vectors, for repeated what-if replays."""

    def __init__(self, df: pd.DataFrame, pp: int):
        self.steps = []
        for _, g in df.groupby("step", sort=True):
            g = g.sort_values(["dp_rank", "stage", "start_ts", "optype"], kind="stable").reset_index(drop=True)
            comp = g["optype"].isin(COMPUTE).to_numpy()
            real = g["duration"].to_numpy()
            typical = g.groupby("optype")["duration"].transform("mean").to_numpy()
            transfer = g.groupby("optype")["duration"].transform("min").to_numpy()
            # every pipeline receive may include waiting (a stage always waits for its neighbour's
            # backward): the transfer time of an activation is the fastest p2p op of the step
            p2p = g["optype"].isin(P2P_OPS).to_numpy()
            if p2p.any():
                transfer = np.where(p2p, g.loc[p2p, "duration"].min(), transfer)
            ideal = np.where(comp, typical, transfer)
            self.steps.append((g, build_graph(g, pp), comp, real, ideal))

    def total(self, real_where: Any = None) -> float:
        """Sum of step spans with compute real where ``real_where(step_frame)`` is True (all if None)."""
        out = 0.0
        for g, graph, comp, real, ideal in self.steps:
            mask = comp if real_where is None else comp & real_where(g)
            out += makespan(graph, np.where(mask, real, ideal))
        return out

    def ideal(self) -> float:
        return self.total(lambda g: np.zeros(len(g), dtype=bool))


def within_stage_spread(df: pd.DataFrame) -> tuple[float, float]:
    """Median over (step, stage) of the slowest worker's compute over the stage median, and how often
    the slowest worker of a stage is the same one (1.0: always the same)."""
    c = df[df["optype"].isin(COMPUTE)].groupby(["step", "stage", "dp_rank"])["duration"].sum().reset_index()
    per = c.groupby(["step", "stage"])["duration"]
    ratio = float((per.max() / per.median()).median())
    top = c.loc[c.groupby(["step", "stage"])["duration"].idxmax()]
    same = float(top.groupby("stage")["dp_rank"].agg(lambda s: s.value_counts(normalize=True).iloc[0]).max())
    return ratio, same


def analyze_trace(trace: str | Path, meta_path: str | Path, top_workers: int = 6) -> Analysis:
    meta, df = read_meta(meta_path), read_trace(trace)
    pp = int(meta["pp_size"])
    frame = worker_frame(df)
    mat = to_matrix(frame)
    stages = df.groupby("rank")["stage"].first()
    groups = {int(r): f"stage{int(s)}" for r, s in stages.items()}
    verdict = detect(mat, DetectConfig(window=8, confirm=3), groups=groups)
    report = build_report(mat, verdict, {"run_id": Path(trace).stem, "world_size": int(meta["world_size"])}, {})
    for row in report["ranks"]:
        row["role"] = groups.get(row["rank"])
    replay = Replay(df, pp)
    t_real, t_ideal = float(replay.total()), float(replay.ideal())
    s_job = t_real / t_ideal if t_ideal > 0 else 1.0

    def share(mask_fn: Any) -> float:
        return float(replay.total(mask_fn) / t_ideal) if t_ideal > 0 else 1.0

    excess = (df[df["optype"].isin(COMPUTE)].assign(
        typ=lambda d: d.groupby(["step", "optype"])["duration"].transform("median"))
        .assign(ex=lambda d: d["duration"] - d["typ"]).groupby(["dp_rank", "stage"])["ex"].sum()
        .sort_values(ascending=False))  # fmt: skip
    workers = []
    for dp, st in excess.index[:top_workers]:
        s = share(lambda g, dp=dp, st=st: ((g["dp_rank"] == dp) & (g["stage"] == st)).to_numpy())
        rank = int(df.loc[(df["dp_rank"] == dp) & (df["stage"] == st), "rank"].iloc[0])
        workers.append({"dp_rank": int(dp), "stage": int(st), "rank": rank, "slowdown": round(s, 4)})
    stage_rows = [{"stage": int(st), "slowdown": round(share(lambda g, st=st: (g["stage"] == st).to_numpy()), 4)}
                  for st in sorted(df["stage"].unique())]  # fmt: skip
    op_rows = [{"optype": o, "slowdown": round(share(lambda g, o=o: (g["optype"] == o).to_numpy()), 4)}
               for o in COMPUTE if (df["optype"] == o).any()]  # fmt: skip
    spread, same = within_stage_spread(df)
    gain = s_job - 1.0
    ranked = sorted((w["slowdown"] - 1.0 for w in workers), reverse=True) + [0.0, 0.0]
    best_stage = max(stage_rows, key=lambda s: s["slowdown"])
    if gain > 0 and ranked[0] >= 0.6 * gain and ranked[1] < 0.3 * gain:
        kind = "single worker"  # one worker explains S and no other one does
    elif spread > 1.15 and same < 0.5:
        kind = "random imbalance"
    elif gain > 0 and best_stage["slowdown"] - 1.0 >= 0.5 * gain:
        kind = "stage imbalance"
    else:
        kind = "random imbalance" if spread > 1.15 else "balanced"
    lost = t_real - t_ideal
    layout = {k: meta.get(k) for k in ("dp_size", "pp_size", "tp_size", "vpp_size", "world_size")}
    imbalance = [s for s in stage_rows if s["slowdown"] - 1.0 >= max(0.05, 0.25 * gain)]
    report.update(
        job_seconds=round(t_real, 4),
        ideal_seconds=round(t_ideal, 4),
        job_slowdown=round(s_job, 4),
        lost_seconds=round(lost, 4),
        lost_gpu_seconds=round(lost * int(meta["world_size"]), 3),
        trace={
            "path": str(trace),
            "layout": layout,
            "ops": len(df),
            "workers": int(df.groupby(["dp_rank", "stage"]).ngroups),
        },  # fmt: skip
        whatif_verdict=kind,
        stage_imbalance=imbalance if kind != "single worker" else [],
        attribution={"workers": workers, "stages": stage_rows, "optypes": op_rows},
        within_stage_spread={"slowest_over_median": round(spread, 3), "same_slowest_worker_share": round(same, 3)},
    )
    return Analysis(report, mat, verdict)
