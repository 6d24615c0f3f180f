"""Import op-level traces of hybrid-parallel jobs (the OSDI'25 what-if artifact's format) and
analyse them with the same report as a run dir, plus the what-if job slowdown and its attribution.

A trace has one row per op per worker: ``dp_rank``, ``stage``, ``rank``, ``step``, ``optype``,
``start_ts``, ``duration``, ``seq_id`` (and ``mc``, ``gmc``, ``mb_id``); its meta YAML gives
``dp_size``, ``pp_size``, ``tp_size``, ``world_size`` (and ``dsp_size``). What is read:
- per worker and step, the step anatomy: forward and backward compute summed over micro-batches,
  optimizer, communication (its recorded time, waiting included) and the step span; ``busy`` is the
  compute, which is what is compared between the workers of one pipeline stage (the peer group);
- the what-if analysis (``whatif.py`` on the dependency model of ``whatif_deps.py``) of all complete
  steps: ``S``, its attribution to dp ranks, stages, workers and op types, M_W and M_S, the verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.analysis.detect import detect, to_matrix
from stragglerwatch.analysis.report import Analysis, RankFigures, build_report
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.evidence.whatif import DECOMPOSE_THRESHOLD, MAJORITY, TOP_WORKER_SHARE, WhatIf, analyze
from stragglerwatch.evidence.whatif_deps import DP_COMM, ModelError, build_grid, build_model

COMPUTE = ("forward-compute", "backward-compute", "optimizer")

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
    bad = df[list(INTEGERS)].isna().any(axis=1) | (df[list(INTEGERS)] < 0).any(axis=1)
    bad |= ~np.isfinite(df["duration"]) | (df["duration"] < 0)
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


def within_stage_spread(df: pd.DataFrame) -> tuple[float, float]:
    """Median over (step, stage) of the slowest worker's compute over the stage median, and how often
    the slowest worker of a stage is the same one (1.0: always the same)."""
    c = df[df["optype"].isin(COMPUTE)].groupby(["step", "stage", "dp_rank"])["duration"].sum().reset_index()
    per = c.groupby(["step", "stage"])["duration"]
    ratio = float((per.max() / per.median()).median())
    top = c.loc[c.groupby(["step", "stage"])["duration"].idxmax()]
    same = float(top.groupby("stage")["dp_rank"].agg(lambda s: s.value_counts(normalize=True).iloc[0]).max())
    return ratio, same


def whatif_model(df: pd.DataFrame, meta: dict[str, Any]) -> WhatIf:
    """The grid, dependency model and durations of a trace's what-if replay; ModelError if it does not fit."""
    dp, pp = int(df["dp_rank"].max()) + 1, int(df["stage"].max()) + 1
    if pp != meta["pp_size"] or dp > meta["dp_size"]:
        raise ModelError(f"the trace has {pp} stages and {dp} dp ranks, the meta pp_size={meta['pp_size']} "
                         f"and dp_size={meta['dp_size']}")  # fmt: skip
    dsp = meta.get("dsp_size", 1)
    use_dp = dp * (dsp if isinstance(dsp, int) and dsp > 0 else 1) > 1
    grid = build_grid(df if use_dp else df[~df["optype"].isin(DP_COMM)], dp, pp)  # no dp collectives to replay
    return WhatIf(grid, build_model(grid, use_dp))


