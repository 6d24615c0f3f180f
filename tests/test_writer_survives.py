"""The step log survives any step: a step it cannot resolve is dropped and counted, the queue's bound
always holds, and the steps after it are written. On the device side, marks go on the stream of the
device the model computes on, also when the training thread's current device is another one and the
backward runs on autograd's thread of that device (the two-device fake of ``fake_cuda.py``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import check_anatomy, fake_step, wait_for
from fake_cuda import install
from torch import nn

import stragglerwatch
from stragglerwatch.record.steplog import log_path
from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks
from stragglerwatch.runtime.capture.probes import StepProbe
from stragglerwatch.runtime.capture.timing import StepMarks, UnresolvableStep, resolve_cuda
from stragglerwatch.runtime.capture.work import DeviceCounts
from stragglerwatch.runtime.log import Problems
from stragglerwatch.runtime.output.writer import MAX_PENDING, EventLogWriter

MS = 1e-3


def steps_from(first: int, n: int) -> Iterator[StepMarks]:
    t = 100.0 + first
    for s in range(first, first + n):
        m = fake_step(s, t)
        yield m
        t = m.end


def broken_for(bad: set[int] | None = None, below: int = -1):
    """A resolver that raises for the steps in ``bad`` and those below ``below`` (as ``elapsed_time``
    does for events of two devices), and resolves the others (host marks)."""

    def resolve(m: StepMarks, deadline: float | None) -> StepMarks:
        if m.step < below or m.step in (bad or ()):
            raise RuntimeError("CUDA error: invalid resource handle (both events must be recorded on the same device)")
        return m

    return resolve


def writer_for(run: Path, resolve, **kwargs) -> EventLogWriter:  # noqa: ANN001
    return EventLogWriter(log_path(run, 0), 0, 0.0, resolve=resolve, flush_interval_s=60, **kwargs)


def test_a_step_that_cannot_be_resolved_is_dropped_counted_and_said_once(make_run, caplog) -> None:
    run = make_run(1)
    problems = Problems()
    w = writer_for(run, broken_for({3, 5}), problems=problems)
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        for m in steps_from(0, 10):
            w.submit(m)
        w.flush()
    assert (w.steps_written, w.unresolvable_dropped_steps, w.dropped_steps) == (8, 2, 2)
    assert w.write_errors == 0, "a step that cannot be resolved is no write error"
    assert problems.counts == {"log-unresolvable": 2}
    lines = [r.getMessage() for r in caplog.records if "cannot be resolved" in r.getMessage()]
    assert len(lines) == 1 and "step 3" in lines[0] and "same device" in lines[0], "one rate-limited line"
    for m in steps_from(10, 3):
        w.submit(m)
    w.close()
    assert w.steps_written == 11
    assert sorted(stragglerwatch.load_run(run)["step"]) == [0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12]


def test_twenty_thousand_unresolvable_steps_hold_nothing_and_the_next_are_written(make_run) -> None:
    """The reported failure: every flush failed on the same head step, 20,000 steps pending, none written."""
    run = make_run(1)
    w = writer_for(run, broken_for(below=20_000))
    for m in steps_from(0, 20_000):
        w.submit(m)
        if m.step % 1000 == 999:
            w.flush()
            assert len(w._pending) <= MAX_PENDING
    assert len(w._pending) == 0 and w.unresolvable_dropped_steps == w.dropped_steps == 20_000
    for m in steps_from(20_000, 5):
        w.submit(m)
    w.close()
    assert w.steps_written == 5 and w.unresolved == []
    assert sorted(stragglerwatch.load_run(run)["step"]) == list(range(20_000, 20_005))


def test_the_bound_holds_when_a_pass_itself_raises(make_run) -> None:
    """A pass that fails before it resolves anything (here the capture gate) still trims the queue."""
    run = make_run(1)

    @contextlib.contextmanager
    def broken_gate() -> Iterator[bool]:
        raise RuntimeError("the gate is broken")
        yield True  # pragma: no cover

    w = writer_for(run, broken_for(), gate=broken_gate)
    for m in steps_from(0, 3 * MAX_PENDING):
        w.submit(m)
        if m.step % 1000 == 999:
            w.flush()
    w.flush()
    assert len(w._pending) == MAX_PENDING and w.dropped_steps == 2 * MAX_PENDING
    w._gate = lambda: contextlib.nullcontext(True)  # a gate that works again
    w.flush()
    assert w.steps_written == MAX_PENDING, "the steps kept are written once passes work again"
    w.close()


def test_a_record_that_cannot_be_written_is_dropped_alone(make_run) -> None:
    run = make_run(1)

    def bad_record(m: StepMarks, deadline: float | None) -> StepMarks:
        if m.step == 2:
            m.step = "two"  # type: ignore[assignment]  # a record the step log's schema refuses
        return m

    w = writer_for(run, bad_record)
    for m in steps_from(0, 5):
        w.submit(m)
    w.close()
    assert (w.steps_written, w.unresolvable_dropped_steps, w.write_errors) == (4, 1, 0)
    assert sorted(stragglerwatch.load_run(run)["step"]) == [0, 1, 3, 4]


# -- the device side: two fake GPUs ---------------------------------------------------------------


def test_the_fake_has_two_devices_as_cuda_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = install(monkeypatch, devices=2)
    cuda = gpu.cuda
    assert torch.cuda.current_device() == 0 and torch.cuda.device_count() == 2
    a = torch.cuda.Event(enable_timing=True)
    a.record()
    with torch.cuda.device(1):
        assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() is cuda.devices[1].default
        b = torch.cuda.Event(enable_timing=True)
        b.record()
    assert torch.cuda.current_device() == 0
    assert (a.device, b.device) == (torch.device("cuda", 0), torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="same device"):
        a.elapsed_time(b)
    seen = []
    t = torch.ones(2, requires_grad=True)
    cuda.autograd_device = 1
    t.register_hook(lambda g: seen.append((torch.cuda.current_device(), torch.cuda.current_stream())))
    (t * 2).sum().backward()
    assert seen == [(1, cuda.devices[1].default)], "the hook ran on device 1's autograd thread"
    assert torch.cuda.current_device() == 0, "the calling thread's current device is its own"


class OnDeviceOne(nn.Module):
    """A model moved with ``.to(1)`` by a loop that never called ``set_device``: its forward's kernels
    run on device 1's stream, its backward on device 1's autograd thread; the loop's current device is 0."""

    def __init__(self, cuda, fwd_ms: float, bwd_ms: float):  # noqa: ANN001
        super().__init__()
        self.cuda, self.fwd_ms = cuda, fwd_ms
        self.lin = nn.Linear(8, 8)
        # the backward's kernels, queued on the stream current on the thread autograd runs it on
        self.lin.weight.register_hook(lambda g: cuda.current_stream().spin(bwd_ms))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cuda.current_stream(1).spin(self.fwd_ms)
        return self.lin(x)


