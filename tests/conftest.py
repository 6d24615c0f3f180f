from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.runtime.capture.timing import StepMarks
from stragglerwatch.runtime.identity import write_meta

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (DDP and compile tests in-process)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_anatomy(df) -> None:
    """The record contract on a loaded run: phases non-negative and adding up to the step,
    communication the sum of its two kinds, busy the step minus communication and evaluation."""
    from stragglerwatch.record.schema import PHASE_COLUMNS

    parts = df[list(PHASE_COLUMNS)]
    assert (parts >= 0).all().all()
    assert (parts.sum(axis=1) - df["step_s"]).abs().max() < 1e-9, "the phases add up to the step"
    assert ((df["comm_wait_s"] - df["allreduce_wait_s"] - df["collective_wait_s"]).abs() < 1e-12).all()
    assert ((df["busy_s"] - (df["step_s"] - df["comm_wait_s"] - df["eval_s"])).abs() < 1e-12).all()


_TOOL_DIRS = {".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__", ".venv", ".git"}


def _repo_entries() -> set[str]:
    """What is in the repo's root and in the folders tests could leave runs in, tools' caches aside."""
    out = {p.name for p in ROOT.iterdir() if p.name not in _TOOL_DIRS}
    for folder in ("examples", "tests", "benchmarks", "stragglerwatch"):
        out |= {f"{folder}/{p.name}" for p in (ROOT / folder).iterdir() if p.name not in _TOOL_DIRS}
    return out


@pytest.fixture(scope="session", autouse=True)
def no_test_writes_into_the_repo():
    """Tests write only under their temporary directories: the working tree is the same afterwards."""
    before = _repo_entries()
    yield
    new = sorted(_repo_entries() - before)
    assert not new, f"tests left files in the repo: {new}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI (``STRAGGLERWATCH_REQUIRE_ALL=1``, set by ``.ci/run``) a skipped test fails the run:
    a missing Prometheus or Chromium must not pass as green."""
    for server in _PREFORK:
        server.close()
    if os.environ.get("STRAGGLERWATCH_REQUIRE_ALL") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and exitstatus == 0:
        session.exitstatus = 1
        reporter.write_line(f"STRAGGLERWATCH_REQUIRE_ALL=1: {len(skipped)} test(s) skipped; CI must run them all")


#: Markers of the tests that only the full suite runs (``--full``; CI's): real multi-rank jobs, real
#: servers and browsers, installs into fresh venvs, and the slower single-process checks.
FULL_ONLY = ("full", "distributed", "install")
#: Fixtures that start a real server or browser (Chromium, gunicorn, Ray, the live Prometheus job): full only.
FULL_FIXTURES = {"browser", "runs_service", "cluster", "live_prometheus"}


#: Test files whose outcome no wall-clock timing decides: installs into fresh venvs, the documentation (its
#: examples must exit 0; its site must build), and analyses of arrays held in memory. ``scripts/test.sh``
#: runs them in a second session at the lowest CPU priority beside the others (``--part``), on the CPU
#: time the multi-rank jobs leave idle, without taking it from them.
BESIDE = frozenset({
    "test_wheel.py", "test_install.py", "test_docs.py", "test_detect.py", "test_imbalance.py", "test_cost.py",
    "test_fuzz.py", "test_timing.py", "test_settings.py", "test_simulate_heldout.py", "test_simulate_imbalance.py",
    "test_consistency.py", "test_explain.py", "test_eventlog.py", "test_jittertax.py", "test_reportschema.py",
    "test_traces.py", "test_runmatrix.py", "test_advice.py", "test_attempts.py", "test_layers.py",
    "test_torchlogs.py", "test_arrowcols.py", "test_no_torch.py", "test_context.py", "test_memory.py",
})  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="run the whole suite, as CI does: also the tests marked full, distributed or install "
                          "(real multi-rank jobs, Prometheus, Chromium, installs). Without it: the fast unit and "
                          "single-process tests only")  # fmt: skip
    parser.addoption("--part", choices=("all", "main", "beside"), default="all",
                     help="all (default); beside: only the test files no timing decides (conftest.BESIDE), which "
                          "scripts/test.sh runs at low priority beside the others; main: the others")  # fmt: skip


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full") or config.getoption("-m"):
        return "stragglerwatch: the full suite" if config.getoption("--full") else "stragglerwatch: -m selection"
    return "stragglerwatch: the fast suite (unit and single-process tests); --full runs everything, as CI does"


def _deselect(config: pytest.Config, items: list[pytest.Item], drop: Any) -> None:
    """Leave out (and report as deselected) the items for which ``drop(item)`` is true."""
    dropped = [item for item in items if drop(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in set(dropped)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--full`` (and without ``-m``), the full-only tests are deselected; with ``--part``, the
    other part's files. The tests on the live Prometheus job run last and together: its 4 ranks train in
    the background from the first of them to the end of the session, and no other multi-rank job may
    compete with them for this machine's cores (that noise once made a healthy rank look slow), nor they
    with it."""
    if not config.getoption("--full") and not config.getoption("-m"):
        _deselect(config, items, lambda item: any(item.get_closest_marker(m) for m in FULL_ONLY)
                  or FULL_FIXTURES & set(getattr(item, "fixturenames", ())))  # fmt: skip
    part = config.getoption("--part")
    if part != "all":
        _deselect(config, items, lambda item: (item.path.name in BESIDE) != (part == "beside"))
    live = [item for item in items if "live_prometheus" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in live] + live