def whatif_report(whatif: WhatIf, df: pd.DataFrame, top_workers: int) -> dict[str, Any]:
    """The report keys of the what-if analysis (``job_slowdown``, ``attribution``, ``whatif_verdict``, ...)."""
    ranks = {(int(d), int(s)): int(r) for (d, s), r in df.groupby(["dp_rank", "stage"])["rank"].first().items()}
    res = analyze(whatif, ranks)
    sec = res["seconds"]
    workers = [{"dp_rank": d, "stage": s, "rank": r, "slowdown": round(v, 4), "dp_slowdown": round(res["dp"][d], 4),
                "stage_slowdown": round(res["stage"][s], 4)} for d, s, r, v in res["scores"][:top_workers]]  # fmt: skip
    stages = [{"stage": s, "slowdown": round(v, 4)} for s, v in res["stage"].items()]
    optypes = sorted(({"optype": o, "slowdown": round(v, 4)} for o, v in res["optype"].items()),
                     key=lambda o: -o["slowdown"])  # fmt: skip
    dp_ranks = sorted(({"dp_rank": d, "slowdown": round(v, 4)} for d, v in res["dp"].items()),
                      key=lambda o: -o["slowdown"])  # fmt: skip
    lost = sec["real"] - sec["ideal"]
    kind = res["verdict"]
    spread, same = within_stage_spread(df)
    grid = whatif.grid
    return {
        "job_seconds": round(sec["real"], 4),
        "ideal_seconds": round(sec["ideal"], 4),
        "job_slowdown": round(res["S"], 4),
        "lost_seconds": round(lost, 4),
        "whatif_verdict": kind,
        "stage_imbalance": [s for s in stages if s["stage"] in res["hot_stages"]] if kind == "stage imbalance" else [],
        "attribution": {"workers": workers, "stages": stages, "optypes": optypes, "dp_ranks": dp_ranks},
        "within_stage_spread": {"slowest_over_median": round(spread, 3), "same_slowest_worker_share": round(same, 3)},
        "whatif": {
            "steps": len(grid.steps),
            "skipped_steps": grid.skipped_steps,
            "recorded_seconds": round(sec["recorded"], 4),
            "replay_with_launch_delays_seconds": round(sec["real_with_delays"], 4),
            "launch_slowdown": round(sec["recorded"] / sec["real"], 4) if sec["real"] > 0 else None,
            "M_W": round(res["M_W"], 4),
            "M_W_ranks": sorted(ranks[w] for w in res["M_W_workers"]),
            "M_S": round(res["M_S"], 4),
            "hot_stages": res["hot_stages"],
            "every_dp_rank_hot": res["every_dp_rank_hot"],
            "hot_stage_share": None if res["hot_stage_share"] is None else round(res["hot_stage_share"], 4),
            "unmodelled_optypes": sorted(set(df["optype"]) - set(grid.nodes["optype"])),
            "noop_p2p_ops": whatif.model.noops,
            "thresholds": {
                "decompose": DECOMPOSE_THRESHOLD,
                "top_worker_share": TOP_WORKER_SHARE,
                "majority": MAJORITY,
            },
        },
    }


def analyze_trace(trace: str | Path, meta_path: str | Path, top_workers: int = 6) -> Analysis:
    meta, df = read_meta(meta_path), read_trace(trace)
    try:
        whatif = whatif_model(df, meta)
        what = whatif_report(whatif, df, top_workers)
    except ModelError as exc:
        raise TraceError(f"{trace}: cannot replay it: {exc}") from None
    frame = worker_frame(df)
    mat = to_matrix(frame)
    stages = df.groupby("rank")["stage"].first()
    groups = {int(r): f"stage{int(s)}" for r, s in stages.items()}
    verdict = detect(mat, DetectConfig(window=8, confirm=3), groups=groups)
    run_meta = {"run_id": Path(trace).stem, "world_size": int(meta["world_size"])}
    report = build_report(RankFigures.of(mat, verdict), verdict, run_meta, {}).to_dict()
    for row in report["ranks"]:
        row["role"] = groups.get(row["rank"])
    layout = {k: meta.get(k) for k in ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")}
    report.update(
        what,
        lost_gpu_seconds=round(what["lost_seconds"] * int(meta["world_size"]), 3),
        trace={
            "path": str(trace),
            "layout": layout,
            "ops": len(df),
            "workers": int(df.groupby(["dp_rank", "stage"]).ngroups),
        },
    )
    return Analysis(report, mat, verdict)
