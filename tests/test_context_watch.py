"""The context sampler inside attach(): its thread, its stream in the run dir, its setting, its
Prometheus series (DCGM's GPU labels), and that nothing of it reaches training."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import free_ports, wait_for
from fake_nvml import Device, FakeNVML
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import stragglerwatch
from stragglerwatch.record.context import REASONS, load_context
from stragglerwatch.runtime.context.ctxmetrics import ContextCollector
from stragglerwatch.runtime.context.sampler import ContextSampler


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_attach_samples_context_into_the_run_dir_and_the_exporter(tmp_path: Path) -> None:
    port = free_ports(1)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    watch = stragglerwatch.attach(model, run, optimizer=opt, prometheus_port=port, prometheus_addr="127.0.0.1")
    try:
        sampler = watch._context
        assert sampler is not None and sampler._thread.name == "stragglerwatch-context-0"
        assert sampler._thread is not threading.current_thread() and sampler._thread.daemon
        deadline = time.monotonic() + 30
        while watch.stats()["context_samples"] < 2 and time.monotonic() < deadline:  # train while it samples
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        assert watch.stats()["context_samples"] >= 2
        families = scrape(port)
        labels = {"run": watch.info.run_id, "rank": "0", "host": socket.gethostname()}
        for name in (
            "stragglerwatch_process_run_delay_ratio",
            "stragglerwatch_process_involuntary_switches_per_second",
            "stragglerwatch_process_cpu_ratio",
            "stragglerwatch_host_load1",
            "stragglerwatch_context_samples",
        ):
            (sample,) = families[name].samples
            assert sample.labels == labels, name
        # a sample must fit inside its 1 s interval (about 0.02 s; on a 2-core machine loaded by
        # other tests it took up to 0.51 s)
        assert families["stragglerwatch_context_sample_seconds"].samples[0].value < 1.0
        assert not [n for n in families if n.startswith("stragglerwatch_gpu_")], "a CPU rank has no GPU context"
    finally:
        watch.close()  # also when an assertion failed: no hooks left for the next test
    assert (run / "context-00000.parquet").exists() and not (run / "context-00000.arrows").exists()
    frame = load_context(run)
    assert len(frame) >= 2 and (frame["rank"] == 0).all() and (frame["gpu"] == -1).all()
    assert frame["cpu_time"].iloc[-1] > 0 and frame["affinity_cpus"].iloc[-1] >= 1
    assert watch.stats()["problems"] == {}


def test_context_interval_setting(tmp_path: Path) -> None:
    with pytest.raises(stragglerwatch.ConfigError, match="context_interval_s must be >= 1"):
        stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "a", context_interval_s=0.5)
    off = stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "b", context_interval_s=0)
    assert off._context is None
    off.close()
    assert not list((tmp_path / "b").glob("context-*"))
    slow = stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "c", context_interval_s=5)
    assert slow._context.interval_s == 5.0
    slow.close()
    assert stragglerwatch.Config().context_interval_s == 1.0


def test_a_failing_sample_is_one_line_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        calls = 0

        def sample(self) -> dict:
            Broken.calls += 1
            if Broken.calls > 1:
                raise RuntimeError("our bug")
            return {}

    sampler = ContextSampler(None, 0, host=Broken(), open_gpu_sampler=lambda: None)
    sampler.interval_s = 0.05  # the thread's pace, for the test only
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        sampler.start()
        wait_for(lambda: sampler.errors >= 3, 10, "three failed samples")
        sampler.close(timeout_s=5)
    assert not sampler._thread.is_alive()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "RuntimeError: our bug" in lines[0] and "training continues" in lines[0]
    assert sampler.problems.counts["context-sample"] >= 3


def test_gpu_rank_finds_its_device_through_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVML([Device(index=0, uuid="GPU-a"), Device(index=1, uuid="GPU-b", reasons=0x4)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = ContextSampler(None, 1, gpu_index=1)
    sampler._start_gpu()
    row = sampler.sample_once()
    assert (row["gpu"], row["gpu_uuid"], row["clock_reasons"]) == (1, "GPU-b", 0x4)
    sampler.close()
    assert fake.initialized == 0


def test_gpu_series_carry_dcgm_labels() -> None:
    dev = Device(index=2, uuid="GPU-abc", reasons=0x40 | 0x20, sm_clock=1200, pcie_replays=7, nvlinks=2)
    sampler = ContextSampler(None, 5, open_gpu_sampler=lambda: None)
    from stragglerwatch.runtime.context.gpuctx import GpuSampler

    sampler.gpu = GpuSampler(FakeNVML([dev]), 0)
    sampler.sample_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ContextCollector(sampler, "r1", 5, "node-7"))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    gpu = {"run": "r1", "rank": "5", "host": "node-7", "gpu": "2", "UUID": "GPU-abc", "Hostname": "node-7"}
    (clock,) = families["stragglerwatch_gpu_sm_clock_hertz"].samples
    assert clock.labels == gpu and clock.value == 1.2e9
    reasons = {s.labels["reason"]: s.value for s in families["stragglerwatch_gpu_clock_event_reason"].samples}
    assert set(reasons) == set(REASONS.values())
    assert {r for r, v in reasons.items() if v == 1.0} == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    (replays,) = families["stragglerwatch_gpu_pcie_replays"].samples
    assert replays.name == "stragglerwatch_gpu_pcie_replays_total" and replays.value == 7
    ecc = {s.labels["type"] for s in families["stragglerwatch_gpu_ecc_errors"].samples}
    assert ecc == {"uncorrected", "corrected"}
    assert families["stragglerwatch_host_load1"].samples[0].labels == {"run": "r1", "rank": "5", "host": "node-7"}