def fake_step(step: int, t0: float, busy: float = 0.01, wait: float = 0.005) -> StepMarks:
    """Host marks of one plain DDP step starting at ``t0`` (perf-counter seconds)."""
    m = StepMarks(step, t0, t0)
    m.fwd_start, m.fwd_end = [t0 + 0.001], [t0 + 0.004]
    m.bwd_start, m.bwd_end = [t0 + 0.004], [t0 + busy - 0.002]
    m.ready, m.done = [(0, t0 + busy - 0.002)], [(0, t0 + busy - 0.002 + wait)]
    m.sync = [(t0 + busy - 0.002, t0 + busy - 0.002 + wait)]
    m.end = t0 + busy + wait
    m.opt = [[t0 + busy - 0.001 + wait, m.end]]
    return m


@pytest.fixture
def make_run(tmp_path: Path):
    """``make_run(world_size)`` writes run metadata for each rank into a fresh run dir."""

    def make(world_size: int = 2) -> Path:
        run_dir = tmp_path / "run"
        for rank in range(world_size):
            info = RunInfo("test-run", run_dir, rank, rank, world_size, "host-a")
            write_meta(info, {"test": True}, {"device": "cpu", "timing": "host"})
        return run_dir

    return make


def analyze_json(run: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    """``stragglerwatch analyze RUN --format json``'s report, through the CLI."""
    from stragglerwatch.cli.commands import main as cli

    assert cli(["analyze", str(run), "--format", "json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def medians(df: Any, from_step: int = 12) -> Any:
    """Per rank, the median of every column from ``from_step`` on (after an injection at step 10)."""
    return df[df["step"] >= from_step].groupby("rank").median(numeric_only=True)


def only_straggler(r: dict, rank: int, cause: str, onset: tuple[int, int] = (8, 14)) -> dict:
    """The report's one straggler, which must be ``rank`` by ``cause``, with its onset near step 10
    (``onset``: the steps allowed)."""
    assert r["busy_unavailable"] == []
    assert [(s["rank"], s["cause"]) for s in r["stragglers"]] == [(rank, cause)], r["stragglers"]
    (s,) = r["stragglers"]
    assert onset[0] <= s["first_step"] <= onset[1], f"onset near the injection at step 10: {s['first_step']}"
    return s


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def torchrun(nproc: int, script: Path, *args: str, timeout_s: float = 180, env: dict | None = None,
             launcher: tuple[str, ...] = ()):
    """Run ``script`` under torchrun with ``nproc`` CPU ranks (``launcher``: more of torchrun's own options,
    e.g. ``--max-restarts``); fail (not hang) past ``timeout_s``. For what torchrun itself adds: its
    elastic agent's store, restarts, the teardown of the other ranks."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher,
           str(script)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s, env=full_env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


#: Seconds the other ranks get to finish after one failed, before they are stopped (torchrun stops them).
RANK_FAILED_GRACE_S = 15.0
#: Variables a forked rank may set differently from the interpreter it is forked from: read when the job
#: runs, never when torch is imported (the Flight Recorder's when the first process group is made: a
#: forked rank's dump holds TORCH_FR_BUFFER_SIZE entries). A job that sets any other starts its ranks afresh.
#: ``PYTEST_CURRENT_TEST``: pytest names the running test in it, so it differs in every test but the first.
FORKABLE = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_WORLD_SIZE", "RANK",
            "LOCAL_RANK", "ROLE_RANK", "STRAGGLERWATCH_", "TORCH_FR_", "PYTEST_CURRENT_TEST")  # fmt: skip


class Prefork:
    """``tests/workers/prefork.py``: an interpreter that has imported torch and forks the ranks of
    :func:`launch`'s jobs, each in milliseconds where a fresh one imports torch for seconds (four ranks on
    two cores). One for the session, started at its first job and stopped at the session's end."""

    def __init__(self) -> None:
        import subprocess
        import sys
        import threading

        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / "prefork.py")], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=ROOT)  # fmt: skip

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a rank with ``env`` may be forked (it differs from ours only in :data:`FORKABLE`)."""
        keys = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        fresh = os.environ.get("STRAGGLERWATCH_TEST_FRESH_RANKS") == "1"  # to tell a fork's artefact from a bug
        return not fresh and self.proc.poll() is None and all(k.startswith(FORKABLE) for k in keys)

    def ask(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def start(self, script: Path, args: tuple[str, ...], env: dict[str, str], out: str) -> ForkedRank:
        job = {"script": str(script), "args": list(args), "env": env, "cwd": str(ROOT), "out": out}
        return ForkedRank(self, self.ask({"run": job})["pid"])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


class ForkedRank:
    """A forked rank with what :func:`launch` uses of ``subprocess.Popen``: ``pid``, ``returncode``,
    ``poll``, ``kill`` and ``wait``."""

    def __init__(self, server: Prefork, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"poll": self.pid})["code"]
        return self.returncode

    def kill(self) -> None:
        import signal

        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode


_PREFORK: list[Prefork] = []  # the session's, once a job needed it (closed by pytest_sessionfinish)


def prefork() -> Prefork:
    if not _PREFORK or _PREFORK[0].proc.poll() is not None:
        _PREFORK[:] = [Prefork()]
    return _PREFORK[0]


def launch(nproc: int, script: Path, *args: str, timeout_s: float = 180, env: dict | None = None):
    """Run ``script`` on ``nproc`` CPU ranks started directly, one process each with the variables
    torchrun would set (as ``srun`` or ``mpirun`` start the ranks of many jobs): rank 0 hosts the
    store. Without torchrun's agent a job starts about two seconds sooner (one interpreter and torch
    import fewer), and the ranks are forked from an interpreter that has imported torch already
    (:class:`Prefork`; a job whose ``env`` sets more than :data:`FORKABLE` starts them afresh): the
    suite's few dozen jobs add up. Fails (never hangs) past ``timeout_s``,
    or when a rank fails: the others are stopped after ``RANK_FAILED_GRACE_S``, as torchrun would."""
    import os
    import subprocess
    import sys
    import tempfile

    port = free_ports(1)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(nproc),
            **(env or {})}  # fmt: skip
    with tempfile.TemporaryDirectory() as logs:
        procs, outs = [], []
        for rank in range(nproc):
            out = open(os.path.join(logs, f"rank{rank}.txt"), "w+")  # noqa: SIM115 - closed below
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            server = prefork()
            if server.forks(rank_env):
                procs.append(server.start(script, args, rank_env, out.name))
            else:
                procs.append(subprocess.Popen([sys.executable, str(script), *args], stdout=out,
                                              stderr=subprocess.STDOUT, env=rank_env, cwd=ROOT))  # fmt: skip
            outs.append(out)
        deadline, failed_at = time.monotonic() + timeout_s, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > RANK_FAILED_GRACE_S):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            text = []
            for rank, out in enumerate(outs):
                out.seek(0)
                text.append(f"[rank {rank}, exit {procs[rank].returncode}]\n{out.read()}")
                out.close()
    joined = "\n".join(text)
    codes = [p.returncode for p in procs]
    if any(codes):
        why = "timed out" if failed_at is None else "a rank failed"
        raise AssertionError(f"{nproc}-rank job {why} (exit codes {codes}):\n{joined[-8000:]}")
    return subprocess.CompletedProcess([str(script), *args], 0, stdout=joined, stderr="")


EXAMPLE = ROOT / "examples" / "train_ddp.py"


def example_run(factory: pytest.TempPathFactory, name: str, *args: str) -> Path:
    """A 4-rank run of the example into a fresh run dir."""
    run = factory.mktemp(name) / "run"
    launch(4, EXAMPLE, *args, "--run-dir", str(run))
    return run


@pytest.fixture(scope="session")
def compute_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 gloo ranks, 60 steps; rank 2 is 20 ms a step slower in forward/backward from step 10."""
    args = ("--steps", "60", "--slow-rank", "2", "--delay", "0.02", "--cause", "compute", "--from-step", "10")
    return example_run(tmp_path_factory, "compute", *args)


