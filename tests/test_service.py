"""The dashboard as a service, as the README starts it: ``gunicorn -c dashboard/gunicorn.conf.py
dashboard.app:server`` in a subprocess on a free loopback port, configured by the environment, over a
run dir that grows while headless Chromium watches, and over a directory of runs (the run picker);
names that would reach outside the root are refused over HTTP and through the page's callback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, free_ports, wait_for
from test_dashboard import browser, console_errors, needs_browser, text_of  # noqa: F401 - browser: a fixture

from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.presentation.dashboard.app import BANNER, HEADING, RUNS
from stragglerwatch.presentation.dashboard.service import Service, ServiceConfig, create_server, run_path
from stragglerwatch.presentation.render import verdict_lines
from stragglerwatch.record.simulate import Injection, SimConfig, write_run

GUNICORN = shutil.which("gunicorn", path=str(Path(sys.executable).parent)) or shutil.which("gunicorn")


class Gunicorn:
    """The service in a gunicorn subprocess (its own process group), stopped whatever happens."""

    def __init__(self, log: Path, env: dict[str, str], *args: str):
        self.port = free_ports(1)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRAGGLERWATCH_", "GUNICORN_"))}
        clean.pop("XDG_RUNTIME_DIR", None)
        full_env = {**clean, "HOME": str(log.parent), "PYTHONDONTWRITEBYTECODE": "1",
                    "STRAGGLERWATCH_PORT": str(self.port), **env}  # fmt: skip
        assert GUNICORN, "gunicorn is installed by scripts/setup.sh (extra dashboard)"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [GUNICORN, "-c", "dashboard/gunicorn.conf.py", *args, "dashboard.app:server"],
                cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60) -> Gunicorn:
        def up() -> bool:
            assert self.proc.poll() is None, f"gunicorn exited ({self.proc.returncode}):\n{self.text()[-3000:]}"
            try:
                return get(self.base, "/_dash-dependencies")[0] == 200
            except OSError:
                return False

        wait_for(up, timeout_s, f"gunicorn to serve on {self.base}")
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


def get(base: str, path: str) -> tuple[int, str]:
    """Status and body of a GET (redirects not followed)."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(base + path, timeout=15) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        location = f"Location: {e.headers['Location']}" if 300 <= e.code < 400 else ""
        return e.code, e.read().decode(errors="replace") + location


