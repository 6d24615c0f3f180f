"""What to try (``analysis/advice.py``): each line appears with the signal it is keyed on and never
without it; the DataLoader settings it reads are recorded in the rank's metadata at ``watch.wrap``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stragglerwatch.analysis.advice import advise


def entry(cause: str = "compute", signals: tuple[str, ...] = (), rank: int = 1, host: str | None = "node-a",
          where: str | None = None, data_ms: float = 20.0) -> dict:  # fmt: skip
    context = [{"signal": s, "value": 2.0, "peers": 1.0, "text": f"{s} differs"} for s in signals]
    return {"rank": rank, "cause": cause, "host": host, "where": where, "context": context,
            "excess_ms": {cause: data_ms}}  # fmt: skip


def said(lines: list[str]) -> str:
    return " | ".join(lines)


def test_nothing_measured_nothing_said() -> None:
    assert advise(entry()) == []
    assert advise(entry("data")) == [], "a data straggler without worker figures or loader settings: no guess"
    assert advise(entry("optimizer"), own={"workers": 2.0, "workers_cpu_time": 1.9, "cpu_time": 0.5}) == []


def test_untimed_time_keeps_its_hints() -> None:
    (line,) = advise(entry("data", where="before the forward"))
    assert "mark the fetch" in line and "watch.wrap(loader)" in line
    (line,) = advise(entry("other", where="between forward and backward"))
    assert line.startswith("its extra time is untimed code between forward and backward")


@pytest.mark.parametrize(
    ("own", "meta", "expected"),
    [
        ({"workers": 2.0, "workers_cpu_time": 1.9, "cpu_time": 0.5, "affinity_cpus": 8.0}, {},
         "its 2 data-loader workers were each busy 95% of a CPU while it waited 20.0 ms/step for data: they cannot "
         "keep up; raise num_workers"),
        ({"workers": 4.0, "workers_cpu_time": 3.6, "cpu_time": 0.6, "affinity_cpus": 4.0}, {},
         "kept all its 4 CPU(s) busy (4.20 CPU-s/s) while it waited 20.0 ms/step for data: more workers will not help"),
        ({"workers": 2.0, "workers_cpu_time": 0.1, "cpu_time": 0.3, "affinity_cpus": 8.0}, {},
         "busy only 5% of a CPU each while it waited 20.0 ms/step for data: the loading waits on I/O"),
        ({"workers": 0.0, "workers_cpu_time": 0.0, "cpu_time": 0.3}, {}, "no data-loader worker process ran"),
        ({}, {"loader": {"num_workers": 0, "pin_memory": False}}, "(num_workers=0)"),
        ({}, {"device": "cuda:0", "timing": "cuda", "loader": {"num_workers": 4, "pin_memory": False}},
         "pin_memory=False on a CUDA rank"),
    ],
)  # fmt: skip
def test_data_advice_follows_its_signal(own: dict, meta: dict, expected: str) -> None:
    assert expected in said(advise(entry("data"), own=own, meta=meta))
    assert expected not in said(advise(entry("compute"), own=own, meta=meta)), "data advice is for data stragglers"


def test_data_advice_without_its_signal() -> None:
    between = {"workers": 2.0, "workers_cpu_time": 1.1, "cpu_time": 0.3, "affinity_cpus": 8.0}  # 55% each
    assert advise(entry("data"), own=between) == [], "neither saturated nor idle: no line"
    busy_cpu = {"workers": 2.0, "workers_cpu_time": 1.9, "cpu_time": 0.5, "affinity_cpus": 8.0}
    assert "I/O" not in said(advise(entry("data"), own=busy_cpu))
    cpu_job = {"device": "cpu", "timing": "host", "loader": {"num_workers": 2, "pin_memory": False}}
    assert advise(entry("data"), meta=cpu_job) == [], "pin_memory matters on a CUDA rank only"
    pinned = {"device": "cuda:0", "timing": "cuda", "loader": {"num_workers": 2, "pin_memory": True}}
    assert advise(entry("data"), meta=pinned) == []
    compile_workers = {"workers": 3.0, "workers_cpu_time": 0.0, "cpu_time": 0.3}
    lines = advise(entry("data"), own=compile_workers, meta={"loader": {"num_workers": 0, "pin_memory": True}})
    assert "(num_workers=0)" in said(lines) and "I/O" not in said(lines), "the loader's own setting wins"


def test_several_data_stragglers_on_one_host_blame_its_storage() -> None:
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    two = [entry("data", rank=0), entry("data", rank=1)]
    for e in two:
        assert "ranks 0, 1 of host node-a wait for data and no rank of the 1 other host(s) does" in said(
            advise(e, two, hosts=hosts))  # fmt: skip
    spread = [entry("data", rank=1), entry("data", rank=2, host="node-b")]
    assert advise(spread[0], spread, hosts=hosts) == [], "data stragglers on every host: not one node's storage"
    assert advise(two[0], two[:1], hosts=hosts) == [], "one rank alone"
    assert advise(two[0], two, hosts={0: "node-a", 1: "node-a"}) == [], "no other host to compare with"
    mixed = [entry("data", rank=0), entry("compute", rank=1)]
    assert advise(mixed[0], mixed, hosts=hosts) == [], "the other straggler of the host is not waiting for data"


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        (("gpu_hw_thermal_slowdown", "sm_clock", "temperature"), "its GPU throttles for heat: check the cooling of "
         "this node (node-a)"),
        (("gpu_hw_thermal_slowdown",), "replace or drain this node (node-a): its GPU shows thermal slowdown"),
        (("pcie_replays",), "replace or drain this node (node-a): its GPU shows PCIe replays"),
        (("pcie_replays",), "check the link's width and speed"),
        (("xid", "ecc_uncorrected"), "its GPU shows XID errors, uncorrected ECC errors where its peers' do not"),
        (("ecc_corrected",), "dcgmi diag -r 3"),
        (("nvlink_errors",), "nvidia-smi nvlink -e"),
        (("gpu_hw_slowdown",), "the hardware slows its GPU"),
        (("power_limit", "sm_clock"), "set it back to theirs (nvidia-smi -pl 1)"),
        (("gpu_sw_power_cap",), "runs at its power cap more often than its peers'"),
        (("gpu_applications_clocks_setting",), "nvidia-smi -rac"),
        (("sm_clock",), "its SM clock is lower than its peers' with no slowdown reason from NVML"),
        (("run_delay",), "its training thread waits for its CPU: look for other processes on its CPUs (on node-a: "
         "top"),
        (("cpu_pressure",), "its host runs more than its peers' hosts"),
        (("steal",), "its VM shares its physical host"),
        (("affinity_cpus",), "it may run on fewer CPUs than its peers"),
        (("workers_invol_switches",), "its data-loader workers share their CPUs with other work"),
        (("swap_used",), "its host is short of memory: free memory on node-a"),
    ],
)  # fmt: skip
def test_context_advice_follows_its_signal(signals: tuple[str, ...], expected: str) -> None:
    for cause in ("compute", "data", "other"):
        assert expected in said(advise(entry(cause, signals))), cause
    other = ("sm_clock",) if "steal" in signals else ("steal",)
    assert expected not in said(advise(entry("compute", other))), "another signal: not this line"


def test_drain_only_for_hardware_evidence() -> None:
    for signals in (("run_delay", "others_cpu"), ("steal",), ("power_limit",), ("sm_clock",), ("swap_used",)):
        assert "drain" not in said(advise(entry("compute", signals))), signals
    assert "replace or drain this node: " in said(advise(entry("compute", ("xid",), host=None)))


@pytest.mark.parametrize("signals", [("run_delay",), ("invol_switches",), ("others_cpu", "run_delay")])
def test_cpu_contention_by_others_or_by_its_own_threads(signals: tuple[str, ...]) -> None:
    """Who takes its CPU is read from what other processes used of its CPUs (``others_cpu``, its own
    median), whether that differed from its peers' or not: on a busy machine their CPUs may be shared too."""

    def lines(others: float) -> str:
        return said(advise(entry("compute", signals), own={"others_cpu": others, "affinity_cpus": 2.0}))

    assert lines(0.8).startswith("other processes used 0.80 CPU of its 2 CPU(s): find them (on node-a: top")
    assert lines(0.02).startswith("no other process used its CPUs (0.02 CPU), so its own threads compete for its 2 "
                                  "CPU(s)")  # fmt: skip
    assert lines(0.15).startswith("its training thread waits for its CPU: look for other processes on its 2 CPU(s)")
    assert "own threads" not in lines(0.8) and "other processes used" not in lines(0.02)


def test_loader_settings_are_recorded_at_wrap(tmp_path: Path) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import stragglerwatch
    from stragglerwatch.runtime.capture.coverage import loader_settings

    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=8, num_workers=0, pin_memory=False)

    class Shuffled:  # a wrapper that holds the loader, as many loops have
        def __init__(self, inner: DataLoader) -> None:
            self.loader = inner

        def __iter__(self):
            return iter(self.loader)

    assert loader_settings([1, 2]) is None
    assert loader_settings(Shuffled(loader)) == loader_settings(loader)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = stragglerwatch.attach(model, tmp_path / "run", optimizer=opt, context_interval_s=0, code_sample_hz=0)
    try:
        for x, y in watch.wrap(Shuffled(loader)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        watch.wrap(DataLoader(data, batch_size=4, num_workers=0, pin_memory=True))  # the first one is kept
    finally:
        watch.close()
    meta = json.loads((tmp_path / "run" / "rank-00000.json").read_text())
    assert meta["loader"] == {"num_workers": 0, "pin_memory": False, "persistent_workers": False,
                              "prefetch_factor": None}  # fmt: skip
