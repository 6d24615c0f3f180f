"""The Grafana panels of the host and GPU context against a real Prometheus: a rank exporter whose
context sampler reads this host and a fake NVML (this machine has no GPU), scraped every second;
every query of the context panels must answer with its legend's labels. (The host panels are also
checked with the rest of the dashboards against the live 4-rank job in ``test_grafana.py``.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import free_ports, prom_api, wait_for
from fake_nvml import Device, FakeNVML
from test_grafana import queries, query_range, substitute

from stragglerwatch.ctxmetrics import ContextCollector
from stragglerwatch.exporter import Exporter, RankCollector, RankMetrics
from stragglerwatch.gpuctx import GpuSampler
from stragglerwatch.grafana import context_panels, dashboards
from stragglerwatch.runinfo import RunInfo
from stragglerwatch.sampler import ContextSampler

PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="PROMETHEUS TESTS SKIPPED: install Debian's 'prometheus' package")
def test_context_panels_answer_from_a_real_prometheus(tmp_path: Path) -> None:
    dev = Device(index=1, uuid="GPU-1234", reasons=0x40 | 0x4, sm_clock=1200, nvlinks=2)
    sampler = ContextSampler(None, 0, open_gpu_sampler=lambda: None)
    sampler.gpu = GpuSampler(FakeNVML([dev]), 0)
    sampler.sample_once()
    info = RunInfo("gpurun", tmp_path, 0, 0, 1, "node-1")
    port, prom_port = free_ports(1), free_ports(1)
    exporter = Exporter(RankCollector(RankMetrics(), info), port, "127.0.0.1", tmp_path)
    exporter.registry.register(ContextCollector(sampler, info.run_id, 0, info.host))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: gpu\n    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{prom_port}"
    try:

        def scraped(n: int) -> bool:
            dev.pcie_replays += 5  # a degrading link, between scrapes
            sampler.sample_once()
            try:
                return len(query_range(base, "stragglerwatch_gpu_pcie_replays_total", 1)[0]["values"]) >= n
            except (OSError, IndexError):
                return False

        wait_for(lambda: scraped(4), 60, "four scrapes of the GPU series")
        (clock,) = prom_api(base, "stragglerwatch_gpu_sm_clock_hertz")
        assert {k: clock["metric"][k] for k in ("gpu", "UUID", "Hostname", "rank", "run")} == {
            "gpu": "1", "UUID": "GPU-1234", "Hostname": "node-1", "rank": "0", "run": "gpurun"}  # fmt: skip
        panels = context_panels(1, 0)
        for where, target in queries({"panels": panels, "annotations": {"list": []}}):
            result = query_range(base, substitute(target["expr"], info.run_id))
            assert result, f"{where} returned no data: {target['expr']}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                assert all(label in s["metric"] for s in result), f"{where} lacks label {label!r}"
        gpu_targets = [t for _, m in dashboards().items() for _, t in queries(m) if "stragglerwatch_gpu_" in t["expr"]]
        assert len(gpu_targets) >= 7 and all(t in [u for p in panels for u in p["targets"]] for t in gpu_targets)
        (expr,) = [t["expr"] for _, t in queries(dashboards()["stragglerwatch.json"]) if "event_reason" in t["expr"]]
        reasons = {s["metric"]["reason"] for s in query_range(base, substitute(expr, info.run_id))}
        assert reasons == {"sw_power_cap", "hw_thermal_slowdown"}, "only the reasons that hold the clocks down"
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()
        exporter.close()