def test_marks_follow_the_device_the_model_computes_on(one_rank_group, tmp_path: Path, monkeypatch) -> None:
    gpu = install(monkeypatch, devices=2)
    cuda = gpu.cuda
    cuda.autograd_device = 1
    model = OnDeviceOne(cuda, fwd_ms=60, bwd_ms=40)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, tmp_path / "run", timing="cuda", watchdog_timeout_s=0, context_interval_s=0,
                                  control_interval_s=0, flush_interval_s=60)  # fmt: skip
    x = torch.randn(4, 8)
    for _ in range(5):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.cuda.current_device() == 0, "our marks leave the loop's current device as it was"
    writer = watch._writer

    def settled() -> bool:
        watch.flush()
        return writer.steps_written + writer.dropped_steps == 5

    wait_for(settled, 5, "the fake GPUs to finish the five steps")
    stats = watch.stats()
    watch.close()
    # step 0 began before the probe knew where the model computes: its marks straddle two devices
    assert writer.unresolvable_dropped_steps == 1 and stats["dropped_steps"] == 1
    assert stats["steps_written"] == 4 and stats["write_errors"] == 0
    assert set(stats["problems"]) == {"log-unresolvable"}, "no hook of ours failed, nothing else went wrong"
    df = stragglerwatch.load_run(tmp_path / "run")
    check_anatomy(df)
    assert sorted(df["step"]) == [1, 2, 3, 4]
    assert df["forward_s"].between(0.055, 0.085).all(), df["forward_s"].tolist()
    assert df["backward_s"].between(0.035, 0.065).all(), df["backward_s"].tolist()
    assert (df["step_s"] >= 0.095).all(), "the device's time: forward and backward on device 1"


def test_marks_made_on_another_thread_or_device_are_never_timed_together(monkeypatch) -> None:
    """A step whose events straddle devices is refused with a reason, not left to ``elapsed_time``."""
    gpu = install(monkeypatch, devices=2)
    marks = CudaMarks(CaptureGate())
    m = StepMarks(0, marks.mark(), 0.0)
    with torch.cuda.device(1):
        m.fwd_start.append(marks.mark())
    m.end = marks.mark()
    with pytest.raises(UnresolvableStep, match="cuda:0, cuda:1"):
        resolve_cuda(m)
    assert not gpu.invalidated


def test_the_probe_pins_its_marks_to_the_device_of_the_backward(monkeypatch) -> None:
    gpu = install(monkeypatch, devices=2)
    gpu.cuda.autograd_device = 1
    done: list[StepMarks] = []
    probe = StepProbe(done.append, CudaMarks(CaptureGate()).mark)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        probe.on_forward_pre(model, ())
        out = model(torch.ones(1, 2))
        probe.on_forward(model, (), out)
        out.sum().backward()
        probe.on_optimizer_pre(opt, (), {})
        opt.step()
        probe.on_optimizer_post(opt, (), {})
    assert probe.faults == 0 and len(done) == 2
    devices = {ev.device.index for ev in done[1].events()}
    assert devices == {1}, "after the first backward every mark goes on device 1, whichever thread makes it"
    assert torch.cuda.current_device() == 0


def test_a_device_count_is_read_only_once_its_copy_on_the_masks_device_landed(monkeypatch) -> None:
    """The step's marks on device 0 complete at once; the mask's count is copied on device 1's stream,
    behind 40 ms of work: the count is not read before that copy ran."""
    gpu = install(monkeypatch, devices=2)
    marks = CudaMarks(CaptureGate())
    ring = DeviceCounts(slots=8, pinned=False)
    m = StepMarks(0, marks.mark(), 0.0)
    m.fwd_start.append(marks.mark())
    with torch.cuda.device(1):  # where the mask is: its count and copy are queued on device 1's stream
        gpu.cuda.current_stream().spin(40)
        count = ring.count(torch.tensor([[1, 1, 0], [1, 0, 0]]))
    m.work.append((count, "tokens", 6.0))
    m.fwd_end.append(marks.mark())
    m.end = marks.mark()
    assert resolve_cuda(m) is None, "the copy on device 1 has not run yet"
    t0 = time.monotonic()
    r = resolve_cuda(m, deadline=time.monotonic() + 2.0)
    assert r is not None and r.work == [(3.0, "tokens", 6.0)]
    assert time.monotonic() - t0 >= 0.02, "it waited for device 1"