@pytest.fixture(scope="session")
def data_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 gloo ranks, 60 steps; rank 1's loader is 20 ms a batch slower from step 15."""
    args = ("--steps", "60", "--slow-rank", "1", "--delay", "0.02", "--cause", "data", "--from-step", "15")
    return example_run(tmp_path_factory, "data", *args)


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 gloo ranks, 150 steps, nobody slowed: only this shared machine's noise."""
    return example_run(tmp_path_factory, "healthy", "--steps", "150")


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports on loopback, below the system's ephemeral range: a port
    the kernel may hand out as the source of an outgoing connection (a gloo rank's, a scrape's) could be taken
    between this check and the server's bind, and a port-in-use is, by design, one log line and no server."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    top = low - n if low - n > 20000 else 65535 - n  # an odd range: anywhere above 20000
    pick = random.Random()
    for _ in range(200):
        base = pick.randrange(20000, top)
        socks = []
        try:
            for i in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free ports")


def prom_api(base: str, query: str) -> list[dict]:
    """Result of an instant query against a Prometheus server's HTTP API."""
    import json
    import urllib.parse
    import urllib.request

    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    data = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert data["status"] == "success", data
    return data["data"]["result"]


@pytest.fixture(scope="session")
def live_prometheus(tmp_path_factory: pytest.TempPathFactory):
    """A real Prometheus (generated config, second-scale rules) scraping a real 4-rank gloo job with
    ``prometheus_port``: rank 2 is 20 ms a step slower, and stalls 6 s at step 300 (watchdog 2 s).
    The same server scrapes a second run, ``lean_run_id``: four exporters in the lean mode whose steps
    are made up to tell the same story (``synthetic_ranks.py``), so that every rule and panel is
    checked against both export modes; both runs publish their targets in one SD dir, as on a cluster."""
    import os
    import shutil
    import subprocess
    import sys
    from types import SimpleNamespace

    from stragglerwatch.cli.commands import main as cli
    from stragglerwatch.presentation.promrules import render_rules

    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        pytest.skip(
            "PROMETHEUS TESTS SKIPPED: install Debian's 'prometheus' package (scripts/setup.sh does so as root)"
        )
    from synthetic_ranks import SyntheticJob

    tmp = tmp_path_factory.mktemp("prometheus")
    run, sd, ports = tmp / "run", tmp / "sd", free_ports(9)
    port_base, prom_port = ports, ports + 8
    rules = tmp / "fast.rules.yml"
    rules.write_text(render_rules(window="20s", for_="10s"))
    started = time.time()
    lean = SyntheticJob("lean-run", 4, ports + 4, sd, lean=True)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
         "--steps", "100000", "--slow-rank", "2", "--delay", "0.02", "--stall-rank", "2", "--stall-at-step",
         "300", "--stall-seconds", "6", "--watchdog-timeout", "2", "--run-dir", str(run)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp / "job.log").open("wb"),
        env={**os.environ, "OMP_NUM_THREADS": "1", "STRAGGLERWATCH_PROMETHEUS_PORT": str(port_base),
             "STRAGGLERWATCH_PROMETHEUS_ADDR": "127.0.0.1", "STRAGGLERWATCH_SD_DIR": str(sd)},
    )  # fmt: skip
    prom = None
    try:
        try:
            wait_for(lambda: len(list(sd.glob("stragglerwatch-*.json"))) == 8, 90, "8 target files")
        except AssertionError as e:  # say what came and what the job said
            found = sorted(p.name for p in sd.glob("stragglerwatch-*.json"))
            said = (tmp / "job.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{e}; found {found}; the job (exit {job.poll()}) said:\n{said}") from None
        run_id = read_json(run / "run.json")["run_id"]
        config = tmp / "prometheus.yml"
        with open(config, "w") as f, pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stdout", f)
            assert cli(["prometheus-config", str(run), "--sd-dir", str(sd), "--all-runs", "--scrape-interval", "1s",
                        "--rules", str(rules)]) == 0  # fmt: skip
        check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        prom = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        base = f"http://127.0.0.1:{prom_port}"

        def lean_scraped() -> bool:
            try:
                return len(prom_api(base, f'stragglerwatch_steps_total{{run="{lean.run_id}"}}')) == 4
            except OSError:  # not listening yet
                return False

        # the lean run's stall once its ranks are scraped: counted before their first scrape, its counters
        # are first seen at 1 and no panel shows an increase (CI once started Prometheus 17 s into the
        # fixture, when the stall was due 20 s in, and found no stall of the culprit)
        wait_for(lean_scraped, 60, "Prometheus to scrape the lean run's 4 ranks")
        lean.arm()
        yield SimpleNamespace(base=base, run=run, run_id=run_id, job=job,
                              lean_run_id=lean.run_id, started=started)  # fmt: skip
    finally:
        lean.close()
        job.terminate()
        if prom is not None:
            prom.terminate()
        for p in (job, prom):
            if p is not None:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
