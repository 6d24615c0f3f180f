"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver), on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EXAMPLE, ROOT, free_ports, wait_for

from stragglerwatch.cli.dashboard import DashboardServer
from stragglerwatch.presentation.dashboard import RunDirSource, Snapshot
from stragglerwatch.presentation.dashboard.app import (
    BANNER,
    BREAKDOWN,
    HEATMAP,
    IMBALANCE,
    TABLE,
    TABLE_COLUMNS,
    WORK,
    WORK_ROW,
    render,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="BROWSER TESTS SKIPPED: install Debian's 'chromium' and 'chromium-driver' (scripts/setup.sh does as root)",
)


@pytest.fixture
def browser(tmp_path: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chrome'}", "--window-size=1300,2400"):  # fmt: skip
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def text_of(driver, element_id: str) -> str:
    """The element's text, or "" while Dash has not rendered it yet."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.ID, element_id).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def serve(run: Path) -> DashboardServer:
    return DashboardServer(RunDirSource(run, interval_s=1.0), "127.0.0.1", 0, refresh_ms=1000).start()


@needs_browser
@pytest.mark.distributed
def test_live_run_banner_names_the_straggler(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    run = tmp_path / "run"
    run.mkdir()
    server = serve(run)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
         "--steps", "400", "--slow-rank", "2", "--delay", "0.02", "--from-step", "20", "--run-dir", str(run)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        browser.get(server.url)
        t0 = time.monotonic()
        wait_for(lambda: "rank 2 is" in text_of(browser, BANNER), 120, "the banner to name rank 2")
        named_after = time.monotonic() - t0
        banner = text_of(browser, BANNER)
        assert "cause: compute" in banner and "straggler" in banner
        for graph in (HEATMAP, BREAKDOWN):
            plot = browser.find_element(By.ID, graph)
            assert plot.find_elements(By.CSS_SELECTOR, ".main-svg"), f"{graph} rendered"
        bars = browser.find_element(By.ID, BREAKDOWN).find_elements(By.CSS_SELECTOR, ".bars .point")
        assert len(bars) >= 4 * 5, "a stacked bar per rank"
        assert browser.find_element(By.ID, HEATMAP).find_elements(By.CSS_SELECTOR, ".hm, image, .heatmaplayer")
        rows = browser.find_element(By.ID, TABLE).find_elements(By.CSS_SELECTOR, "tr")
        assert len(rows) >= 5
        assert console_errors(browser) == []
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        print(f"banner named rank 2 after {named_after:.1f} s")
    finally:
        job.terminate()
        job.wait(timeout=30)
        server.stop()


@needs_browser
def test_empty_run_dir_shows_an_empty_state(browser, tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    server = serve(run)
    try:
        browser.get(server.url)
        wait_for(lambda: "Waiting for data" in text_of(browser, BANNER), 30, "the empty state")
        assert "No step recorded yet" in text_of(browser, BANNER)
        assert console_errors(browser) == []
    finally:
        server.stop()


@needs_browser
def test_finished_run_opened_later(browser, compute_run: Path) -> None:
    server = serve(compute_run)
    try:
        browser.get(server.url)
        wait_for(lambda: "rank 2 is" in text_of(browser, BANNER), 30, "the banner")
        assert "cause: compute" in text_of(browser, BANNER)
        assert "code: of its extra" in text_of(browser, BANNER) and "demo_job.py" in text_of(browser, BANNER)
        assert console_errors(browser) == []
    finally:
        server.stop()


def test_render_is_pure_and_bounded(make_run) -> None:
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    run = make_run(1).parent / "sim"
    write_run(run, SimConfig(ranks=300, steps=500, injections=[Injection(7, 0.3, 100)]))
    snap = Snapshot(analyze_run(run))
    out = render(snap, None)
    heat = out["heatmap"].data[0]
    assert len(heat.z) <= 256 and len(heat.z[0]) <= 400, "aggregated on the server"
    assert [t.name for t in out["band"].data][-1] == "rank 7", "the flagged rank by default"
    assert len(out["rows"]) == 300 and len(out["options"]) == 300
    assert render(snap, 5)["band"].data[-1].name == "rank 5"


def test_prometheus_source_unreachable_keeps_an_empty_state() -> None:
    import socket

    from stragglerwatch.presentation.dashboard import PrometheusSource
    from stragglerwatch.presentation.dashboard.app import banner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = PrometheusSource(f"http://127.0.0.1:{port}", "run")
    source.refresh()
    snap = source.snapshot()
    assert snap.empty and snap.error and "cannot query" in snap.error
    children, _ = banner(snap, source.label)
    assert "Last refresh failed" in str(children)


@pytest.mark.distributed
def test_demo_command(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "stragglerwatch.cli", "demo", "--steps", "120", "--from-step", "20", "--exit",
         "--port", str(free_ports(1)), "--run-dir", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "demo: dashboard http://127.0.0.1:" in out.stdout
    assert "rank 2 is" in out.stdout and "cause: compute" in out.stdout


def test_banner_says_busy_time_unavailable(make_run) -> None:
    """A rank that could not see its communication: the banner says so instead of naming a straggler."""
    import json

    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.presentation.dashboard.app import CAUTION_STYLE, banner
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    run = make_run(1).parent / "sim"
    write_run(run, SimConfig(ranks=8, steps=200, injections=[Injection(3, 0.3, 50)]))
    assert [s["rank"] for s in analyze_run(run).report["stragglers"]] == [3]
    meta_path = run / "rank-00005.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "busy_unavailable": ["FSDP2 (fully_shard): not timed"]}))
    snap = Snapshot(analyze_run(run))
    children, style = banner(snap, "sim")
    text = " ".join(str(c.children) for c in children)
    assert "busy time unavailable: FSDP2 (fully_shard): not timed (rank 5)" in text and "rank 3 is" not in text
    assert style == CAUTION_STYLE
    out = render(snap, None)
    assert out["rows"] and all(r["flagged"] == "" for r in out["rows"])


def imbalanced_run(run: Path, **config) -> Path:
    """A simulated run whose ranks draw batches of unequal tokens (a different rank the heaviest each step)."""
    from stragglerwatch.record.simulate import SimConfig, write_run

    return write_run(run, SimConfig(ranks=8, steps=300, seed=1, tokens=4096, **config))


@needs_browser
def test_work_and_imbalance_figures(browser, tmp_path: Path) -> None:
    """A run that recorded work per step: the banner gives the imbalance cost, the work per step and busy
    time against work are drawn side by side, and the table has the work columns (a run without work
    shows neither: ``test_render_shows_work_only_where_recorded``)."""
    from selenium.webdriver.common.by import By

    run = imbalanced_run(tmp_path / "sim")
    server = serve(run)
    try:
        browser.get(server.url)
        wait_for(lambda: "imbalance cost" in text_of(browser, BANNER), 60, "the banner to give the imbalance cost")
        banner = text_of(browser, BANNER)
        assert "load imbalance: ranks got unequal tokens in the same step" in banner and "try:" in banner
        assert "work size explains" in banner
        wait_for(lambda: "Work per step (tokens)" in text_of(browser, WORK), 30, "the work figure")
        wait_for(lambda: "Busy time vs work" in text_of(browser, IMBALANCE), 30, "the imbalance figure")
        work, imbalance = browser.find_element(By.ID, WORK), browser.find_element(By.ID, IMBALANCE)
        assert browser.find_element(By.ID, WORK_ROW).is_displayed() and work.is_displayed()
        assert work.find_elements(By.CSS_SELECTOR, ".hm, image, .heatmaplayer"), "a heatmap"
        assert len(imbalance.find_elements(By.CSS_SELECTOR, ".scatterlayer .trace")) >= 2, "points and slope"
        assert imbalance.find_elements(By.CSS_SELECTOR, ".scatterlayer .point")
        assert abs(work.location["y"] - imbalance.location["y"]) < 5 and imbalance.location["x"] > work.location["x"]
        assert "tokens/step" in text_of(browser, TABLE) and "busy µs/token" in text_of(browser, TABLE)
        assert console_errors(browser) == []
    finally:
        server.stop()


def test_render_shows_work_only_where_recorded(tmp_path: Path) -> None:
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.presentation.dashboard.app import CAUTION_STYLE, banner
    from stragglerwatch.record.simulate import SimConfig, write_run

    snap = Snapshot(analyze_run(imbalanced_run(tmp_path / "sim")))
    out = render(snap, None)
    assert out["work_style"]["display"] == "grid"
    assert out["work"].data[0].type == "heatmap" and len(out["work"].data[0].z) == 8
    assert [t.name for t in out["imbalance"].data][0] == "healthy ranks' steps"
    assert out["imbalance"].data[-1].name.startswith("healthy slope:")
    names = [c["name"] for c in out["columns"]]
    assert names[-4:] == ["tokens/step", "busy µs/token", "busy vs peers", "flagged"]
    assert all(r["work"] > 0 and r["busy_per_work_us"] > 0 for r in out["rows"])
    children, style = banner(snap, "sim")
    assert style == CAUTION_STYLE, "load imbalance is no rank at fault, and no healthy run either"
    assert any("imbalance cost" in str(c.children) for c in children)
    plain = Snapshot(analyze_run(write_run(tmp_path / "plain", SimConfig(ranks=8, steps=100, seed=1))))
    out = render(plain, None)
    assert out["work_style"]["display"] == "none" and out["columns"] == [{"name": t, "id": k} for k, t in TABLE_COLUMNS]


def test_work_figures_are_bounded() -> None:
    """1,000 ranks x 2,000 steps: the work heatmap is binned and the scatter sampled, on the server."""
    import numpy as np

    from stragglerwatch.analysis.detect import MATRIX_COLUMNS, StepMatrix, detect
    from stragglerwatch.presentation import figures
    from stragglerwatch.record.simulate import SimConfig, simulate_arrays

    cfg = SimConfig(ranks=1000, steps=2000, seed=3, tokens=2048)
    values = simulate_arrays(cfg)
    for col in MATRIX_COLUMNS:
        values.setdefault(col, np.full((cfg.steps, cfg.ranks), np.nan))
    mat = StepMatrix(np.arange(cfg.ranks), np.arange(cfg.steps), values, work_unit="tokens")
    verdict = detect(mat)
    heat = figures.work_heatmap(mat).data[0]
    assert len(heat.z) <= figures.MAX_RANK_ROWS and len(heat.z[0]) <= figures.MAX_STEP_COLS
    assert "steps binned" in figures.work_heatmap(mat).layout.title.text
    scatter = figures.busy_vs_work(mat, verdict)
    assert scatter.data and all(len(t.x) <= figures.MAX_SCATTER for t in scatter.data)
    empty = StepMatrix(mat.ranks[:2], mat.steps[:2], {c: v[:2, :2] * np.nan for c, v in values.items()})
    assert "no work per step recorded" in figures.busy_vs_work(empty, detect(empty)).layout.annotations[0].text


def test_a_long_run_s_figures_read_a_bounded_sample_of_steps_spread_over_each_bin() -> None:
    """Past ``SAMPLE_ROWS`` steps, each bin of a heatmap or of the band is the mean of the same number of its
    steps, spread evenly over it: what a figure reads does not grow with the run, and the picture is the
    exact one's (a straggler's bins stand out by its slowdown, the others' stay at 1)."""
    import numpy as np

    from stragglerwatch.analysis.detect import MATRIX_COLUMNS, StepMatrix, detect
    from stragglerwatch.presentation import figures
    from stragglerwatch.record.simulate import Injection, SimConfig, simulate_arrays

    starts = figures._bins(20000, figures.MAX_STEP_COLS)
    rows, first = figures._sampled(20000, starts)
    per_bin = figures.SAMPLE_ROWS // len(starts)
    assert len(rows) == per_bin * len(starts) and np.all(np.diff(rows) > 0)
    assert np.array_equal(first, np.arange(len(starts)) * per_bin)
    widths = np.diff(np.append(starts, 20000))
    strata = (rows.reshape(len(starts), per_bin) - starts[:, None]) * per_bin // widths[:, None]
    assert np.array_equal(strata, np.tile(np.arange(per_bin), (len(starts), 1))), "one step from each stratum"
    assert np.array_equal(figures._sampled(20000, starts)[0], rows), "the same rows at every refresh"
    assert figures._sampled(2000, figures._bins(2000, 400))[0] is None, "a short run: every step"
    # a rank slow every 4th step, bins of 40 steps read 5 at a time: not always in its slow (or fast) steps
    n = 16000
    starts = figures._bins(n, figures.MAX_STEP_COLS)
    rows, first = figures._sampled(n, starts)
    periodic = np.where(np.arange(n) % 4 == 0, 2.0, 1.0)[:, None]
    means = figures._reduce(periodic[rows], first, 0, "mean")[:, 0]
    assert abs(means.mean() - 1.25) < 0.05 and means.min() < 1.25 < means.max(), means

    cfg = SimConfig(ranks=48, steps=12000, seed=5, injections=[Injection(9, 0.3, 4000)])
    values = simulate_arrays(cfg)
    for col in MATRIX_COLUMNS:
        values.setdefault(col, np.full((cfg.steps, cfg.ranks), np.nan))
    mat = StepMatrix(np.arange(cfg.ranks), np.arange(cfg.steps), values)
    verdict = detect(mat)
    z = np.array(figures.heatmap(mat, verdict).data[0].z, dtype=float)  # ranks x step bins
    sb = figures._bins(cfg.steps, figures.MAX_STEP_COLS)
    exact = np.add.reduceat(verdict.slowdown, sb, axis=0) / np.diff(np.append(sb, cfg.steps))[:, None]
    after = sb >= 4100
    assert np.nanmedian(z[9, after]) > 1.2 and abs(np.nanmedian(z[9, after]) - np.nanmedian(exact[after, 9])) < 0.03
    others = np.delete(z, 9, axis=0)
    assert abs(np.nanmedian(others) - 1.0) < 0.03
    error = np.abs(z - exact.T)  # a bin's mean of a sample against the bin's mean (a spike shows in one, not both)
    assert np.nanmedian(error) < 0.02 and np.nanpercentile(error, 99) < 0.08, np.nanpercentile(error, [50, 99])
    band = figures.busy_band(mat, verdict)
    assert [t.name for t in band.data][-1] == "rank 9" and len(band.data[-1].y) == figures.MAX_POINTS


def test_the_peers_band_of_thousands_of_ranks_is_drawn_from_a_spread_sample(monkeypatch) -> None:
    """Past ``SAMPLE_RANKS`` ranks, the band around a rank's busy time is drawn from that many ranks spread over
    the job (never the chosen one; the same ones at every refresh): its lines are the whole job's, within the
    noise of a sample."""
    import numpy as np

    from stragglerwatch.analysis.detect import MATRIX_COLUMNS, StepMatrix, detect
    from stragglerwatch.presentation import figures
    from stragglerwatch.record.simulate import Injection, SimConfig, simulate_arrays

    peers = figures._peers(3000, [7])
    assert len(peers) == figures.SAMPLE_RANKS and 7 not in peers and np.all(np.diff(peers) > 0)
    assert peers[0] == 0 and peers[-1] == 2999 and np.array_equal(peers, figures._peers(3000, [7]))
    assert np.array_equal(figures._peers(40, [3]), np.delete(np.arange(40), 3)), "a small job: every other rank"
    cfg = SimConfig(ranks=2000, steps=300, seed=6, offset=0.1, injections=[Injection(7, 0.4, 0)])
    values = simulate_arrays(cfg)
    for col in MATRIX_COLUMNS:
        values.setdefault(col, np.full((cfg.steps, cfg.ranks), np.nan))
    mat = StepMatrix(np.arange(cfg.ranks), np.arange(cfg.steps), values)
    verdict = detect(mat)
    sampled = figures.busy_band(mat, verdict, [7])
    monkeypatch.setattr(figures, "SAMPLE_RANKS", 10**6)
    every = figures.busy_band(mat, verdict, [7])
    assert [t.name for t in sampled.data] == [t.name for t in every.data] == [None, "peers 10-90%", "peers median",
                                                                              "rank 7"]  # fmt: skip
    for a, b in zip(sampled.data[:3], every.data[:3], strict=True):  # the 90% line, the 10% line, the median
        ours, whole = np.array(a.y, dtype=float), np.array(b.y, dtype=float)
        assert np.median(np.abs(ours / whole - 1.0)) < 0.01 and np.max(np.abs(ours / whole - 1.0)) < 0.03
    assert np.array_equal(np.array(sampled.data[3].y), np.array(every.data[3].y)), "the rank's own line: every step"
    assert np.median(np.array(sampled.data[3].y) / np.array(sampled.data[2].y)) > 1.25  # it stands out


def test_the_page_s_content_is_made_ahead_as_soon_as_the_source_holds_a_new_analysis() -> None:
    """Once a page asked for a source, its content for the page's rank is made on a thread as soon as the source
    holds a new snapshot: the page's next ask gets it without making it again, and an ask while it is being made
    waits for it. A source no page asks for is no longer followed."""
    import threading

    from stragglerwatch.analysis.report import empty_analysis
    from stragglerwatch.presentation.dashboard.prerender import Prerender

    class Source:
        label = "run-a"

        def __init__(self) -> None:
            self.snap = Snapshot(empty_analysis(), version=1)

        def snapshot(self) -> Snapshot:
            return self.snap

    made: list[tuple[int, int]] = []
    slow = threading.Event()

    def make(snap: Snapshot, rank: int) -> dict:
        made.append((snap.version, rank))
        if snap.version == 3:
            slow.wait(5)  # being made while the page asks
        return {"version": snap.version, "rank": rank}

    source, ahead = Source(), Prerender(make, look_s=0.01, keep_s=2.0)
    assert ahead.content(source, source.snapshot(), 7) == {"version": 1, "rank": 7}
    assert ahead.content(source, source.snapshot(), 7) == {"version": 1, "rank": 7} and made == [(1, 7)]
    source.snap = Snapshot(empty_analysis(), version=2)  # the source's update: no page asks meanwhile
    wait_for(lambda: (ahead.made("run-a") or ((0, 0), None))[0] == (2, 7), 10, "the content of version 2")
    assert made == [(1, 7), (2, 7)], "made on the thread, for the rank the page showed"
    assert ahead.content(source, source.snapshot(), 7) == {"version": 2, "rank": 7} and len(made) == 2
    source.snap = Snapshot(empty_analysis(), version=3)
    wait_for(lambda: (3, 7) in made, 10, "the making of version 3")
    asked: list[dict] = []
    page = threading.Thread(target=lambda: asked.append(ahead.content(source, source.snapshot(), 7)))
    page.start()
    time.sleep(0.1)
    assert not asked, "the page waits for the content being made"
    slow.set()
    page.join(10)
    assert asked == [{"version": 3, "rank": 7}] and made.count((3, 7)) == 1, "not made twice"
    assert ahead.content(source, source.snapshot(), 2) == {"version": 3, "rank": 2}, "another rank: made for it"
    wait_for(lambda: ahead.made("run-a") is None, 10, "the source dropped")  # no page asked for 2 s
    source.snap = Snapshot(empty_analysis(), version=4)
    time.sleep(0.2)
    assert (4, 2) not in made


def test_content_that_failed_to_be_made_is_made_again_at_the_next_ask() -> None:
    """A failure to make the page's content is the page's error for that ask, not for good."""
    from stragglerwatch.analysis.report import empty_analysis
    from stragglerwatch.presentation.dashboard.prerender import Prerender

    class Source:
        label = "run-b"
        snap = Snapshot(empty_analysis(), version=1)

        def snapshot(self) -> Snapshot:
            return self.snap

    calls: list[int] = []

    def make(snap: Snapshot, rank: int) -> dict:
        calls.append(rank)
        if len(calls) == 1:
            raise RuntimeError("the arrays moved")
        return {"rank": rank}

    ahead = Prerender(make, look_s=0.01, keep_s=1.0)
    with pytest.raises(RuntimeError, match="the arrays moved"):
        ahead.content(Source(), Source.snap, 3)
    assert ahead.content(Source(), Source.snap, 3) == {"rank": 3}
    assert ahead.content(Source(), Source.snap, 3) == {"rank": 3} and calls == [3, 3]


def test_a_poll_in_the_middle_of_a_flush_publishes_nothing_and_polls_again_soon(tmp_path: Path) -> None:
    """The ranks write a flush one after another: a poll that finds part of it publishes no new version (the
    rows wait for the rest), and the source polls again sooner than its period, for the rest."""
    from stragglerwatch.record.simulate import GrowingRun, SimConfig

    run = GrowingRun(tmp_path / "run", SimConfig(ranks=6, steps=200, seed=2))
    run.flush(100)
    source = RunDirSource(tmp_path / "run", interval_s=0.5)
    source.live.hold_s = 30.0
    source.refresh()
    first = source.snapshot()
    assert first.analysis.report["steps"] == 100 and source._wait_s() == 0.5
    run.flush(120, ranks=range(3))
    source.refresh()
    assert source.snapshot().version == first.version and source._wait_s() == pytest.approx(0.1)
    # a rank that stopped writing: a few early polls, then the period again
    waits = []
    for _ in range(3):
        source.refresh()
        waits.append(source._wait_s())
    assert waits == pytest.approx([0.1, 0.1, 0.5])
    run.flush(120)
    source.refresh()
    assert source.snapshot().version == first.version + 1 and source.snapshot().analysis.report["steps"] == 120
    assert source._wait_s() == 0.5
