"""The CUDA timing path, driven on every CI run by a fake CUDA layer with CUDA's semantics
(``fake_cuda.py``): lazy resolution, the pending queue, the bounded close, the capture gate,
the stream filter, where the GPU is at a stall, and which clock a model gets."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import check_anatomy, wait_for
from fake_cuda import FakeStream, install
from torch import nn

import stragglerwatch
from stragglerwatch.record.events import read_events
from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks, compute_device
from stragglerwatch.runtime.capture.probes import StepProbe
from stragglerwatch.runtime.identity import AttachError

MS = 1e-3


class Spinning(nn.Module):
    """A model whose forward keeps the (fake) GPU busy ``ms`` while the host returns at once."""

    def __init__(self, gpu, ms: float):
        super().__init__()
        self.gpu, self.ms = gpu, ms
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gpu.current_stream().spin(self.ms)
        return self.lin(x)


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    x = torch.randn(4, 8)
    for _ in range(n):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def watched(model: nn.Module, run: Path, **settings):
    settings = {"timing": "cuda", "watchdog_timeout_s": 0, "context_interval_s": 0, "control_interval_s": 0,
                "flush_interval_s": 60, **settings}  # fmt: skip
    return stragglerwatch.attach(model, run, **settings)


def written(watch) -> int:
    watch.flush()
    return watch.stats()["steps_written"]


def test_the_fake_has_cudas_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake is only worth the tests it drives if it breaks where CUDA breaks."""
    gpu = install(monkeypatch)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    gpu.default.spin(50)
    b.record()
    assert a.query() and not b.query(), "an event completes only once the stream's work before it is done"
    with pytest.raises(RuntimeError, match="completed"):
        a.elapsed_time(b)
    wait_for(b.query, 2, "the spin to end")
    assert 45 <= a.elapsed_time(b) <= 80
    graph = torch.cuda.graphs.CUDAGraph()
    graph.capture_begin()
    inside = torch.cuda.Event(enable_timing=True)
    inside.record()
    failures = []

    def other_thread() -> None:
        try:
            a.query()
        except RuntimeError as exc:
            failures.append(str(exc))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(5)
    graph.capture_end()
    assert failures and gpu.invalidated, "a query from another thread breaks a global capture"
    assert not inside.query(), "an event recorded inside a capture never completes outside it"


