"""The Grafana panels of the host and GPU context against a real Prometheus: two rank exporters, one
in each export mode, whose context sampler reads this host and a fake NVML (this machine has no GPU),
scraped every second; every query of the context panels must answer with its legend's labels in both.
The same scrape measures what a GPU rank costs the store in series: the lean mode must stay within 62
(what a series limit counts, Prometheus's own ``up`` and scrape series included; work measured in one
unit). (The host panels are also checked with the rest of the dashboards against the live runs in
``test_grafana.py``.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import free_ports, prom_api, wait_for
from fake_nvml import Device, FakeNVML
from synthetic_ranks import step_record
from test_grafana import queries, query_range, substitute
from test_prometheus import scrape

from stragglerwatch.presentation.grafana import context_panels, dashboards
from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.runtime.context.ctxmetrics import ContextCollector
from stragglerwatch.runtime.context.gpuctx import GpuSampler
from stragglerwatch.runtime.context.sampler import ContextSampler
from stragglerwatch.runtime.output.exporter import Exporter, RankCollector, RankMetrics

PROMETHEUS = shutil.which("prometheus")


@pytest.mark.full  # a real Prometheus
@pytest.mark.skipif(PROMETHEUS is None, reason="PROMETHEUS TESTS SKIPPED: install Debian's 'prometheus' package")
def test_context_panels_answer_from_a_real_prometheus(tmp_path: Path) -> None:
    dev = Device(index=1, uuid="GPU-1234", reasons=0x40 | 0x4, sm_clock=1200, nvlinks=2)
    sampler = ContextSampler(None, 0, open_gpu_sampler=lambda: None)
    sampler.gpu = GpuSampler(FakeNVML([dev]), 0)
    sampler.sample_once()
    ports = free_ports(3)
    modes = {"full": ports, "lean": ports + 1}
    exporters = []
    for mode, port in modes.items():
        info = RunInfo(f"gpu-{mode}", tmp_path, 0, 0, 1, "node-1")
        metrics = RankMetrics()
        metrics.observe([step_record(0, 1, time.time())._replace(work=4096.0, work_unit="tokens")])  # one step
        exporter = Exporter(RankCollector(metrics, info, lean=mode == "lean"), port, "127.0.0.1", tmp_path)
        exporter.registry.register(ContextCollector(sampler, info.run_id, 0, info.host, lean=mode == "lean"))
        exporters.append(exporter)
    config = tmp_path / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{port}'" for port in modes.values())
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: gpu\n    honor_labels: true\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n"
    )
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{ports + 2}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{ports + 2}"
    try:

        def scraped(n: int) -> bool:
            dev.pcie_replays += 5  # a degrading link, between scrapes
            sampler.sample_once()
            try:
                series = query_range(base, "stragglerwatch_gpu_pcie_replays_total", 1)
                return len(series) == 2 and all(len(s["values"]) >= n for s in series)
            except OSError:
                return False

        wait_for(lambda: scraped(4), 60, "four scrapes of the GPU series")
        stored = {mode: prom_api(base, f'count({{instance="127.0.0.1:{port}"}})') for mode, port in modes.items()}
        stored_n = {mode: int(result[0]["value"][1]) for mode, result in stored.items()}
        exported = {mode: sum(len(f.samples) for f in scrape(port).values()) for mode, port in modes.items()}
        assert stored_n["lean"] <= 62, f"a lean GPU rank costs {stored_n['lean']} series: {exported}"
        assert exported["full"] >= 4 * exported["lean"] and stored_n["full"] == exported["full"] + 5
        for mode in modes:
            check_context_panels(base, f"gpu-{mode}", mode)
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()
        for exporter in exporters:
            exporter.close()


def check_context_panels(base: str, run_id: str, mode: str) -> None:
    (clock,) = prom_api(base, f'stragglerwatch_gpu_sm_clock_hertz{{run="{run_id}"}}')
    assert {k: clock["metric"][k] for k in ("gpu", "UUID", "Hostname", "rank", "run")} == {
        "gpu": "1", "UUID": "GPU-1234", "Hostname": "node-1", "rank": "0", "run": run_id}  # fmt: skip
    panels = context_panels(1, 0)
    for where, target in queries({"panels": panels, "annotations": {"list": []}}):
        result = query_range(base, substitute(target["expr"], run_id))
        assert result, f"{mode}: {where} returned no data: {target['expr']}"
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            assert all(label in s["metric"] for s in result), f"{mode}: {where} lacks label {label!r}"
    gpu_targets = [t for _, m in dashboards().items() for _, t in queries(m) if "stragglerwatch_gpu_" in t["expr"]]
    assert len(gpu_targets) >= 7 and all(t in [u for p in panels for u in p["targets"]] for t in gpu_targets)
    (expr,) = [t["expr"] for _, t in queries(dashboards()["stragglerwatch.json"]) if "event_reason" in t["expr"]]
    reasons = {s["metric"]["reason"] for s in query_range(base, substitute(expr, run_id))}
    assert reasons == {"sw_power_cap", "hw_thermal_slowdown"}, f"{mode}: only the reasons that hold the clocks down"
