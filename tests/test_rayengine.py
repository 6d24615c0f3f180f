"""``analyze --engine ray``: the same report as the local engine, on a real local Ray (2 CPUs).

The run is cut into several rank blocks and step parts (the record limits are lowered for the
test), and it has what real runs have: a restart, a rank with missing steps, peer groups, a
straggler that ends and one that does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stragglerwatch.analysis import consistency, rayengine, workfit
from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.record.simulate import Injection, SimConfig, write_run

ray = pytest.importorskip("ray", reason="the Ray engine's tests need ray (stragglerwatch[ray])")


@pytest.fixture(scope="module")
def cluster():
    import psutil

    before = {c.pid for c in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ours = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    # ray.shutdown() returns while the cluster's processes are still exiting; on two cores their exit
    # would compete with the next test's job (a 2-rank job's timing, right after, was off by that)
    _, alive = psutil.wait_procs(ours, timeout=30)
    for proc in alive:
        proc.kill()


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    cfg = SimConfig(ranks=24, steps=500, groups=2, seed=11,
                    injections=[Injection(3, 0.15, 150, "data"), Injection(17, 0.25, 200, "compute", 380)])  # fmt: skip
    write_run(run, cfg)
    # a rank missing 40 steps, and a second attempt (torchrun restarted the job) of rank 5
    t = pq.read_table(run / "rank-00009.parquet")
    steps = t["step"].to_numpy()
    pq.write_table(t.filter(pa.array((steps < 100) | (steps >= 140))), run / "rank-00009.parquet")
    t = pq.read_table(run / "rank-00005.parquet").slice(0, 60)
    restart = pa.array(np.ones(t.num_rows, dtype=np.int32))
    pq.write_table(t.set_column(t.schema.get_field_index("restart"), t.schema.field("restart"), restart),
                   run / "rank-00005.1.parquet")  # fmt: skip
    # ... an elastic one: the job re-formed with rank 5 alone, another world (every rank's series is cut there)
    meta = json.loads((run / "rank-00005.json").read_text())
    meta["attempts"] = [{"restart": 0, "attach": 0, "host": meta["host"], "local_rank": 5, "world_size": 24},
                        {"restart": 1, "attach": 0, "host": meta["host"], "local_rank": 0, "world_size": 1}]
    (run / "rank-00005.json").write_text(json.dumps(meta))
    return run


def _report(analysis) -> dict:
    report = json.loads(json.dumps(analysis.report))
    report.pop("run_dir")
    return report


def test_ray_gives_the_local_report(tmp_path, cluster, monkeypatch):
    monkeypatch.setattr(consistency, "BLOCK_RECORDS", 500 * 7)  # 4 rank blocks
    monkeypatch.setattr(rayengine, "PART_RECORDS", 24 * 90)  # 7 step parts
    run = _run(tmp_path)
    assert len(consistency.rank_blocks(24, 560)) == 4
    local = _report(analyze_run(run))
    assert [(s["rank"], s["cause"]) for s in local["stragglers"]] == [(17, "compute"), (3, "data")]
    assert len(local["attempts"]) == 2 and local["ranks"][9]["steps"] < local["ranks"][8]["steps"]
    assert [(a["world"], a["world_size"]) for a in local["attempts"]] == [(0, 24), (1, 1)]
    assert all(s["attempt"] == 0 for s in local["stragglers"]), "rank 3's flag does not run on where it left"
    on_ray = _report(rayengine.analyze_on_ray(run, address=cluster))
    assert on_ray == local


@pytest.mark.parametrize("mode", ["variable", "static"])
def test_ray_gives_the_local_report_on_variable_work(tmp_path, cluster, monkeypatch, mode):
    """Work recorded per step (tokens): the work fit, the adjusted detection and the imbalance verdict run in
    rounds over the same slices on both engines (a compute straggler hidden in heavy batches, a data one,
    and a hang: the same report, key for key)."""
    monkeypatch.setattr(consistency, "BLOCK_RECORDS", 400 * 5)  # 4 rank blocks
    monkeypatch.setattr(rayengine, "PART_RECORDS", 16 * 70)  # 6 step parts
    monkeypatch.setattr(workfit, "FIT_STEPS", 150)  # the fit takes every 3rd step: parts of 70 cut across them
    run = tmp_path / "run"
    slow = [Injection(6, 0.2, 150, "compute"), Injection(11, 0.2, 100, "data")]
    write_run(run, SimConfig(ranks=16, steps=400, seed=5, tokens=4096, token_mode=mode, heavy_rank=2, injections=slow))
    # and a hang at step 300: rank 9 stuck in its forward, the others waiting in the allreduce for it
    for r in range(16):
        phase = "forward" if r == 9 else "allreduce_wait"
        stall = {"kind": "stall", "rank": r, "step": 300, "phase": phase, "detected_at": 1.7e9 + r * 0.01,
                 "waited_s": 30.0, "threshold_s": 30.0, "id": f"{r}-300", "stall_id": f"{r}-300"}  # fmt: skip
        (run / f"events-{r:05d}.jsonl").write_text(json.dumps(stall) + "\n")
    local = _report(analyze_run(run))
    assert [h["culprit_ranks"] for h in local["hangs"]] == [[9]]
    assert sorted((s["rank"], s["cause"]) for s in local["stragglers"]) == [(6, "compute"), (11, "data")]
    im = local["imbalance"]
    assert im is not None and im["detected"] and im["unit"] == "tokens" and im["lost_seconds"] > 0
    assert (im["heaviest_ranks"][:1] == [2]) == (mode == "static")
    on_ray = _report(rayengine.analyze_on_ray(run, address=cluster))
    assert on_ray["imbalance"] == local["imbalance"]
    assert on_ray == local


def _collectives(run: Path, ranks: int, late: int, from_step: int) -> None:
    """``collectives-NNNNN.jsonl`` of tensor-parallel pairs (2k, 2k + 1), two collectives a step; rank ``late``
    enters each 30 ms after its partner from step ``from_step`` on (its partner waits for it)."""
    t = pq.read_table(run / "rank-00000.parquet")
    start, step_s = t["start_time"].to_numpy(), t["step_s"].to_numpy()
    for r in range(ranks):
        rows = []
        for k, (t0, dt) in enumerate(zip(start.tolist(), step_s.tolist(), strict=True)):
            for i, at in enumerate((0.2, 0.6)):
                created = t0 + at * dt + (0.03 if r == late and k >= from_step else 0.0)
                rows.append([0, 2 * k + i + 1, int(created * 1e9), 1, "all_reduce"])
        line = {"groups": [f"tp{r // 2}"], "rows": rows}
        (run / f"collectives-{r:05d}.jsonl").write_text(json.dumps(line) + "\n")


@pytest.mark.parametrize("unseen", [False, True])
def test_ray_gives_the_local_arrival_order(tmp_path, cluster, monkeypatch, unseen):
    """Collectives recorded: the arrival order section, and where a rank said collectives ran unseen (compiled
    code), the busy time less the unseen waits detected again: the same report on both engines."""
    monkeypatch.setattr(consistency, "BLOCK_RECORDS", 300 * 5)  # 4 rank blocks
    monkeypatch.setattr(rayengine, "PART_RECORDS", 16 * 70)  # 5 step parts
    run = tmp_path / "run"
    write_run(run, SimConfig(ranks=16, steps=300, seed=7, injections=[Injection(6, 0.2, 100, "compute")]))
    _collectives(run, 16, late=6, from_step=100)
    if unseen:
        for r in range(16):
            meta = json.loads((run / f"rank-{r:05d}.json").read_text())
            meta["coverage"] = ["compiled regions: collectives inside them are not bracketed"]
            (run / f"rank-{r:05d}.json").write_text(json.dumps(meta))
    local = _report(analyze_run(run))
    arrivals = local["arrivals"]
    assert arrivals["groups_compared"] == 8 and arrivals["busy_adjusted"] == unseen
    last = {x["rank"]: x["last_share"] for x in arrivals["ranks"]}
    assert last[6] > 0.6 > last[7], "rank 6 enters its pair's collectives last from step 100 on"
    assert [s["rank"] for s in local["stragglers"]] == [6]
    on_ray = _report(rayengine.analyze_on_ray(run, address=cluster))
    assert on_ray["arrivals"] == arrivals
    assert on_ray == local


def test_cli_engine_ray_at_an_address(tmp_path, cluster):
    run = tmp_path / "run"
    write_run(run, SimConfig(ranks=8, steps=300, seed=3, injections=[Injection(6, 0.2, 100, "data")]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "stragglerwatch.cli", "analyze", str(run), "--format", "json"]
    local = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    on_ray = subprocess.run([*cmd, "--engine", "ray", "--address", cluster], capture_output=True, text=True,
                            timeout=300, env=env)  # fmt: skip
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]
    assert json.loads(on_ray.stdout)["stragglers"] == json.loads(local.stdout)["stragglers"] != []
    html = subprocess.run([*cmd[:-2], "--format", "html", "--engine", "ray"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert html.returncode == 2 and html.stderr.count("\n") == 1 and "text or json" in html.stderr


def test_unreachable_cluster_is_one_line_in_seconds(tmp_path):
    run = tmp_path / "run"
    write_run(run, SimConfig(ranks=4, steps=50, seed=1))
    cmd = [sys.executable, "-m", "stragglerwatch.cli", "analyze", str(run), "--engine", "ray", "--address",
           "127.0.0.1:9"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot reach a Ray cluster at 127.0.0.1:9" in done.stderr


def test_without_ray_the_engine_says_what_to_install(tmp_path):
    run = tmp_path / "run"
    write_run(run, SimConfig(ranks=4, steps=50, seed=1))
    code = ("import sys; sys.modules['ray'] = None; from stragglerwatch.cli import main; "
            f"sys.exit(main(['analyze', {str(run)!r}, '--engine', 'ray']))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert 'pip install "stragglerwatch[ray]"' in done.stderr