def page_callback(base: str, search: str) -> str:
    """What the page's refresh callback answers for a URL's query string, asked as a browser would."""
    deps = json.loads(get(base, "/_dash-dependencies")[1])
    dep = next(d for d in deps if f"{BANNER}.children" in d["output"])
    names = dep["output"].strip(".").split("...")
    outputs = [dict(zip(("id", "property"), o.rsplit(".", 1), strict=True)) for o in names]
    values = {"sw-url.search": search}
    body = {"output": dep["output"], "outputs": outputs, "changedPropIds": ["sw-url.search"],
            "inputs": [{**i, "value": values.get(f"{i['id']}.{i['property']}")} for i in dep["inputs"]],
            "state": [{**s, "value": None} for s in dep["state"]]}  # fmt: skip
    req = urllib.request.Request(base + "/_dash-update-component", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


class GrowingRun:
    """A run dir written as a job writes it: metadata first, then each rank's Arrow stream
    (rank-NNNNN.arrows) grown a batch of steps at a time. The steps are a simulated run's."""

    def __init__(self, run: Path, cfg: SimConfig, scratch: Path):
        write_run(scratch / run.name, cfg)
        self.tables = [pq.read_table(scratch / run.name / f"rank-{r:05d}.parquet") for r in range(cfg.ranks)]
        run.mkdir(parents=True)
        for meta in (scratch / run.name).glob("*.json"):
            shutil.copy(meta, run / meta.name)
        self.sinks = [pa.OSFile(str(run / f"rank-{r:05d}.arrows"), "wb") for r in range(cfg.ranks)]
        self.writers = [pa.ipc.new_stream(s, t.schema) for s, t in zip(self.sinks, self.tables, strict=True)]
        self.steps = 0

    def grow(self, steps: int) -> None:
        for sink, writer, table in zip(self.sinks, self.writers, self.tables, strict=True):
            writer.write_table(table.slice(self.steps, steps - self.steps))
            sink.flush()
        self.steps = steps

    def close(self) -> None:
        for sink, writer in zip(self.sinks, self.writers, strict=True):
            writer.close()
            sink.close()


def banner_has(driver: Any, lines: list[str]) -> bool:
    text = " ".join(text_of(driver, BANNER).split())
    return all(" ".join(line.split()) in text for line in lines)


@needs_browser
def test_service_follows_a_growing_run(browser, tmp_path: Path) -> None:  # noqa: F811
    """STRAGGLERWATCH_SOURCE a run dir (as the README's first example): the page shows the verdict of
    the steps so far, follows the run as it grows, and ends on ``analyze``'s verdict."""
    run = tmp_path / "job"
    cfg = SimConfig(ranks=8, steps=300, seed=3, injections=[Injection(5, 0.4, 150)])
    growing = GrowingRun(run, cfg, tmp_path / "sim")
    growing.grow(120)
    first = verdict_lines(analyze_run(run).report)
    assert first[0] == "no consistently slow rank."
    service = Gunicorn(tmp_path / "gunicorn.log", {"STRAGGLERWATCH_SOURCE": str(run), "STRAGGLERWATCH_POLL_S": "0.5",
                                                   "STRAGGLERWATCH_REFRESH_MS": "500"})  # fmt: skip
    try:
        service.wait_ready()
        assert f"Listening at: http://127.0.0.1:{service.port}" in service.text(), "loopback by default"
        browser.get(service.base + "/")
        wait_for(lambda: banner_has(browser, first[:1]), 45, "the first verdict")
        assert f"stragglerwatch: {run}" in text_of(browser, HEADING)
        for steps in (180, 240, 300):
            growing.grow(steps)
            time.sleep(1.0)
        growing.close()
        wait_for(lambda: "rank 5 is" in text_of(browser, BANNER), 45, "the banner to name rank 5")
        final = verdict_lines(analyze_run(run).report)
        assert "rank 5 is" in final[1]
        wait_for(lambda: banner_has(browser, final), 30, f"analyze's verdict {final}")
        assert console_errors(browser) == []
        assert get(service.base, "/?run=../job")[0] == 400 and get(service.base, "/?run=other")[0] == 404
    finally:
        service.stop()
    assert "Traceback" not in service.text(), service.text()[-3000:]


@pytest.fixture(scope="module")
def runs_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gunicorn, Path]]:
    """A directory of two runs (beta written first) beside a run outside it that a symlink points to;
    served with --preload and two workers: the sources' threads start in each worker."""
    tmp = tmp_path_factory.mktemp("service")
    root, outside = tmp / "runs", tmp / "outside"
    write_run(root / "beta", SimConfig(ranks=4, steps=160, seed=1, injections=[Injection(2, 0.4, 40)]))
    time.sleep(0.05)
    write_run(root / "alpha", SimConfig(ranks=8, steps=160, seed=2, injections=[Injection(3, 0.4, 40)]))
    write_run(outside / "secret", SimConfig(ranks=8, steps=160, seed=4, injections=[Injection(6, 0.4, 40)]))
    (root / "leak").symlink_to(outside / "secret", target_is_directory=True)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    env = {"STRAGGLERWATCH_SOURCE": str(root), "STRAGGLERWATCH_WORKERS": "2", "STRAGGLERWATCH_REFRESH_MS": "500"}
    service = Gunicorn(tmp / "gunicorn.log", env, "--preload")
    try:
        yield service.wait_ready(), root
    finally:
        service.stop()
    assert "Traceback" not in service.text(), service.text()[-3000:]


@needs_browser
def test_run_picker_lists_the_runs(browser, runs_service: tuple[Gunicorn, Path]) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    service, root = runs_service
    status, body = get(service.base, "/")
    assert status == 302 and "Location: ?run=alpha" in body, "the newest run's page"
    browser.get(service.base + "/")
    wait_for(lambda: "rank 3 is" in text_of(browser, BANNER), 45, "alpha's verdict")
    assert browser.current_url.endswith("/?run=alpha")
    wait_for(lambda: "2 runs" in text_of(browser, RUNS), 15, "the run picker")
    links = browser.find_element(By.ID, RUNS).find_elements(By.TAG_NAME, "a")
    assert [a.text for a in links] == ["alpha", "beta"], "the symlinks leading out are not listed"
    time.sleep(1.5)  # a few refreshes: the links stay the same elements while the runs do not change
    links[1].click()
    wait_for(lambda: "rank 2 is" in text_of(browser, BANNER), 45, "beta's verdict")
    assert browser.current_url.endswith("/?run=beta") and str(root / "beta") in text_of(browser, HEADING)
    assert console_errors(browser) == []


def test_names_outside_the_root_are_refused(runs_service: tuple[Gunicorn, Path]) -> None:
    service, root = runs_service
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (root / "beta").iterdir())
    for name, status in [("../x", 400), ("%2e%2e%2fetc", 400), ("..%2Foutside%2Fsecret", 400), ("..", 400),
                         ("/etc", 400), ("%2Fetc%2Fpasswd", 400), (".", 400), ("alpha/../beta", 400),
                         ("a%00b", 400), ("leak", 403), ("escape", 403), ("nope", 404),
                         ("alpha&run=beta", 400)]:  # fmt: skip
        code, body = get(service.base, f"/?run={name}")
        assert code == status, (name, code, body)
        assert body.startswith("stragglerwatch: ") and len(body.strip().splitlines()) <= 2, body
        assert "rank 6" not in body and "sim-secret" not in body
    for search in ("?run=leak", "?run=../outside/secret", "?run=%2Fetc"):  # past the page, to the callback
        answer = page_callback(service.base, search)
        assert "refused" in answer and "rank 6" not in answer and "sim-secret" not in answer, answer[:500]
    assert "rank 3 is" in page_callback(service.base, "?run=alpha")
    code, _ = get(service.base, "/?run=beta")
    assert code == 200
    with urllib.request.urlopen(service.base + "/?run=beta", timeout=15) as r:
        assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["X-Frame-Options"] == "DENY"
    after = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in (root / "beta").iterdir())
    assert after == before, "read-only"


