"""A real elastic job: two torchrun agents (``--nnodes 1:2``, c10d rendezvous on localhost) of 2 ranks
each, one node killed mid-run (agent and workers, as a lost machine), the survivor re-forming with 2 ranks
from its checkpoint into the same run dir (``tests/workers/elastic.py``). The report must say per attempt
its world size, the ranks and the node that left, why it ended and its cost, and name each straggler with
its attempt: rank 3 slow while 4 ranks ran, rank 1 slow once 2 did, rank 1 of the 4-rank attempt healthy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_ports

from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.presentation.render import render_text

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "elastic.py"
DELAY = 0.01  # seconds a slow rank sleeps in each forward
FROM = 10  # ... from this step of its attempt
MARK = 60  # the node is killed once the first attempt has done this step


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                kids.append(int(d))
    return [pid, *[k for c in kids for k in _children(c)]]


def _agent(port: int, hosts_store: bool, run: Path, ckpt: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic-test",
           "--max_restarts", "3", "--monitor_interval", "0.5",
           "--rdzv_conf", f"is_host={int(hosts_store)},join_timeout=60,last_call_timeout=2,keep_alive_interval=1,"
           "keep_alive_max_attempt=3",
           str(WORKER), str(run), str(ckpt), "--steps", "160", "--mark-at", str(MARK), "--step-sleep", "0.02",
           "--from-step", str(FROM), "--slow", f"3:4:{DELAY}", "--slow", f"1:2:{DELAY}"]  # fmt: skip
    # each attempt's workers get a store of their own (torchrun's shared rendezvous store keeps the last
    # attempt's keys, on which a re-formed gloo group can trip)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            cwd=ROOT)  # fmt: skip


def test_a_node_lost_mid_run_the_survivor_re_forms_and_each_attempt_is_told_apart(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ckpt.mkdir()
    port = free_ports(1)
    survivor = _agent(port, True, run, ckpt, tmp_path / "survivor.log")
    time.sleep(1.0)  # the store's host first
    lost = _agent(port, False, run, ckpt, tmp_path / "lost.log")
    try:
        deadline = time.monotonic() + 150
        while not (ckpt / "mark").exists():
            assert time.monotonic() < deadline, (tmp_path / "survivor.log").read_text()[-3000:]
            assert survivor.poll() is None and lost.poll() is None, "an agent ended before the node was lost"
            time.sleep(0.1)
        lost_agent = lost.pid
        for pid in _children(lost.pid):  # the node goes: its agent and its workers at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert survivor.wait(timeout=150) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
    finally:
        for p in (survivor, lost):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    report = analyze_run(run).report
    first, *_, last = report["attempts"]
    # the first attempt: 4 ranks on 2 nodes; it ended when the lost node's ranks went silent
    assert (first["world_size"], first["ranks"], first["nodes"]) == (4, 4, 2), first
    metas = {r: json.loads((run / f"rank-{r:05d}.json").read_text()) for r in range(4)}
    on_lost = sorted(r for r, m in metas.items() if (m.get("attempts") or [m])[0].get("agent") == lost_agent)
    assert len(on_lost) == 2, metas
    assert f"ranks {on_lost[0]}-{on_lost[1]} left no record" in first["ended"], first["ended"]
    assert f"agent {lost_agent}" in first["ended"]
    # the last: 2 ranks on the surviving node; ranks 2 and 3 left with the lost node; it finished
    assert (last["world_size"], last["ranks"], last["nodes"], last["left"]) == (2, 2, 1, [2, 3]), last
    assert last["world"] == first["world"] + 1
    assert last["nodes_left"] == [f"{metas[on_lost[0]]['host']} (agent {lost_agent})"]
    assert last["ended"].startswith("finished"), last["ended"]
    # each straggler in its attempt, never mixed: rank 3 while 4 ran, rank 1 once 2 ran (not before)
    found = {(s["rank"], report["attempts"][s["attempt"]]["world_size"]): s for s in report["stragglers"]}
    assert set(found) == {(3, 4), (1, 2)}, [(s["rank"], s["attempt"], s["episodes"]) for s in report["stragglers"]]
    for (_, world), s in found.items():
        a = report["attempts"][s["attempt"]]
        assert a["first_step"] + FROM - 3 <= s["first_step"] <= a["first_step"] + FROM + 6, (s, a)
        assert s["cause"] == "compute" and 0.6 * DELAY * 1e3 <= s["excess_ms"]["compute"] <= 1.6 * DELAY * 1e3, s
        assert s["lost_gpu_seconds"] == pytest.approx(s["lost_seconds"] * world, rel=1e-2, abs=2e-3)
        assert s["last_step"] is None or s["last_step"] <= a["last_step"]
    # the cost per attempt, summed with each attempt's own number of GPUs
    assert all(a["lost_seconds"] is not None for a in report["attempts"])
    assert report["lost_gpu_seconds"] >= sum(a["lost_gpu_seconds"] for a in report["attempts"]) - 1e-3
    assert report["lost_gpu_seconds"] < report["lost_seconds"] * 4, "the 2-rank attempt's seconds cost 2 GPUs, not 4"
    text = render_text(report)
    assert "ranks (by attempt: 4" in text and f"rank 1 in attempt {found[(1, 2)]['attempt']}" in text, text
