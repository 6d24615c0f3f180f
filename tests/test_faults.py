"""The fault matrix (README, "What survives what"), one process at a time: each fault leaves
training finished, nothing lost beyond the flush interval, and one clear line."""

from __future__ import annotations

import ast
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, free_ports, prefork, wait_for

import stragglerwatch
from stragglerwatch import Config, ConfigError
from stragglerwatch.record.events import read_events
from stragglerwatch.record.steplog import RunDirError, log_files
from stragglerwatch.runtime.hangs.peers import PeerBoard
from stragglerwatch.runtime.log import Problems

FAULTS = ROOT / "tests" / "workers" / "faults.py"


def steps_job(out: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """faults.py in ``steps`` mode: one process training with stragglerwatch attached."""
    cmd = [sys.executable, str(FAULTS), "steps", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def our_lines(text: str) -> list[str]:
    """Our problem lines on stderr (not rank 0's line at attach saying where the run goes)."""
    return [line for line in text.splitlines() if line.startswith("stragglerwatch:") and not
            line.startswith("stragglerwatch: recording run ")]  # fmt: skip


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name == "stragglerwatch")


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_bare_attach_records_every_step(tmp_path: Path) -> None:
    """`stragglerwatch.attach(model)` without keeping the handle: every step, closed at exit."""
    proc = steps_job(tmp_path, "--bare", "--steps", "50")
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(50))
    assert [p.suffix for p in log_files(tmp_path / "run")] == [".parquet"], "closed, hence compacted, at exit"