def test_run_names_in_process(tmp_path: Path) -> None:
    """The same checks without a server: a symlink inside the root is a run, one leading out is not."""
    from stragglerwatch.presentation.dashboard.app import RunRefused

    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (root / "inside").symlink_to(root / "a")
    (root / "out").symlink_to(tmp_path / "out")
    assert run_path(root, "inside") == (root / "a").resolve()
    for name, status in [("out", 403), ("..", 400), ("a/..", 400), ("", 400), ("x" * 200, 400), ("b", 404)]:
        with pytest.raises(RunRefused) as refused:
            run_path(root, name)
        assert refused.value.status == status, name
    service = Service(ServiceConfig(source=str(root)))
    assert service.multi() and sorted(service.runs()) == ["a", "inside"]
    assert Service(ServiceConfig(source="http://prom:9090/?run=r1")).prometheus == ("http://prom:9090", "r1")
    assert "a Prometheus source is" in (Service(ServiceConfig(source="http://prom:9090")).error or "")


def test_a_window_of_steps_is_set_from_the_environment(tmp_path: Path) -> None:
    """STRAGGLERWATCH_WINDOW_STEPS: a run's source follows its last steps, and says so; one too small to hold the
    rule's look back is one line; unset, every step."""
    from stragglerwatch.presentation.dashboard.service import ConfigError

    (tmp_path / "run").mkdir()
    env = {"STRAGGLERWATCH_SOURCE": str(tmp_path / "run"), "STRAGGLERWATCH_WINDOW_STEPS": "2048"}
    config = ServiceConfig.from_env(env)
    source = Service(config).pool.get("")  # made and started, as a page's request does
    try:
        assert source.live.window == 2048 and source.label.endswith("(its last 2,048 steps)")
    finally:
        source.stop()
    with pytest.raises(ConfigError, match=r"^STRAGGLERWATCH_WINDOW_STEPS=500: a window holds at least 1024 steps"):
        ServiceConfig.from_env({"STRAGGLERWATCH_WINDOW_STEPS": "500"})
    assert ServiceConfig.from_env({}).window_steps == 0
    assert Service(ServiceConfig(source=str(tmp_path / "run")))._make("").live.window is None


def test_misconfigured_service_says_so_in_one_line(tmp_path: Path) -> None:
    """STRAGGLERWATCH_SOURCE unset: the worker logs one line and the page says so; a bad number: gunicorn
    does not start, with one line."""
    service = Gunicorn(tmp_path / "unset.log", {})
    try:
        service.wait_ready()
        assert "STRAGGLERWATCH_SOURCE is not set" in page_callback(service.base, "")
    finally:
        service.stop()
    lines = [line for line in service.text().splitlines() if "STRAGGLERWATCH_SOURCE is not set" in line]
    assert len(lines) == 1 and lines[0].startswith("stragglerwatch: error: "), service.text()
    assert "Traceback" not in service.text()
    bad = Gunicorn(tmp_path / "bad.log", {"STRAGGLERWATCH_PORT": "eighty"})
    try:
        assert bad.proc.wait(timeout=60) != 0
    finally:
        bad.stop()
    text = bad.text()
    assert "stragglerwatch: error: STRAGGLERWATCH_PORT='eighty': not an integer" in text and "Traceback" not in text


def test_a_fresh_worker_serves_every_script_of_the_first_page(tmp_path: Path) -> None:
    """A browser's first page load asks a worker for a dozen scripts at once, on as many threads. Dash
    registers the scripts it may serve at its first request, without a lock: a thread that came in
    meanwhile got a 500 ("not a registered library") and the page never ran. Every script is served."""
    import re

    write_run(tmp_path / "run", SimConfig(ranks=2, steps=20, seed=1))
    config = ServiceConfig(source=str(tmp_path / "run"))
    page = create_server(Service(config)).test_client().get("/").get_data(as_text=True)
    scripts = re.findall(r'src="(/_dash-component-suites/[^"]+)"', page)
    assert len(scripts) >= 5, page[:2000]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, as a busy worker's do: a race is lost, not dodged
    try:
        for attempt in range(3):
            statuses = load_at_once(create_server(Service(config)), scripts)
            assert statuses == dict.fromkeys(scripts, 200), f"fresh worker {attempt}: {statuses}"
    finally:
        sys.setswitchinterval(switch)


def load_at_once(server: Any, paths: list[str]) -> dict[str, int]:
    """Each path's status, fetched on its own thread, all threads let go at once."""
    import threading

    gate = threading.Barrier(len(paths))
    statuses: dict[str, int] = {}

    def load(path: str) -> None:
        client = server.test_client()
        gate.wait(timeout=30)
        statuses[path] = client.get(path).status_code

    threads = [threading.Thread(target=load, args=(path,)) for path in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return statuses
