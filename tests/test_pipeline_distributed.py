"""Real ``torch.distributed.pipelining`` jobs on gloo (``tests/workers/frameworks.py --framework pipeline``):
two stages on the ``pp`` dimension of a mesh, GPipe and 1F1B, FSDP2 per stage or a plain gradient
all-reduce, instrumented as the docs say (``attach(stage_module)``, the role found by attach). A rank that
holds the pipeline is flagged with its cause, its excess and what fixing it saves near what was injected;
a stage heavier by design is not a straggler, its time is lost to unequal peer groups; the bubble and
the sends and receives are exposed communication, not compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_frameworks_distributed import report, run_job

from stragglerwatch.presentation.render import render_text

pytestmark = pytest.mark.distributed
MICRO = 4  # micro-batches a step
ONSET = 8  # the worker's default --from-step


def roles(run: Path, world: int) -> list[str | None]:
    return [json.loads((run / f"rank-{r:05d}.json").read_text()).get("role") for r in range(world)]


def near(value: float, expected: float, tolerance: float = 0.35) -> bool:
    return abs(value - expected) <= tolerance * expected


def test_gpipe_fsdp2_per_stage_compute_straggler_costed_as_holding_the_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dp=2 x pp=2, FSDP2 per stage, no role given: the mesh gives each rank its stage. Rank 3 (stage 1 of
    replica 1) sleeps 5 ms in each micro-batch (a third in the forward, the rest in the backward): 20 ms a step,
    which the whole job waits for."""
    delay, steps = 0.005, 40
    run, df = run_job(tmp_path, "pipeline", "--stage-fsdp", "--microbatches", str(MICRO), "--slow-rank", "3",
                      "--cause", "compute", "--delay", str(delay), nproc=4, steps=steps)  # fmt: skip
    assert roles(run, 4) == ["pp=0", "pp=1", "pp=0", "pp=1"]
    r = report(run, capsys)
    assert [(s["rank"], s["cause"]) for s in r["stragglers"]] == [(3, "compute")], r["stragglers"]
    (s,) = r["stragglers"]
    injected = delay * MICRO
    assert abs(s["first_step"] - ONSET) <= 4, s
    assert near(s["excess_ms"]["compute"] * 1e-3, injected), s["excess_ms"]
    for cost in ("saves_seconds", "lost_seconds"):  # what fixing it saves, and its cost: the pipeline it holds
        assert near(s[cost], injected * (steps - ONSET), 0.4), (cost, s[cost], injected)
    assert r["lost_split"]["stragglers"] == pytest.approx(s["saves_seconds"], rel=1e-3)
    # its pipeline partner (rank 2) waits for it in the pipeline's receives: communication, not compute
    med = df[df["step"] >= ONSET + 4].groupby("rank")[["busy_s", "collective_wait_s"]].median()
    assert med.loc[2, "collective_wait_s"] > 0.6 * injected
    assert abs(med.loc[2, "busy_s"] - med.loc[0, "busy_s"]) < 0.3 * injected, "as busy as its stage's other rank"


def test_1f1b_data_straggler_on_the_first_stage_beside_a_heavier_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dp=2 x pp=2, 1F1B, a plain gradient all-reduce on dp (no mesh in the model): the role comes from the
    PipelineStage, built after attach here. Stage 1 is 3 ms a micro-batch heavier by design; rank 2 (stage 0)
    waits 20 ms a batch for its data."""
    delay = 0.02
    run, df = run_job(tmp_path, "pipeline", "--schedule", "1f1b", "--attach-first", "--microbatches", str(MICRO),
                      "--heavy-stage", "1",
                      "--slow-rank", "2", "--cause", "data", "--delay", str(delay), nproc=4, steps=40)  # fmt: skip
    assert roles(run, 4) == ["pp=0", "pp=1", "pp=0", "pp=1"]
    r = report(run, capsys)
    assert [(s["rank"], s["cause"]) for s in r["stragglers"]] == [(2, "data")], r["stragglers"]
    (s,) = r["stragglers"]
    assert abs(s["first_step"] - ONSET) <= 4 and near(s["excess_ms"]["data"] * 1e-3, delay), s
    # a rank of the lighter stage holds its pipeline by its whole excess, though the heavier stage's ranks are
    # as busy as it: costed within its stage
    for cost in ("saves_seconds", "lost_seconds"):
        assert near(s[cost], delay * (40 - ONSET), 0.4), (cost, s[cost])
    assert [g["group"] for g in r["group_imbalance"]] == ["pp=1"], "the heavier stage, not a straggler"
    assert r["lost_split"]["groups"] > 0


def test_a_pipeline_of_one_rank_a_stage_says_what_it_cannot_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pp=2 alone (each stage one rank), roles given by hand: no rank has a peer. Nothing is flagged, the
    report says why, and the heavier stage's time is lost to unequal groups, not to jitter. Stage 0 waits for
    stage 1 (the bubble and the receives): exposed communication, not busy time."""
    heavy = 0.003
    run, df = run_job(tmp_path, "pipeline", "--microbatches", str(MICRO), "--heavy-stage", "1",
                      "--heavy-ms", str(heavy * 1e3), "--role", "stage{stage}", nproc=2, steps=30)  # fmt: skip
    assert roles(run, 2) == ["stage0", "stage1"], "role= overrides what attach would find"
    r = report(run, capsys)
    assert r["stragglers"] == [] and r["unpaired"] == [0, 1]
    assert "not compared: ranks 0 (stage0), 1 (stage1), each alone in its peer group" in " ".join(
        render_text(r).split())
    assert r["lost_split"]["groups"] > r["lost_split"]["jitter"]
    med = df[df["step"] >= 4].groupby("rank")[["busy_s", "collective_wait_s"]].median()
    assert med.loc[0, "collective_wait_s"] > 0.6 * heavy * MICRO, "stage 0 waits for the heavier stage"
    assert med.loc[1, "busy_s"] - med.loc[0, "busy_s"] > 0.6 * heavy * MICRO, "and that wait is not its busy time"
