"""Extra work is no contention: a real 2-rank gloo job, each rank pinned to its own core, in which
rank 1 multiplies matrices in every forward from step 50 on (``tests/workers/extra_work.py``) and
nothing else runs on its core. Rank 1 must be flagged (cause compute) with no host signal named: it
runs more CPU time, so it is switched out more often per second and waits for its CPU more per
second than its peers, but per CPU-second it ran it does not, and no other process took its CPU.
(The contended counterpart, where a signal must be named: ``test_context_distributed.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, launch

import stragglerwatch
from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.presentation.render import render_text

pytestmark = pytest.mark.distributed
WORKER = ROOT / "tests" / "workers" / "extra_work.py"
ONSET = 50


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin to")  # fmt: skip
def test_extra_work_names_no_context_signal(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    launch(2, WORKER, "--run-dir", str(run), "--steps", "600", "--from-step", str(ONSET), "--matmuls", "60",
           "--pin-cpus", f"{cpus[0]},{cpus[1]}", timeout_s=240)  # fmt: skip
    report = analyze_run(run).report
    print(render_text(report))
    # before the extra work this shared machine's other load may make either rank briefly slower
    late = [s for s in report["stragglers"] if s["last_step"] is None or s["last_step"] > ONSET + 3]
    assert [(s["rank"], s["cause"]) for s in late] == [(1, "compute")], render_text(report)
    (straggler,) = late
    assert straggler["slowdown"] > 2 and straggler["last_step"] is None
    ctx = stragglerwatch.load_context(run)
    inside = ctx[(ctx["time"] > straggler["time_span"][0]) & (ctx["time"] <= straggler["time_span"][1])]
    busy = inside.groupby("rank")["cpu_time"].median()
    assert busy[1] > 2 * busy[0], "the extra work runs: rank 1 used more CPU time than its peer"
    assert straggler["context"] == [], "its own extra work is no cause"
    assert straggler["hints"] == [], "nothing measured to act on: no advice"