def test_disk_full_goes_on_in_a_new_segment(tmp_path: Path) -> None:
    """Every file may hold 40 kB (RLIMIT_FSIZE: writes past it fail, as on a full disk)."""
    proc = steps_job(tmp_path, "--steps", "600", "--flush", "0.02", "--fsize", "40000")
    assert proc.returncode == 0 and (tmp_path / "done").exists(), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and "cannot write" in lines[0], lines
    stats = ast.literal_eval((tmp_path / "stats.txt").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cut streams are named; what they held is read
        df = stragglerwatch.load_run(tmp_path / "run")
    assert len(log_files(tmp_path / "run")) >= 2, "the log went on in new segments"
    assert df["step"].is_unique and len(df) + stats["dropped_steps"] == 600, "only the failed batches are lost"
    assert stats["write_errors"] >= 1
    # a failed write loses its batch and nothing else: the missing steps are at most one contiguous run per
    # failed write (a batch's size is not bounded by the flush interval: on a loaded machine the writer
    # thread runs late and its batches grow, 5x the interval's steps under two busy processes)
    missing = sorted(set(range(600)) - set(df["step"]))
    runs = sum(1 for i, step in enumerate(missing) if i == 0 or step != missing[i - 1] + 1)
    assert runs <= stats["write_errors"], f"a failed write loses one batch: {runs} runs, {stats['write_errors']} errors"


def test_unwritable_run_dir_leaves_training_unwatched(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        watch = stragglerwatch.attach(model, "/proc/stragglerwatch-cannot-be-here/run")
        train(model, opt, 3)
        watch.close()
    assert not watch.enabled and said(caplog, "cannot write run dir") == 1


def test_run_dir_deleted_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        watch = stragglerwatch.attach(model, run, watchdog_timeout_s=0, flush_interval_s=60)
        train(model, opt, 5)
        watch.flush()
        shutil.rmtree(run)
        train(model, opt, 5)
        watch.flush()
        train(model, opt, 5)
        watch.close()
    assert said(caplog, "was gone: made again") == 1
    assert (run / "run.json").exists() and (run / "rank-00000.json").exists()
    assert stragglerwatch.load_run(run)["step"].tolist() == list(range(5, 15)), "every step after the deletion"


def test_scraper_that_hangs_blocks_nothing(tmp_path: Path) -> None:
    port = free_ports(1)
    model, opt = model_and_opt()
    watch = stragglerwatch.attach(model, tmp_path / "run", prometheus_port=port, prometheus_addr="127.0.0.1")
    hung = socket.create_connection(("127.0.0.1", port))
    hung.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never finishes the request
    try:
        train(model, opt, 5)
        t0 = time.monotonic()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"stragglerwatch_steps_total" in body and time.monotonic() - t0 < 3
        t0 = time.monotonic()
        watch.close()
        assert time.monotonic() - t0 < 5, "close() does not wait for the hung scraper"
    finally:
        hung.close()


def readable(run: Path) -> None:
    """Every step log of a run dir reads (possibly cut short, which is named), and its steps run from 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            df = stragglerwatch.load_run(run)
        except RunDirError:  # killed before attach wrote anything
            assert not list(run.glob("rank-*.arrows")) and not list(run.glob("rank-*.parquet"))
            return
    assert df["step"].tolist() == list(range(len(df))), "no gap, no duplicate"
    for f in run.glob("rank-*.parquet"):
        pq.read_table(f)


#: How late the writer thread may be, on top of the 10 ms flush interval, before a step it has not
#: written counts as lost: 0.5 s was too little with two busy processes on the two cores.
MARGIN_S = 1.5


@pytest.mark.full  # a minute of kill-and-read rounds
def test_sigkill_at_random_moments_leaves_readable_files(tmp_path: Path) -> None:
    """SIGKILL 20 times: 3 during start-up, 14 at random steps of training (flushes), 3 around the
    end of training (close's compaction). Every file left is readable, and no step that finished
    longer ago than the flush interval (plus a margin) is lost. The start-up kills hit processes of
    their own (during their imports and attach); the others hit jobs forked from one interpreter that
    has imported torch already (conftest's ``prefork``), which start in milliseconds instead of seconds."""
    rng = random.Random(20261130)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps, moments = 600, ["start"] * 3 + ["training"] * 14 + ["end"] * 3
    forks = prefork()
    checked = 0
    for i, moment in enumerate(moments):
        out = tmp_path / f"kill{i}"
        out.mkdir()
        progress = out / "progress"
        job = [str(out), "--steps", str(steps), "--flush", "0.01"]
        if moment == "start":
            proc = subprocess.Popen([sys.executable, str(FAULTS), "steps", *job], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            time.sleep(rng.uniform(0.2, 1.0))
        else:
            rank = forks.start(FAULTS, ("steps", *job), env, os.devnull)
            target = rng.randint(5, steps - 50) if moment == "training" else steps - 1
            wait_for(lambda t=target, f=progress: f.exists() and len(f.read_text().splitlines()) > t, 120,
                     f"kill {i}: step {target}")  # fmt: skip
            first_at = float(progress.read_text().split()[1])
            time.sleep(max(0.0, first_at + MARGIN_S + 0.1 - time.time()))  # some steps older than the margin
            time.sleep(rng.uniform(0.0, 0.05 if moment == "training" else 0.3))
        killed_at = time.time()
        if moment == "start":
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        else:
            rank.kill()
            rank.wait(timeout=30)
        readable(out / "run")
        lines = [line.split() for line in progress.read_text().splitlines()] if progress.exists() else []
        old = [int(s) for s, at in (x for x in lines if len(x) == 2) if float(at) < killed_at - MARGIN_S]
        if old:  # steps older than the flush interval (and a margin) are kept
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert stragglerwatch.load_run(out / "run")["step"].max() >= max(old), f"kill {i} ({moment})"
            checked += 1
    assert checked == 17, "the data-loss check ran for every kill after start-up"


def test_wall_clock_jump_changes_no_duration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_and_opt()
    with stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=2.0) as watch:  # far under the jump
        train(model, opt, 5)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # NTP stepped the clock an hour ahead
        train(model, opt, 5)
        time.sleep(0.2)
        assert not watch.stats()["stalled"]
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(10))
    assert (df["step_s"] < 1.0).all() and df["start_time"].is_monotonic_increasing
    assert [e["kind"] for e in read_events(tmp_path / "run")[0]] == ["closed"], "no false stall"


def test_bad_files_in_a_run_dir_are_named_not_fatal(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, opt = model_and_opt()
    with stragglerwatch.attach(model, run, watchdog_timeout_s=0):
        train(model, opt, 8)
    good = run / "rank-00000.parquet"
    (run / "rank-00001.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # truncated
    pq.write_table(pa.table({"x": [1, 2]}), run / "rank-00002.parquet")  # foreign
    (run / "rank-00003.arrows").write_bytes(os.urandom(3000))  # corrupted
    (run / "rank-00004.json").write_text("{not json")
    (run / "events-00005.jsonl").write_bytes(b'\xff\xfe\x00garbage\n{"kind": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "stragglerwatch.cli", "analyze", str(run)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 of 1 ranks, 8 steps" in proc.stdout
    named = proc.stderr.strip().splitlines()
    assert named and all(line.startswith("stragglerwatch:") for line in named), named
    assert any("rank-00001.parquet" in line for line in named) and any("rank-00003.arrows" in line for line in named)


def test_no_failure_of_ours_reaches_the_training_loop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0)

        def broken(*args: object) -> None:
            raise RuntimeError("a bug of ours")

        watch._probe._sink = broken  # every step's end now fails inside our optimizer hook
        watch._writer.observers.append(broken)  # and so does the log thread after each write
        train(model, opt, 10)  # the loop never sees it
        watch.close()
    assert watch._probe.faults >= 9
    assert said(caplog, "a hook of ours failed") == 1, "one line, the rest counted"


def test_a_problem_counted_is_a_problem_said() -> None:
    """Whoever sees a problem's count (``stats()``) finds its line logged: a slow log handler of the
    application's does not let the count run ahead of the line (a test read the count, then the log, and found
    the line not there yet)."""
    import logging
    import threading

    said: list[str] = []

    class Slow(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            time.sleep(0.3)
            said.append(record.getMessage())

    logger = logging.getLogger("stragglerwatch.test-problems")
    logger.propagate, handler = False, Slow()
    logger.addHandler(handler)
    try:
        problems = Problems(logger)
        worker = threading.Thread(target=problems.report, args=("control", "control file: unreadable"))
        worker.start()
        wait_for(lambda: problems.counts.get("control"), 5, "the count")
        assert said == ["stragglerwatch: control file: unreadable"], said
        worker.join(timeout=5)
        problems.report("control", "again")  # within the minute: counted, not said
        assert problems.counts == {"control": 2} and len(said) == 1
    finally:
        logger.removeHandler(handler)


def test_config_precedence_errors_and_documentation(caplog: pytest.LogCaptureFixture) -> None:
    env = {"STRAGGLERWATCH_RUN_DIR": "/from/env", "STRAGGLERWATCH_PROMETHEUS_PORT": "9400"}
    cfg = Config.resolve(Config(role="stage1"), environ=env, flush_interval_s=0.5)
    assert (str(cfg.run_dir), cfg.prometheus_port, cfg.role, cfg.flush_interval_s) == ("/from/env", 9400, "stage1", 0.5)
    assert str(Config.resolve(environ=env, run_dir="/given").run_dir) == "/given", "an argument wins"
    assert not Config.resolve(environ={"STRAGGLERWATCH_DISABLE": "1"}, enabled=True).enabled
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        typo = Config.resolve(environ={"STRAGGLERWATCH_PROMETHEUS_PORT": "x"}, problems=Problems())
    assert typo.prometheus_port is None
    assert said(caplog, "STRAGGLERWATCH_PROMETHEUS_PORT='x' is not a port") == 1
    for bad in ({"flush_interval_s": 0}, {"no_such_setting": 1}, {"prometheus_port": 70000}):
        with pytest.raises(ConfigError):
            Config.resolve(environ={}, **bad)
    with pytest.raises(ConfigError, match="unknown setting"):
        stragglerwatch.attach(torch.nn.Linear(2, 2), "/tmp/x", flush_intervall_s=1.0)
    import inspect

    source = inspect.getsource(Config)
    for name in Config.__dataclass_fields__:
        after = source.split(f"\n    {name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"Config.{name} has no docstring"


def test_run_ids_are_unique_per_job_and_kept_by_a_second_attach(tmp_path: Path) -> None:
    ids = []
    for parent in ("a", "b", "a"):
        with stragglerwatch.attach(torch.nn.Linear(2, 2), tmp_path / parent / "exp", watchdog_timeout_s=0) as w:
            ids.append(w.info.run_id)
    assert ids[0].startswith("exp-") and ids[1].startswith("exp-") and ids[0] != ids[1]
    assert ids[2] == ids[0], "a second attach in a run dir continues its run"
    with stragglerwatch.attach(torch.nn.Linear(2, 2), tmp_path / "c", run_id="given", watchdog_timeout_s=0) as w:
        assert w.info.run_id == "given"


def test_restarts_and_reattaches_are_numbered_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from stragglerwatch.cli.commands import main as cli

    run = tmp_path / "run"
    model, opt = model_and_opt()
    for restart, n in (("0", 4), ("0", 3), ("1", 5)):  # attach, re-attach, then a restarted worker group
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        with stragglerwatch.attach(model, run, watchdog_timeout_s=0):
            train(model, opt, n)
    df = stragglerwatch.load_run(run)
    assert len(df) == 12 and not df.duplicated(["rank", "restart", "attach", "step"]).any()
    assert df.groupby(["restart", "attach"]).size().tolist() == [4, 3, 5]
    assert cli(["analyze", str(run), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 12, "no (rank, step) overwritten"
    assert [(a["restart"], a["first_step"], a["last_step"]) for a in report["attempts"]] == [(0, 0, 3), (0, 4, 6),
                                                                                             (1, 7, 11)]  # fmt: skip
    assert cli(["analyze", str(run)]) == 0
    assert "3 attempts" in capsys.readouterr().out


def test_peers_are_read_in_two_store_operations(tmp_path: Path) -> None:
    """64 simulated peers' notes in a real TCPStore (one client writes them all: this machine's store
    accepts new connections slowly after a few dozen); one rank reads them."""
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = 64
    shared = torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    for rank in range(world):
        board = PeerBoard("run", rank, world)
        board._client = shared
        if rank != 7:
            assert board.publish({"step": 3, "phase": "allreduce_wait", "at": time.time()})
    shared.get(f"stragglerwatch/run/where/{world - 1}")  # sets are not acknowledged: wait until all landed
    reader = PeerBoard("run", 0, world)
    reader._address = ("127.0.0.1", master.port)
    notes = reader.read()
    assert notes is not None and notes[7] is None and notes[1]["phase"] == "allreduce_wait"
    assert reader.operations == 1 + world + (world - 1), "a rank never published: one key at a time"
    late = PeerBoard("run", 7, world)
    late._client = shared
    late.publish({"step": 2, "phase": "data_wait", "at": time.time()})
    shared.get("stragglerwatch/run/where/7")  # a set is not acknowledged: wait until the store has it
    reader.operations = 0
    notes = reader.read()
    assert reader.operations == 2 and notes[7]["phase"] == "data_wait" and len(notes) == world


def test_a_stall_noticed_late_carries_the_native_dump(tmp_path: Path) -> None:
    """A rank that held the GIL in native code for longer than its threshold: its watchdog notices the
    stall only once Python runs again, and the stall's stacks are faulthandler's dump of where the rank
    was stuck, not the threads as they are at that later moment."""
    import ctypes

    model, opt = model_and_opt()
    watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=1, flush_interval_s=0.05)
    train(model, opt, 3)
    ctypes.PyDLL(None).sleep(4)  # libc sleep() keeping the GIL: the dump timer (threshold + 2 s) fires meanwhile
    deadline = time.monotonic() + 5
    while not watch.controls.state()["stall"]["stalled"] and time.monotonic() < deadline:
        sum(range(1000))  # Python, but no step hook: the watchdog runs, and the step has not moved on
    train(model, opt, 2)
    watch.close()
    (stall,) = [e for e in read_events(tmp_path / "run")[0] if e["kind"] == "stall"]
    assert stall["waited_s"] >= 4
    assert "test_a_stall_noticed_late_carries_the_native_dump" in stall["stacks"].get("faulthandler", ""), stall
