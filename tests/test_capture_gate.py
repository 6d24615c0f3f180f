"""The capture gate (``devices.CaptureGate``) on every way a CUDA graph capture begins, with the fake
CUDA layer (``fake_cuda.py``): which classes are tapped, that no event query of ours runs while a
capture is open (also one begun on a path that is not tapped), that ``capture_begin`` waits for one
query of ours at most and never for the arithmetic around it, and that graph replays are counted.

The stand-ins below mirror torch's class layout: a base that does the capture (``torch._C._CUDAGraph``,
``torch._C._acceleratorGraph``: pybind classes) under a Python class whose methods call ``super()``
(``torch.cuda.graphs.CUDAGraph``, ``torch.accelerator.Graph``)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import wait_for
from fake_cuda import FakeDevice, install
from torch import nn

import stragglerwatch
from stragglerwatch.runtime.capture import devices
from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks, graph_taps
from stragglerwatch.runtime.capture.timing import StepMarks, resolve_cuda
from stragglerwatch.runtime.output import writer as writer_module


def _layout(gpu: FakeDevice) -> dict[str, type]:
    """Stand-ins for torch's graph classes on the fake GPU, in torch's layout."""

    class _CUDAGraph:  # torch._C._CUDAGraph: the capture itself
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            self._stream = gpu.current_stream()
            gpu.capturing[self._stream] = (capture_error_mode, threading.get_ident())

        def capture_end(self) -> None:
            if getattr(self, "_stream", None) is None:
                raise RuntimeError("capture_end without capture_begin")
            gpu.capturing.pop(self._stream, None)

        def replay(self) -> None:
            pass

    class CUDAGraph(_CUDAGraph):  # torch.cuda.graphs.CUDAGraph
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                          check_input_liveness: bool = False) -> None:  # fmt: skip
            super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)

        def capture_end(self) -> None:
            super().capture_end()

        def replay(self) -> None:
            super().replay()

    class Overriding(CUDAGraph):  # a user's subclass with its own capture_begin
        def capture_begin(self, *args: Any, **kwargs: Any) -> None:
            self.began = True
            super().capture_begin(*args, **kwargs)

    class _acceleratorGraph:  # torch._C._acceleratorGraph  # noqa: N801 - torch's name
        def __init__(self, keep_graph: bool = False) -> None:
            pass

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "default") -> None:
            self._stream = gpu.current_stream()
            mode = "global" if capture_error_mode == "default" else capture_error_mode
            gpu.capturing[self._stream] = (mode, threading.get_ident())

        def capture_end(self) -> None:
            gpu.capturing.pop(self._stream, None)

        def replay(self) -> None:
            pass

    class Graph(_acceleratorGraph):  # torch.accelerator.Graph
        def __init__(self, keep_graph: bool = False, *, pool: Any = None, capture_error_mode: str = "default"):
            super().__init__(keep_graph)
            self.graph_pool, self.capture_error_mode = pool, capture_error_mode

        def capture_begin(self) -> None:
            super().capture_begin(pool=self.graph_pool, capture_error_mode=self.capture_error_mode)

        def capture_end(self) -> None:
            super().capture_end()

        def replay(self) -> None:
            super().replay()

        def __enter__(self) -> None:
            self.capture_begin()

        def __exit__(self, *exc_info: object) -> None:
            self.capture_end()

    return {"_CUDAGraph": _CUDAGraph, "CUDAGraph": CUDAGraph, "Overriding": Overriding,
            "_acceleratorGraph": _acceleratorGraph, "Graph": Graph}  # fmt: skip


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeDevice, dict[str, type]]:
    gpu = install(monkeypatch)
    classes = _layout(gpu)
    monkeypatch.setattr(torch.cuda.graphs, "CUDAGraph", classes["CUDAGraph"])
    monkeypatch.setattr(torch.accelerator, "Graph", classes["Graph"], raising=False)
    return gpu, classes


#: The ways in: the stand-in each begins its capture (or replays) with.
PATHS = {"CUDAGraph": "CUDAGraph", "raw _CUDAGraph": "_CUDAGraph", "subclass overriding capture_begin": "Overriding",
         "accelerator Graph": "Graph"}  # fmt: skip


def _begin(classes: dict[str, type], path: str) -> Any:
    """A capture begun on this thread through ``path``; returns what ends it."""
    graph = classes[PATHS[path]]()
    if path == "accelerator Graph":  # as ``with graph:``
        graph.__enter__()
        return lambda: graph.__exit__(None, None, None)
    graph.capture_begin()
    return graph.capture_end


def _pending_step(gate: CaptureGate, gpu: FakeDevice) -> StepMarks:
    """A step of our marks whose events have completed."""
    marks = CudaMarks(gate)
    m = StepMarks(0, marks.mark(), 0.0)
    gpu.default.spin(5)
    m.fwd_start.append(marks.mark())
    m.fwd_end.append(marks.mark())
    m.end = marks.mark()
    wait_for(lambda: resolve_cuda(m) is not None, 2, "the step's events")
    return m


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0] if out else None


@pytest.mark.parametrize("path", PATHS)
def test_a_capture_begun_on_any_path_closes_the_gate(layout, path: str) -> None:
    """While the capture is open, a pass of the log thread's kind (another thread) queries nothing:
    ``quiet()`` says so, and an event of ours asked anyway makes no CUDA call."""
    gpu, classes = layout
    gate = CaptureGate().install()
    try:
        m = _pending_step(gate, gpu)
        end = _begin(classes, path)
        queries = gpu.queries
        assert gate.open == 1
        assert _in_thread(lambda: _quiet(gate)) is False, "the pass is told to wait"
        assert _in_thread(lambda: m.end.query()) is False, "an event of ours is 'not yet' while a capture is open"
        assert _in_thread(lambda: resolve_cuda(m)) is None
        assert gpu.queries == queries and gpu.invalidated == [], "no query reached the GPU"
        end()
        assert gate.open == 0 and _in_thread(lambda: _quiet(gate)) is True
        assert _in_thread(lambda: resolve_cuda(m)) is not None
        assert gpu.invalidated == []
    finally:
        gate.remove()


def _quiet(gate: CaptureGate) -> bool:
    with gate.quiet() as may_query:
        return may_query


def test_the_taps_sit_where_every_capture_passes(layout) -> None:
    """The lowest class defining each method: the base, beneath the Python class and its subclasses."""
    _, classes = layout
    owners = {(owner.__name__, name) for owner, name in graph_taps()}
    assert owners == {(base, name) for base in ("_CUDAGraph", "_acceleratorGraph") for name in devices.GRAPH_METHODS}


def test_torchs_own_graph_classes_are_tapped_and_untapped() -> None:
    """On this torch: ``torch._C._acceleratorGraph`` (a pybind class, torch >= 2.10) and
    ``torch._C._CUDAGraph`` on a CUDA build (``CUDAGraph`` itself over a CPU build's stand-in base)
    get our wrappers, and get their own methods back at ``remove()``."""
    cuda_base = torch._C._CUDAGraph if "capture_begin" in torch._C._CUDAGraph.__dict__ else torch.cuda.graphs.CUDAGraph
    expected = [(cuda_base, name) for name in devices.GRAPH_METHODS]
    accelerator = getattr(getattr(torch, "accelerator", None), "Graph", None)
    if accelerator is not None:
        expected += [(torch._C._acceleratorGraph, name) for name in devices.GRAPH_METHODS]
    assert graph_taps() == expected
    before = {(owner, name): owner.__dict__[name] for owner, name in expected}
    gate = CaptureGate().install()
    try:
        assert all(owner.__dict__[name] is not original for (owner, name), original in before.items())
    finally:
        gate.remove()
    assert all(owner.__dict__[name] is original for (owner, name), original in before.items())


def test_no_query_while_an_untapped_capture_is_open_on_this_thread(layout) -> None:
    """A capture the taps never saw (here: begun on a class outside them) on the thread of the pass:
    ``quiet()`` asks ``is_current_stream_capturing`` and the pass queries nothing."""
    gpu, _ = layout
    gate = CaptureGate().install()
    try:
        m = _pending_step(gate, gpu)

        class Untapped:
            def capture_begin(self) -> None:
                gpu.capturing[gpu.current_stream()] = ("global", threading.get_ident())

            def capture_end(self) -> None:
                gpu.capturing.pop(gpu.current_stream(), None)

        graph = Untapped()
        graph.capture_begin()
        queries = gpu.queries
        with gate.quiet() as may_query:
            resolved = resolve_cuda(m) if may_query else None
        graph.capture_end()
        assert gate.open == 0, "the gate never heard of this capture"
        assert not may_query and resolved is None and gpu.queries == queries, "a query during the capture"
        assert _quiet(gate) is True
    finally:
        gate.remove()


def test_capture_begin_waits_for_a_query_not_for_the_pass(layout) -> None:
    """A pass that queries, then computes for a long time: ``capture_begin`` meanwhile returns at once."""
    gpu, classes = layout
    gate = CaptureGate().install()
    try:
        m = _pending_step(gate, gpu)
        computing, release = threading.Event(), threading.Event()

        def a_pass() -> None:
            with gate.quiet() as may_query:
                assert may_query and resolve_cuda(m) is not None
                computing.set()
                release.wait(5)  # the arithmetic of the pass

        t = threading.Thread(target=a_pass)
        t.start()
        assert computing.wait(5)
        graph = classes["CUDAGraph"]()
        t0 = time.perf_counter()
        graph.capture_begin()
        took = time.perf_counter() - t0
        graph.capture_end()
        release.set()
        t.join(5)
        assert took < 0.5, f"capture_begin waited {took:.2f} s for our arithmetic"
        assert gate.waited_out == 0 and gpu.invalidated == []
    finally:
        gate.remove()


def test_the_log_threads_arithmetic_never_holds_a_capture(one_rank_group, tmp_path: Path, monkeypatch, layout) -> None:
    """The whole job: the log thread resolves steps and computes their records (slow here); the
    training thread begins a capture meanwhile and is not held, and the capture is not broken."""
    gpu, classes = layout
    computing = threading.Event()
    anatomy = writer_module.anatomy

    def slow_anatomy(*args: Any, **kwargs: Any) -> Any:
        computing.set()
        time.sleep(1.5)
        return anatomy(*args, **kwargs)

    monkeypatch.setattr(writer_module, "anatomy", slow_anatomy)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, tmp_path / "run", timing="cuda", watchdog_timeout_s=0, context_interval_s=0,
                                  control_interval_s=0, flush_interval_s=0.02)  # fmt: skip
    try:
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert computing.wait(5), "the log thread computes a record"
        graph = classes["CUDAGraph"]()
        t0 = time.perf_counter()
        graph.capture_begin()
        took = time.perf_counter() - t0
        graph.capture_end()
    finally:
        watch.close()
    assert took < 0.5, f"capture_begin waited {took:.2f} s for the log thread's arithmetic"
    assert gpu.invalidated == [] and watch.stats()["capture_gate_timeouts"] == 0


def test_a_capture_begun_between_a_steps_queries_and_its_times(layout, monkeypatch) -> None:
    """``elapsed_time`` queries its events: it waits for a capture begun after the step's ``query()``
    calls to end, querying nothing meanwhile; a capture that stays open past ``RESOLVE_WAIT_S``
    makes it raise (the step is tried again at the next pass)."""
    gpu, classes = layout
    gate = CaptureGate().install()
    try:
        m = _pending_step(gate, gpu)
        graph = classes["CUDAGraph"]()
        graph.capture_begin()
        queries = gpu.queries
        result: list[float] = []
        t = threading.Thread(target=lambda: result.append(m.start.elapsed_time(m.end)))
        t.start()
        time.sleep(0.3)
        assert not result and gpu.queries == queries, "no query while the capture is open"
        graph.capture_end()
        t.join(5)
        assert result and result[0] >= 0 and gpu.invalidated == []
        monkeypatch.setattr(devices, "RESOLVE_WAIT_S", 0.2)
        graph.capture_begin()
        with pytest.raises(RuntimeError, match="stayed open"):
            _raise_in_thread(lambda: m.start.elapsed_time(m.end))
        graph.capture_end()
        assert gpu.invalidated == []
    finally:
        gate.remove()


def _raise_in_thread(fn: Any) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if errors:
        raise errors[0]


def test_a_query_stuck_past_the_bound_lets_the_capture_begin_counted_and_logged(layout, monkeypatch, caplog) -> None:
    gpu, classes = layout
    monkeypatch.setattr(devices, "BEGIN_WAIT_S", 0.2)
    gate = CaptureGate().install()
    try:
        m = _pending_step(gate, gpu)
        stuck, release = threading.Event(), threading.Event()
        query = type(m.end).__mro__[1].query

        def stuck_query(self: Any) -> bool:  # a query that does not return (a driver that does not answer)
            stuck.set()
            release.wait(5)
            return query(self)

        monkeypatch.setattr(type(m.end).__mro__[1], "query", stuck_query)
        t = threading.Thread(target=m.end.query)
        t.start()
        assert stuck.wait(5)
        graph = classes["CUDAGraph"]()
        t0 = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
            graph.capture_begin()
        took = time.perf_counter() - t0
        assert 0.15 <= took < 1.0 and gate.waited_out == 1 and gate.open == 1
        assert "capture_gate_timeouts" in caplog.text
        graph.capture_end()
        release.set()
        t.join(5)
    finally:
        gate.remove()


def test_an_end_without_its_begin_leaves_another_capture_open(layout) -> None:
    gpu, classes = layout
    gate = CaptureGate().install()
    try:
        capturing = classes["CUDAGraph"]()
        capturing.capture_begin()
        with pytest.raises(RuntimeError, match="without"):
            classes["CUDAGraph"]().capture_end()  # a graph that never began (the user's mistake)
        assert gate.open == 1 and _in_thread(lambda: _quiet(gate)) is False
        capturing.capture_end()
        assert gate.open == 0
    finally:
        gate.remove()


@pytest.mark.parametrize("path", PATHS)
def test_graph_replays_are_counted(layout, path: str) -> None:
    """A replayed whole step fires no hook of ours: the replays are what tells the watchdog it goes on."""
    _, classes = layout
    gate = CaptureGate().install()
    try:
        graph = classes[PATHS[path]]()
        assert (gate.replays, gate.last_replay) == (0, 0.0)
        t0 = time.perf_counter()
        for _ in range(3):
            graph.replay()
        assert gate.replays == 3 and t0 <= gate.last_replay <= time.perf_counter()
    finally:
        gate.remove()
    graph.replay()
    assert gate.replays == 3, "not counted once removed"
