"""The context sampler's parts: GPU decoding through a fake NVML (the real library's names and
signatures), the host sampler on a real and on a fake, restricted or garbled ``/proc``, and the
context stream written and read back."""

from __future__ import annotations

import inspect
import logging
import math
import sys
import warnings
from pathlib import Path

import pytest
from fake_nvml import Device, FakeNVML

from stragglerwatch.record.context import COLUMNS, REASONS, decode_reasons, load_context
from stragglerwatch.record.steplog import RunDirWarning
from stragglerwatch.runtime.context.gpuctx import GpuSampler, open_gpu
from stragglerwatch.runtime.context.hostctx import HostSampler, cpu_list, cpu_list_text
from stragglerwatch.runtime.context.sampler import ContextSampler
from stragglerwatch.runtime.log import Problems

NAN_FIELDS = ("sm_clock_mhz", "temperature_c", "power_w", "pcie_replays")


def test_fake_nvml_has_the_real_names_signatures_and_values() -> None:
    real = pytest.importorskip("pynvml")
    fake = FakeNVML([])
    for name in [n for n in dir(fake) if n.startswith("nvml") and callable(getattr(fake, n))]:
        assert hasattr(real, name), name
        params = list(inspect.signature(getattr(fake, name)).parameters)
        assert params == list(inspect.signature(getattr(real, name)).parameters), name
    for name in [n for n in dir(fake) if n.isupper() or n.startswith("nvmlClocksEventReason")]:
        if not callable(getattr(fake, name)):
            assert getattr(real, name) == getattr(fake, name), name
    assert real.nvmlEventTypeXidCriticalError == fake.nvmlEventTypeXidCriticalError
    ours = {bit: name for bit, name in REASONS.items()}
    theirs = {getattr(real, n): n for n in dir(real) if n.startswith("nvmlClocksEventReason") and n[21:] not in
              ("None", "All", "UserDefinedClocks")}  # fmt: skip
    assert set(ours) == set(theirs)
    for bit, name in ours.items():  # hw_thermal_slowdown <-> nvmlClocksEventReasonHwThermalSlowdown
        assert theirs[bit][21:].lower() == name.replace("_", ""), (bit, name)


def test_throttle_bitmasks_decode_to_names() -> None:
    assert decode_reasons(0) == []
    assert decode_reasons(0x1) == ["gpu_idle"]
    assert decode_reasons(0x40 | 0x4) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_reasons(0x8 | 0x80 | 0x20) == ["hw_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"]
    assert decode_reasons(0x10 | 0x2 | 0x100) == ["applications_clocks_setting", "sync_boost", "display_clock_setting"]
    assert decode_reasons(0x40 | 0x1000) == ["hw_thermal_slowdown", "0x1000"]
    assert decode_reasons(-1) == []
    fake = FakeNVML([Device(reasons=0x40 | 0x20, sm_clock=1200)])
    row = GpuSampler(fake, 0).sample()
    assert row["clock_reasons"] == 0x60 and row["sm_clock_mhz"] == 1200.0 and row["sm_clock_max_mhz"] == 1980.0
    assert decode_reasons(row["clock_reasons"]) == ["sw_thermal_slowdown", "hw_thermal_slowdown"]


def test_gpu_fields_and_a_degraded_pcie_link() -> None:
    dev = Device(index=3, uuid="GPU-aaaa", temperature=71, power_mw=650_000, nvlinks=4, nvlink_errors=2)
    fake = FakeNVML([dev])
    gpu = GpuSampler(fake, 0)
    first = gpu.sample()
    assert (first["gpu"], first["gpu_uuid"], first["temperature_c"]) == (3, "GPU-aaaa", 71.0)
    assert (first["power_w"], first["power_limit_w"], first["gpu_util"]) == (650.0, 700.0, 0.95)
    assert first["nvlink_errors"] == 4 * 4 * 2, "every counter of every active link"
    assert first["ecc_uncorrected"] == 0 and first["pcie_replays"] == 0
    old = GpuSampler(FakeNVML([dev], old_driver=True), 0)  # no nvmlDeviceGetTemperatureV in its library
    assert old.sample()["temperature_c"] == 71.0 and "nvmlDeviceGetTemperatureV" in old._unsupported
    replays = []
    for _ in range(5):  # the link degrades: the replay counter rises
        dev.pcie_replays += 40
        dev.ecc[0] += 3
        replays.append(gpu.sample()["pcie_replays"])
    assert replays == [40.0, 80.0, 120.0, 160.0, 200.0]
    assert gpu.sample()["ecc_corrected"] == 15.0


