"""The dashboard in a real headless Chromium shows the chosen rank's host and GPU context beside its
busy time, and the verdict's reason in the banner."""

from __future__ import annotations

from pathlib import Path

from conftest import wait_for
from test_dashboard import browser, console_errors, needs_browser, serve, text_of  # noqa: F401 - browser: a fixture
from test_explain import sim_run_with_context

from stragglerwatch.presentation.dashboard.app import BAND, BANNER, CONTEXT


@needs_browser
def test_context_beside_the_busy_time(browser, tmp_path: Path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    run = tmp_path / "sim"
    sim_run_with_context(run)
    server = serve(run)
    try:
        browser.get(server.url)
        wait_for(lambda: "rank 1 is" in text_of(browser, BANNER), 60, "the banner to name rank 1")
        assert "why: its training thread waited for a CPU 55% of the time" in text_of(browser, BANNER)
        wait_for(lambda: "Host and GPU context: rank 1" in text_of(browser, CONTEXT), 30, "the context figure")
        band, context = browser.find_element(By.ID, BAND), browser.find_element(By.ID, CONTEXT)
        assert context.find_elements(By.CSS_SELECTOR, ".main-svg .scatterlayer .trace")
        assert abs(band.location["y"] - context.location["y"]) < 5 and context.location["x"] > band.location["x"]
        assert "training thread waiting for a CPU" in text_of(browser, CONTEXT)
        assert console_errors(browser) == []
    finally:
        server.stop()
