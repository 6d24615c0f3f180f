"""stragglerwatch in PyTorch's debug server, on real jobs: a 2-rank gloo job under torchrun whose live
view is read and whose settings are changed through the frontend while it trains; a frontend port
already in use; and torch's own ``start_debug_server`` with our plugin in its ``handlers``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

import stragglerwatch
from stragglerwatch.cli.commands import main as cli
from stragglerwatch.record.events import read_events
from stragglerwatch.runtime.controls import debugserver, debugstack

pytestmark = pytest.mark.distributed

JOB = ROOT / "tests" / "workers" / "debugserver_job.py"
STALL_S = 4.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout_s: float = 20) -> str:
    with _OPENER.open(url, timeout=timeout_s) as f:
        return f.read().decode()


def view(base: str, query: str = "") -> dict:
    return json.loads(get(f"{base}/stragglerwatch.json" + (f"?{query}" if query else "")))


def states(v: dict) -> dict[int, dict]:
    return {r["rank"]: r["state"] for r in v["ranks"] if r.get("state")}


def settled(base: str, predicate, timeout_s: float, what: str) -> dict:
    """The first view (fetched every 0.2 s) for which ``predicate`` holds; fails after ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = view(base)
            if predicate(last):
                return last
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last view: {str(last)[:2000]}")


def test_live_view_and_runtime_controls_through_the_debug_server(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run, signals, port = tmp_path / "run", tmp_path / "signals", free_port()
    signals.mkdir()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - closed in finally
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB),
         "--run-dir", str(run), "--signal-dir", str(signals), "--stall-seconds", str(STALL_S),
         "--flush-interval", "30", "--deadline-s", "150"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "STRAGGLERWATCH_DEBUG_SERVER_PORT": str(port)},
    )  # fmt: skip
    try:
        # the live view of both ranks, served by rank 0's frontend on loopback
        v = settled(base, lambda v: len(states(v)) == 2 and min(s["steps"] for s in states(v).values()) >= 5, 90,
                    "both ranks in the live view")  # fmt: skip
        frontend = json.loads((run / "debug-server.json").read_text())
        assert frontend["url"] == f"{base}/stragglerwatch" and frontend["host"] == "127.0.0.1"
        for rank, s in states(v).items():
            assert s["rank"] == rank and s["world_size"] == 2 and s["phase"] != "idle"
            assert s["settings"]["watchdog_timeout_s"] is None, "adaptive at attach"
            assert s["settings"]["watchdog_threshold_s"] >= 10 > STALL_S, "the stall below is too short for it"
            assert s["settings"]["flush_interval_s"] == 30 and s["stats"]["steps_written"] == 0
            assert s["controls"]["debug_server"]["worker_url"].startswith("http://127.0.0.1:")
        assert v["verdict"]["summary"][0] == "no rank is stalled" and v["verdict"]["hang"] is None
        page = get(f"{base}/stragglerwatch")
        assert "Torch Distributed Debug Server" in page and "<h2>Ranks</h2>" in page and "<form" in page
        assert len(re.findall(r"<tr><td>\d</td><td>", page)) == 2

        # flush interval 30 s -> 0.2 s: the log threads write within the wait they were in
        t0 = time.monotonic()
        v = view(base, "flush_interval_s=0.2")
        assert all(r["result"]["applied"] == {"flush_interval_s": 0.2} for r in v["ranks"])
        settled(base, lambda v: all(s["stats"]["steps_written"] > 0 for s in states(v).values()), 5, "the writes")
        assert time.monotonic() - t0 < 3.0, "not the 30 s the log threads were waiting"

        # the watchdog threshold, from adaptive (>= 10 s) to 1 s, through the page's form
        page = get(f"{base}/stragglerwatch?setting=watchdog_timeout_s&value=1&rank=all")
        assert "applied on ranks 0, 1" in page
        assert all(s["settings"]["watchdog_threshold_s"] == 1.0 for s in states(view(base)).values())
        refused = get(f"{base}/stragglerwatch?watchdog_timeout_s=0.1")
        assert "not changed: watchdog_timeout_s must be at least" in refused

        # rank 1 stalls 4 s: both watchdogs fire at the new threshold, and the page names the culprit live
        (signals / "stall").touch()
        v = settled(base, lambda v: v["verdict"]["stalled_ranks"], 15, "a stalled rank")
        assert v["verdict"]["hang"]["culprit_ranks"] == [1] and v["verdict"]["hang"]["victim_ranks"] == [0]
        assert v["verdict"]["summary"][0].startswith("stalled: rank")
        settled(base, lambda v: not v["verdict"]["stalled_ranks"], 15, "the recovery")

        # recording off and on again, on rank 1 only
        v = view(base, "recording=off&rank=1")
        results = {r["rank"]: r["result"] for r in v["ranks"]}
        assert results[0] is None and results[1]["applied"] == {"recording": False}
        settled(base, lambda v: not states(v)[1]["settings"]["recording_now"], 5, "rank 1 paused")
        time.sleep(0.5)
        assert states(view(base))[0]["settings"]["recording_now"], "rank 0 records on"
        view(base, "recording=on&rank=1")
        settled(base, lambda v: states(v)[1]["settings"]["recording_now"], 5, "rank 1 recording again")

        # the same controls through the run dir (the way that needs no debug server), answered by both ranks
        assert cli(["control", str(run), "--set", "watchdog_timeout_s=auto", "--wait", "15"]) == 0
        out = capsys.readouterr().out
        assert f"debug server: {base}/stragglerwatch" in out and "applied by ranks 0-1" in out, out
        assert all(s["settings"]["watchdog_timeout_s"] is None for s in states(view(base)).values())

        (signals / "stop").touch()
        assert job.wait(timeout=60) == 0
    finally:
        (signals / "stop").touch()
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout=10)
        log.close()
    output = (tmp_path / "job.log").read_text()
    assert "stragglerwatch: rank 1: watchdog_timeout_s auto -> 1 s (runtime control, debug server)" in output
    assert "Traceback" not in output and "Fatal Python error" not in output
    assert not (run / "debug-server.json").exists(), "removed when the frontend stopped"
    with pytest.raises(OSError):
        get(f"{base}/stragglerwatch", timeout_s=2)

    # the stalls were recorded at the threshold set at run time (the adaptive one, >= 10 s, saw none)
    events, bad = read_events(run)
    stalls = {e["rank"]: e for e in events if e["kind"] == "stall"}
    assert bad == 0 and sorted(stalls) == [0, 1]
    assert all(e["threshold_s"] == 1.0 and 1.0 < e["waited_s"] < STALL_S for e in stalls.values())
    assert stalls[0]["phase"] == "allreduce_wait" and stalls[1]["phase"] not in ("allreduce_wait", "collective_wait")
    assert all(e["culprit_ranks"] == [1] for e in events if e["kind"] == "diagnosis")

    # rank 1 recorded fewer steps, with one gap; its later steps keep the job's numbering
    trained = {r: json.loads((signals / f"done-{r}.json").read_text())["steps"] for r in (0, 1)}
    assert trained[0] == trained[1]
    df = stragglerwatch.load_run(run)
    steps = {r: g["step"].tolist() for r, g in df.groupby("rank")}
    assert steps[0] == list(range(trained[0]))
    gaps = [(a, b) for a, b in zip(steps[1], steps[1][1:], strict=False) if b != a + 1]
    assert len(gaps) == 1 and len(steps[1]) < trained[1] and steps[1][-1] == trained[1] - 1