def test_xid_events_are_drained_without_waiting(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNVML([Device(), Device(index=1, uuid="GPU-b")])
    gpu = GpuSampler(fake, 1)
    assert gpu.sample()["xid_events"] == 0
    fake.xid(1, 79)
    fake.xid(0, 13)  # another GPU's: not ours
    row = gpu.sample()
    assert (row["xid_events"], row["xid"]) == (1, 79)
    assert gpu.sample()["xid_events"] == 1, "a cumulative count"
    assert set(fake.calls) == {"wait 0"}, "never blocks"
    quiet = GpuSampler(FakeNVML([Device()], events_supported=False), 0)  # registering refused: no XIDs
    assert quiet.sample()["xid_events"] == 0 and quiet._events is None
    assert not caplog.records


def test_unsupported_queries_are_nan_silent_and_not_asked_again(caplog: pytest.LogCaptureFixture) -> None:
    dev = Device(sm_clock=None, temperature=None, power_mw=None, pcie_replays=None, ecc=None, reasons=None)
    fake = FakeNVML([dev])
    gpu = GpuSampler(fake, 0)
    for _ in range(3):
        row = gpu.sample()
    assert all(math.isnan(row[f]) for f in NAN_FIELDS) and row["clock_reasons"] == -1
    assert math.isnan(row["nvlink_errors"]) and "nvmlDeviceGetClockInfo" in gpu._unsupported
    assert not caplog.records


def test_fake_injected_in_place_of_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = [Device(index=i, uuid=f"GPU-{i}") for i in range(6)]
    fake = FakeNVML(devices)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    gpu = open_gpu(1)  # CUDA device 1 of this process is NVML's 5
    assert gpu is not None and gpu.sample()["gpu"] == 5 and fake.initialized == 1
    gpu.close()
    assert fake.initialized == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-4")
    assert open_gpu(0).index == 4
    assert open_gpu(0, uuid="GPU-3").index == 3, "torch's UUID of the device wins"


def test_no_nvml_no_driver_no_gpu_is_silent(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert open_gpu(0) is None
    assert open_gpu(0, nvml=FakeNVML([], init_error=12)) is None  # NVML_ERROR_LIBRARY_NOT_FOUND
    empty = FakeNVML([])
    assert open_gpu(0, nvml=empty) is None and empty.initialized == 0
    sampler = ContextSampler(None, 0, open_gpu_sampler=lambda: open_gpu(0, nvml=empty))
    sampler._start_gpu()
    row = sampler.sample_once()
    assert row["gpu"] == -1 and math.isnan(row["sm_clock_mhz"]) and sampler.errors == 0
    assert not caplog.records


def test_a_lost_gpu_is_one_line_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    dev = Device()
    fake = FakeNVML([dev])
    problems = Problems()
    sampler = ContextSampler(None, 0, problems=problems, open_gpu_sampler=lambda: None)
    sampler.gpu = GpuSampler(fake, 0, on_error=sampler._gpu_error)
    dev.lost = True
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        for _ in range(3):
            row = sampler.sample_once()
    assert math.isnan(row["sm_clock_mhz"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "GPU is lost" in lines[0], lines
    assert problems.counts["context-gpu"] >= 3


def _fake_proc(root: Path, pid: int, t: int) -> None:
    """A /proc of two CPUs and process ``pid`` with one child, ``t`` seconds into its life."""
    (root / str(pid) / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / "77").mkdir(exist_ok=True)
    (root / "pressure").mkdir(exist_ok=True)
    (root / "pressure" / "cpu").write_text(f"some avg10={10 * t:.2f} avg60=0.00 avg300=0.00 total=1\n"
                                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")  # fmt: skip
    (root / "loadavg").write_text("3.50 2.00 1.00 4/300 999\n")
    (root / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable: 50 kB\nSwapTotal: 1000 kB\nSwapFree: 400 kB\n")
    # cpu1 (the process's) runs 100 ticks a second, 30 of them stolen; cpu0 idles
    (root / "stat").write_text(f"cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 0 0 0 {100 * t} 0 0 0 0 0 0\n"
                               f"cpu1 {70 * t} 0 0 0 0 0 0 {30 * t} 0 0\nintr 0\n")  # fmt: skip
    (root / str(pid) / "stat").write_text(f"{pid} (py thon) S 1 " + "0 " * 9 + f"{50 * t} {10 * t} 0 0\n")
    (root / str(pid) / "status").write_text(
        f"Name:\tpython\nCpus_allowed_list:\t1\nvoluntary_ctxt_switches:\t5\nnonvoluntary_ctxt_switches:\t{300 * t}\n"
    )
    (root / str(pid) / "schedstat").write_text(f"123 {400_000_000 * t} 9\n")
    (root / str(pid) / "task" / str(pid) / "children").write_text("77 ")
    (root / "77" / "stat").write_text("77 (worker) R 1 " + "0 " * 9 + f"{20 * t} {5 * t} 0 0\n")
    (root / "77" / "status").write_text(f"nonvoluntary_ctxt_switches:\t{40 * t}\n")


def test_host_rates_from_a_fake_proc(tmp_path: Path) -> None:
    clock = iter([100.0, 102.0])
    _fake_proc(tmp_path, 4242, 1)
    host = HostSampler(tmp_path, pid=4242, clock=lambda: next(clock))
    first = host.sample()
    assert math.isnan(first["invol_switches"]) and first["cpu_pressure"] == pytest.approx(0.10)
    _fake_proc(tmp_path, 4242, 3)  # two seconds later
    row = host.sample()
    assert row["invol_switches"] == pytest.approx(300.0) and row["run_delay"] == pytest.approx(0.4)
    assert row["cpu_time"] == pytest.approx(0.6 * 100 / host._ticks)
    assert row["steal"] == pytest.approx(0.3) and row["cores_busy"] == pytest.approx(1.0), "over its CPU only"
    assert (row["affinity"], row["affinity_cpus"], row["cpus"], row["workers"]) == ("1", 1, 2, 1)
    assert row["workers_cpu_time"] == pytest.approx(0.25 * 100 / host._ticks)
    assert row["workers_invol_switches"] == pytest.approx(40.0)
    assert (row["load1"], row["swap_used_bytes"], row["mem_available_bytes"]) == (3.5, 600 * 1024, 50 * 1024)
    assert row["cpu_pressure"] == pytest.approx(0.30) and host.unreadable == {}


def test_restricted_proc_gives_nan_silently(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "4242").mkdir()  # the process's directory, and nothing readable in it or around it
    host = HostSampler(tmp_path, pid=4242)
    host.sample()
    row = host.sample()
    for field in ("cpu_pressure", "memory_pressure", "steal", "run_delay", "invol_switches", "cpu_time", "load1"):
        assert math.isnan(row[field]), field
    assert row["workers"] == 0 and row["affinity"] == "" and host.unreadable == {}
    assert not caplog.records


def test_garbled_proc_is_skipped_counted_and_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fake_proc(tmp_path, 4242, 1)
    for rel in ("pressure/cpu", "stat", "meminfo", "loadavg", "4242/stat", "4242/schedstat"):
        (tmp_path / rel).write_text("\x00garbage ) x\n")
    (tmp_path / "4242" / "status").write_text("Cpus_allowed_list:\tzz\n")
    problems = Problems()
    sampler = ContextSampler(None, 0, problems=problems, open_gpu_sampler=lambda: None)
    sampler.host = HostSampler(tmp_path, pid=4242, on_unreadable=sampler._unreadable)
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        for _ in range(3):
            row = sampler.sample_once()
    assert math.isnan(row["cpu_pressure"]) and math.isnan(row["steal"]) and math.isnan(row["cpu_time"])
    assert row["affinity"] == "" and math.isnan(row["memory_pressure"]), "no such file: unknown"
    assert sampler.host.unreadable["pressure/cpu"] == 3 and sampler.host.unreadable["4242/status"] == 3
    assert len(caplog.records) == 1 and "cannot parse /proc/" in caplog.records[0].getMessage()
    assert sampler.errors == 0, "bad input is not our failure"


def test_this_machines_proc() -> None:
    host = HostSampler()
    host.sample()
    row = host.sample()
    assert row["cpus"] >= 1 and row["affinity_cpus"] >= 1 and cpu_list(row["affinity"])
    assert row["cpu_time"] >= 0 and row["invol_switches"] >= 0 and host.unreadable == {}
    assert cpu_list_text(cpu_list("0-3,8,10-11")) == "0-3,8,10-11"


def test_stream_written_compacted_and_read_back(tmp_path: Path) -> None:
    times = iter(range(1000, 2000))
    fake = FakeNVML([Device(reasons=0x4)])
    (tmp_path / "proc" / "1").mkdir(parents=True)
    host = HostSampler(tmp_path / "proc", pid=1)
    sampler = ContextSampler(tmp_path, 3, host=host, write_every_s=3.0, open_gpu_sampler=lambda: open_gpu(0, nvml=fake),
                             wall=lambda: float(next(times)))  # fmt: skip
    sampler._start_gpu()
    for _ in range(7):
        sampler.sample_once()
    assert (tmp_path / "context-00003.arrows").exists(), "written every 3 samples"
    assert len(load_context(tmp_path)) == 6, "readable while written"
    sampler.close()
    assert not (tmp_path / "context-00003.arrows").exists() and (tmp_path / "context-00003.parquet").exists()
    frame = load_context(tmp_path)
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 7
    assert frame["time"].tolist() == list(range(1000, 1007)) and (frame["clock_reasons"] == 4).all()
    assert fake.initialized == 0, "NVML shut down at close"
    (tmp_path / "context-00004.arrows").write_bytes(b"not arrow at all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(load_context(tmp_path)) == 7
    assert any(issubclass(w.category, RunDirWarning) and "context-00004" in str(w.message) for w in caught)
    assert load_context(tmp_path / "missing").empty