def test_phases_are_the_gpu_times_read_lazily(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    gpu = install(monkeypatch)
    model = Spinning(gpu, ms=200)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run")
    t0 = time.perf_counter()
    steps(model, opt, 4)
    host_s = time.perf_counter() - t0
    assert host_s < 0.2, f"the host waited for the GPU ({host_s:.3f} s for 0.8 s of GPU work): a sync?"
    assert written(watch) == 0, "nothing is written before the GPU got there"
    wait_for(lambda: written(watch) == 4, 5, "the GPU to finish the four steps")
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    check_anatomy(df)
    assert set(df["timing"]) == {"cuda"}
    assert df["forward_s"].between(0.19, 0.23).all(), "forward is the GPU's 200 ms, not the host's launch"
    assert (df["step_s"] >= 0.19).all()


def test_close_is_bounded_when_the_gpu_never_finishes(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    """``with attach(...)`` left by an exception while the GPU sits behind a collective nobody joins."""
    gpu = install(monkeypatch)
    model = Spinning(gpu, ms=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run", close_timeout_s=1.0)
    steps(model, opt, 2)
    wait_for(lambda: written(watch) == 2, 5, "the first steps")
    gpu.default.hang()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the user's own error"), watch:
        steps(model, opt, 3)
        raise RuntimeError("the user's own error")
    took = time.monotonic() - t0
    assert took < 1.0 + 1.5, f"close waited {took:.1f} s for a GPU that never finishes"
    stats = watch.stats()
    assert stats["unresolved_steps"] == 3 and stats["steps_written"] == 2
    events, _ = read_events(tmp_path / "run")
    (unresolved,) = [e for e in events if e["kind"] == "unresolved"]
    assert unresolved["steps"] == [2, 3, 4] and unresolved["count"] == 3
    assert sorted(stragglerwatch.load_run(tmp_path / "run")["step"]) == [0, 1]


@pytest.mark.parametrize("gated", [True, False])
def test_no_query_of_ours_breaks_a_graph_capture(one_rank_group, tmp_path: Path, monkeypatch, gated: bool) -> None:
    """Steps pending while the training thread captures a graph in global mode: the log thread must not
    query an event until the capture ends; marks made inside the capture are dropped with their steps."""
    gpu = install(monkeypatch)
    if not gated:  # the control: without the gate the same job breaks the capture, so the test can fail
        monkeypatch.setattr(CaptureGate, "quiet", lambda self: _always(True))
        monkeypatch.setattr(CaptureGate, "event_class", lambda self: torch.cuda.Event)  # ungated queries
    model = Spinning(gpu, ms=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run", flush_interval_s=0.02)  # the log thread polls all along
    steps(model, opt, 2)
    graph = torch.cuda.graphs.CUDAGraph()
    graph.capture_begin()
    steps(model, opt, 1)  # step 2's end mark is captured, and with it step 3's start
    time.sleep(0.5)  # the first steps' events completed meanwhile: an ungated log thread queries now
    graph.capture_end()
    steps(model, opt, 2)
    if not gated:
        assert gpu.invalidated, "the control broke the capture"
        watch.close()
        return
    wait_for(lambda: watch.stats()["steps_written"] == 3, 5, "the steps outside the capture")
    watch.close()
    stats = watch.stats()
    assert gpu.invalidated == [], "a query of ours broke the user's capture"
    assert stats["capture_dropped_marks"] > 0 and stats["capture_dropped_steps"] == 2
    assert sorted(stragglerwatch.load_run(tmp_path / "run")["step"]) == [0, 1, 4]


def _always(value: bool):
    import contextlib

    @contextlib.contextmanager
    def gate():
        yield value

    return gate()


def test_collectives_waited_for_on_a_side_stream_are_not_the_compute_streams(monkeypatch) -> None:
    gpu = install(monkeypatch)
    marks = CudaMarks(CaptureGate())
    probe = StepProbe(lambda m: None, marks.mark)
    module = nn.Linear(2, 2)
    probe.on_forward_pre(module, ())  # the compute stream: that of the training forward
    side = FakeStream(gpu, "all-gather")
    with gpu.stream(side):
        assert probe.comm_begin() is None, "a wait on FSDP2's side stream is not the compute stream's"
    token = probe.comm_begin()
    assert token is not None
    probe.comm_end(token)
    assert len(probe._cur.comm) == 1


def test_the_stall_says_where_the_gpu_is(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    """The GPU hangs inside backward; the host then blocks elsewhere (as at ``.item()`` on NCCL). The stall
    event says the GPU is in backward: what tells a stuck GPU from its victims when counts are equal."""
    gpu = install(monkeypatch)
    model = Spinning(gpu, ms=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run", watchdog_timeout_s=0.5)
    steps(model, opt, 3)
    model.lin.weight.register_hook(lambda g: gpu.default.hang())  # runs after backward's first mark
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    time.sleep(2.0)  # the host "blocks at .item()" (phase other) past the watchdog's threshold

    def stall() -> dict | None:
        events, _ = read_events(tmp_path / "run")
        return next((e for e in events if e["kind"] == "stall"), None)

    wait_for(lambda: stall() is not None, 5, "the stall event")
    watch.close()
    ev = stall()
    assert ev["phase"] == "other" and ev["device"] == {"step": 3, "phase": "backward"}


def test_the_clock_comes_from_where_the_model_computes(monkeypatch) -> None:
    install(monkeypatch)
    cpu_model = nn.Linear(2, 2)
    assert compute_device(cpu_model).type == "cpu"
    # FSDP2 with CPUOffloadPolicy: parameters on the CPU between steps, computing on the mesh's GPU
    assert compute_device(cpu_model, mesh=SimpleNamespace(device_type="cuda")) == torch.device("cuda", 0)
    assert compute_device(cpu_model, mesh=SimpleNamespace(device_type="cpu")).type == "cpu"
    assert compute_device(cpu_model, ddp=SimpleNamespace(device_ids=[3])) == torch.device("cuda", 3)

    class PartlyOnGpu(nn.Module):  # the first parameter on the CPU, a later one on a GPU
        def parameters(self, recurse: bool = True):
            yield torch.zeros(1)
            yield SimpleNamespace(device=torch.device("cuda", 1))

    assert compute_device(PartlyOnGpu()) == torch.device("cuda", 1)


def test_cuda_timing_without_cuda_is_refused(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AttachError, match="no CUDA device"):
        stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "run", timing="cuda")
    assert not (tmp_path / "run").exists(), "a refused attach leaves nothing behind"


def test_a_sync_collective_is_timed_on_the_stream_where_it_is_issued(one_rank_group, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """NCCL since torch 2.8: a synchronous all-reduce runs on the current stream and returns no Work. The
    stream is busy in it (here: 30 ms of the fake stream, enqueued by the process-group call), and the marks
    around the call bracket that on the device."""
    gpu = install(monkeypatch)
    group_cls = dist.ProcessGroup
    original = group_cls.__dict__["allreduce"]

    def like_nccl(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        work.wait()
        gpu.current_stream().spin(30)  # the kernel waits for the peers on the current stream
        return None

    monkeypatch.setattr(group_cls, "allreduce", like_nccl)
    model = Spinning(gpu, ms=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run")
    x = torch.randn(4, 8)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())  # the loop's loss all-reduce, in the next step's data gap
    wait_for(lambda: written(watch) == 3, 5, "three steps")
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    later = df[df["step"] >= 1]
    assert later["collective_wait_s"].between(0.028, 0.045).all(), later["collective_wait_s"].tolist()
    assert (later["data_wait_s"] < 0.01).all(), "the collective's time is not the data gap's"
    assert set(df["timing"]) == {"cuda"}


@pytest.mark.parametrize(("gpu_ms", "fetch_ms", "idle_ms"), [(80, 30, 0), (5, 40, 35)])
def test_a_marked_fetch_is_what_the_gpu_idled_for_it(one_rank_group, tmp_path: Path, monkeypatch, gpu_ms: float,
                                                     fetch_ms: float, idle_ms: float) -> None:  # fmt: skip
    """A fetch between forward and backward (watch.data): on the device, data wait is the time the
    GPU idled for it; while queued work kept the GPU busy, the host's fetch cost nothing."""
    gpu = install(monkeypatch)
    model = Spinning(gpu, ms=gpu_ms)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = watched(model, tmp_path / "run")
    fetch = watch.data(lambda: time.sleep(fetch_ms * MS))
    x = torch.randn(4, 8)
    for _ in range(4):
        loss = model(x).pow(2).mean()
        fetch()
        loss.backward()
        opt.step()
        opt.zero_grad()
    wait_for(lambda: written(watch) == 4, 5, "the GPU to finish")
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    check_anatomy(df)
    later = df[df["step"] >= 1]
    assert later["data_wait_s"].between((idle_ms - 10) * MS, (idle_ms + 12) * MS).all(), later["data_wait_s"]