def test_frontend_port_in_use_is_one_line_and_training_goes_on(tmp_path: Path, one_rank_group,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with socket.socket() as busy, caplog.at_level("INFO", logger="stragglerwatch"):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        watch = stragglerwatch.attach(model, tmp_path / "run", debug_server_port=port, context_interval_s=0)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        server = watch.controls.debug_server
        assert server.wait(90), "the start-up ends (the frontend process answers)"
        assert watch.stats()["problems"] == {"debug-server": 1}
        (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert line.startswith(f"stragglerwatch: debug server: cannot listen on 127.0.0.1:{port} (")
        assert line.endswith("; training goes on")
        # the rank's own worker server still answers (the frontend was the only thing that failed)
        request = urllib.request.Request(f"{server.worker_url}/handler/stragglerwatch?recording=off", data=b"",
                                         method="POST")  # fmt: skip
        body = json.loads(_OPENER.open(request, timeout=10).read())
        assert body["rank"] == 0 and body["result"]["applied"] == {"recording": False}
        watch.close()
    assert len(stragglerwatch.load_run(tmp_path / "run")) == 3


def _start_torch_debug_server(port: int, handlers: list) -> None:
    """torch's ``start_debug_server`` with ``handlers``, started with "spawn" (which pickles our plugin
    by name). On rank 0 it also imports its default pages, which need ``tabulate``, whether or not they
    are asked for; where that is missing, the same steps with the same parts of torch."""
    import importlib.util
    import multiprocessing

    from torch.distributed import debug

    if importlib.util.find_spec("tabulate") is not None:
        debug.start_debug_server(port=port, start_method="spawn", handlers=handlers, fetch_timeout=10)
        return
    from torch._C._distributed_c10d import _WorkerServer
    from torch.distributed.debug._frontend import main
    from torch.distributed.debug._store import tcpstore_client

    debug._WORKER_SERVER = _WorkerServer("::", 0)
    tcpstore_client().set("rank0", f"http://{socket.gethostname()}:{debug._WORKER_SERVER.port}")
    debug._DEBUG_SERVER_PROC = multiprocessing.get_context("spawn").Process(
        target=main, kwargs={"port": port, "dump_dir": None, "dump_interval": 60.0, "enabled_dumps": set(),
                             "handlers": handlers, "fetch_timeout": 10.0}, daemon=True)  # fmt: skip
    debug._DEBUG_SERVER_PROC.start()


def test_our_page_in_a_debug_server_the_user_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own debug server (its worker server, its frontend process), with stragglerwatch's plugin in
    its handlers: our worker handler answers it, and our own start reuses its worker server."""
    import torch.distributed as dist
    from torch.distributed import debug

    store_port, frontend_port = free_port(), free_port()
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo")
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = stragglerwatch.attach(model, tmp_path / "run", context_interval_s=0)
    try:
        _start_torch_debug_server(frontend_port, [debugserver.handler(index=True)])
        assert debugserver.register(watch.controls), "started after attach: registered as the README says"
        try:
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            base = f"http://127.0.0.1:{frontend_port}"
            v = settled(base, lambda v: len(states(v)) == 1, 90, "the page in torch's own frontend")
            assert states(v)[0]["steps"] == 3 and states(v)[0]["controls"]["debug_server"] is None
            v = view(base, "watchdog_timeout_s=7")
            assert v["ranks"][0]["result"]["applied"] == {"watchdog_timeout_s": 7.0}
            assert watch.controls.settings()["watchdog_threshold_s"] == 7.0
            assert "<h2>Ranks</h2>" in get(f"{base}/")
            ours = debugstack.start(watch)  # a worker server already runs: reused, none started
            assert ours is not None and ours.wait(30) and ours.worker is None and ours.errors == 0
            assert ours.worker_url.endswith(f":{debug._WORKER_SERVER.port}")
        finally:
            debug.stop_debug_server()
    finally:
        watch.close()
        dist.destroy_process_group()
