"""Real multi-process DDP on CPU (gloo) under torchrun: the timeline's numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, launch, read_json, wait_for

import stragglerwatch
from stragglerwatch.record.schema import PHASE_COLUMNS

pytestmark = pytest.mark.distributed
EXAMPLE = ROOT / "examples" / "train_ddp.py"
MS = 1e-3


def medians(df: pd.DataFrame, from_step: int = 0) -> pd.DataFrame:
    return df[df["step"] >= from_step].groupby("rank").median(numeric_only=True)


def assert_phases_partition_steps(df: pd.DataFrame) -> None:
    parts = df[list(PHASE_COLUMNS)].sum(axis=1)
    assert (df[list(PHASE_COLUMNS)] >= 0).all().all()
    assert (parts - df["step_s"]).abs().max() < 1e-9, "phases must add up to the step (no double counting)"


@pytest.fixture(scope="module")
def compute_straggler(compute_run: Path) -> pd.DataFrame:
    return stragglerwatch.load_run(compute_run)


def test_compute_straggler_is_busy_not_slow(compute_straggler: pd.DataFrame) -> None:
    df = compute_straggler
    assert set(df["rank"]) == {0, 1, 2, 3}
    assert df.groupby("rank")["step"].agg(list).map(lambda s: s == list(range(60))).all(), "each step once per rank"
    assert_phases_partition_steps(df)
    assert df["bucket_index"].map(len).eq(0).all(), "no comm hook unless bucket_timings"
    med = medians(df, from_step=12)
    peers = med.drop(index=2)
    # the straggler's busy time stands out by about the injected 20 ms ...
    assert med.loc[2, "busy_s"] - peers["busy_s"].max() > 12 * MS
    compute = med["forward_s"] + med["backward_s"]
    assert compute.loc[2] - compute.drop(index=2).max() > 12 * MS
    # ... while it waits least in communication ...
    assert med.loc[2, "comm_wait_s"] < peers["comm_wait_s"].min()
    # ... and every rank's step time is the same (the barrier)
    total = df[df["step"] >= 1].groupby("rank")["step_s"].sum()
    assert (total.max() - total.min()) / total.median() < 0.03
    # before the onset nobody stands out
    early = medians(df[df["step"] < 10], from_step=1)
    assert early["busy_s"].max() - early["busy_s"].min() < 8 * MS


def test_bucket_timings_recorded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launch(
        2, EXAMPLE, "--steps", "30", "--slow-rank", "1", "--delay", "0.02", "--bucket-timings", "--run-dir", str(run)
    )
    df = stragglerwatch.load_run(run)
    assert_phases_partition_steps(df)
    med = medians(df, from_step=2)
    assert med.loc[1, "busy_s"] - med.loc[0, "busy_s"] > 12 * MS
    assert df["bucket_index"].map(len).min() >= 1
    ready = df["bucket_ready_s"].explode().astype(float)
    allreduce = df["bucket_allreduce_s"].explode().astype(float)
    assert (ready > 0).all() and (allreduce >= 0).all()
    # peers' last bucket waits for the straggler's: longer all-reduce than the straggler's own
    last = df.assign(ar=df["bucket_allreduce_s"].map(lambda v: v[-1]))
    ar = last[last["step"] >= 2].groupby("rank")["ar"].median()
    assert ar.loc[1] < ar.loc[0]


def test_data_straggler_shows_in_data_wait(data_run: Path) -> None:
    df = stragglerwatch.load_run(data_run)
    assert_phases_partition_steps(df)
    med = medians(df, from_step=17)
    peers = med.drop(index=1)
    assert med.loc[1, "data_wait_s"] - peers["data_wait_s"].max() > 15 * MS
    assert med.loc[1, "busy_s"] - peers["busy_s"].max() > 12 * MS
    assert med.loc[1, "comm_wait_s"] < peers["comm_wait_s"].min()
    # the example's model has buffers: peers wait for the late rank in forward's buffer broadcast (those
    # gloo's broadcast tree does not let through to the all-reduce), and that wait is not forward
    assert peers["collective_wait_s"].max() > 10 * MS and peers["forward_s"].max() < 8 * MS


def test_data_straggler_without_wrapped_loader(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launch(
        2,
        EXAMPLE,
        "--steps",
        "20",
        "--slow-rank",
        "0",
        "--delay",
        "0.02",
        "--cause",
        "data",
        "--no-wrap",
        "--run-dir",
        str(run),
    )
    med = medians(stragglerwatch.load_run(run), from_step=2)
    assert med.loc[0, "data_wait_s"] - med.loc[1, "data_wait_s"] > 15 * MS


def test_no_sync_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launch(2, EXAMPLE, "--steps", "8", "--accum", "4", "--bucket-timings", "--run-dir", str(run))
    df = stragglerwatch.load_run(run)
    assert df.groupby("rank")["step"].agg(list).map(lambda s: s == list(range(8))).all()
    assert (df["micro_batches"] == 4).all()
    assert_phases_partition_steps(df)
    # each bucket is all-reduced once per optimizer step (after the last micro-batch),
    # never for the no_sync() micro-batches (DDP rebuilds its buckets after step 0)
    buckets = df["bucket_index"].map(list)
    assert buckets.map(len).min() >= 1
    assert buckets.map(lambda b: len(b) == len(set(b))).all()


def test_close_removes_hooks_and_conflicts_are_clear(tmp_path: Path) -> None:
    launch(2, ROOT / "tests" / "workers" / "hooks_worker.py", str(tmp_path), env={"STRAGGLERWATCH_RUN_DIR": ""})
    r0, r1 = (read_json(tmp_path / f"result-{r}.json") for r in (0, 1))
    for r in (r0, r1):
        assert r["hooks_after_close"] == r["hooks_before"] != r["hooks_attached"]
        assert r["rows_after_close"] == 3
        assert r["existing_hook_rows"] == 2
        assert "already has one" in r["conflict"] and "comm_hook=" in r["conflict"]
        assert r["user_hook_calls"] >= 3 and all(n >= 1 for n in r["composed_buckets"])
    assert r0["agreed_run_dir"] == r1["agreed_run_dir"]
    assert r0["agreed_run_dir"].startswith("stragglerwatch-runs/")


def test_sigkill_leaves_a_readable_log_up_to_the_flush_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--steps",
        "100000",
        "--slow-rank",
        "1",
        "--delay",
        "0.01",
        "--run-dir",
        str(run),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        log = run / "rank-00001.arrows"
        wait_for(lambda: log.exists() and log.stat().st_size > 0, 60, "rank 1 to flush its first steps")
        time.sleep(3.0)
        pid = read_json(run / "rank-00001.json")["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    df = stragglerwatch.load_run(run)  # both ranks died mid-run; no exception
    r1 = df[df["rank"] == 1]
    assert r1["step"].tolist() == list(range(len(r1))), "no gap, no corruption"
    last_end = (r1["start_time"] + r1["step_s"]).max()
    assert last_end >= killed_at - 2.0 - 0.5, f"steps older than the flush interval lost ({killed_at - last_end:.2f} s)"
    assert_phases_partition_steps(df)
