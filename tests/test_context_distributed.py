"""A real CPU-contention straggler: a 2-rank gloo job with each rank pinned to its own core, and a
few busy processes pinned to rank 1's core from some step on. There are several, each in its own
session: torchrun starts each rank in a session of its own, and where the kernel groups the tasks
of a session for scheduling (autogroup) a CPU is shared equally between sessions whatever the
tasks' priorities; so rank 1 gets a fifth of its core, while other load on this machine, which the
scheduler then moves to rank 0's core, takes at most about half of that one. Rank 1 must be flagged (cause compute),
and its context must say why: its CPU was contended (its training thread waited for the CPU,
was switched out involuntarily), where rank 0's was not; and what to try: the other processes on
its CPU. (Extra work with no contention, where nothing may be named: ``test_context_extra_work.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import EXAMPLE, ROOT, wait_for

import stragglerwatch
from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.presentation.render import render_text

pytestmark = pytest.mark.distributed
CPU_SIGNALS = {"run_delay", "invol_switches", "others_cpu", "cpu_pressure"}
#: The busy process: a Python loop that spins until killed, 90 s at most.
SPIN = "import time\nend = time.monotonic() + 90\nwhile time.monotonic() < end:\n    sum(range(10000))\n"


def contend(cpu: int, n: int = 4) -> list[subprocess.Popen]:
    """``n`` busy processes pinned to ``cpu``, each in a session of its own."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(n)]
    for spinner in spinners:
        os.sched_setaffinity(spinner.pid, {cpu})
    return spinners


def steps_of(run: Path, rank: int) -> int:
    with warnings.catch_warnings():  # the log is being written: missing ranks and cut batches are normal
        warnings.simplefilter("ignore")
        try:
            df = stragglerwatch.load_run(run, columns=["step"])
        except stragglerwatch.RunDirError:
            return 0
    return int((df["rank"] == rank).sum())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin to")  # fmt: skip
def test_cpu_contention_is_named_for_the_contended_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
         "--steps", "250", "--hidden", "1024", "--batch-size", "128", "--pin-cpus", f"{cpus[0]},{cpus[1]}",
         "--run-dir", str(run)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    spinners: list[subprocess.Popen] = []
    try:
        wait_for(lambda: steps_of(run, 1) >= 100 or job.poll() is not None, 120, "rank 1 to reach step 100")
        assert job.poll() is None, "the job ended before the contention began"
        spinners = contend(cpus[1])
        contended_at = time.time()
        started = time.monotonic()
        _, err = job.communicate(timeout=180)
        assert job.returncode == 0, err[-3000:]
        assert time.monotonic() - started > 5, "contended for a few context samples"
    finally:
        for proc in (*spinners, job):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    report = analyze_run(run).report
    print(render_text(report))
    # the contention's first step, from the step log's clock (the log itself is up to a second behind)
    df = stragglerwatch.load_run(run)
    onset = int(df[(df["rank"] == 1) & (df["start_time"] >= contended_at)]["step"].min())
    # before the contention this shared machine's other load may make either rank briefly slower (a
    # flag on rank 0 then ends where rank 1 becomes the slow one, give or take the few steps of an end's
    # estimate); from it on only rank 1 is flagged
    late = [s for s in report["stragglers"] if s["last_step"] is None or s["last_step"] > onset + 3]
    assert [s["rank"] for s in late] == [1], report["stragglers"]
    (straggler,) = late
    assert straggler["last_step"] is None and straggler["cause"] == "compute" and straggler["slowdown"] > 1.5
    named = {f["signal"] for f in straggler["context"]}
    assert named & {"run_delay", "invol_switches"}, straggler["context"]
    assert named <= CPU_SIGNALS, "only what differs: nothing of GPUs, memory or swap"
    # what to try follows from who took its CPU: the busy processes on its core, not its own threads
    assert any(h.startswith("other processes used ") for h in straggler["hints"]), straggler["hints"]
