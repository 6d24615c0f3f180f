"""The observer inside the user's process: every wait of ours bounded, memory bounded, hooks scoped to
the watched model, and the process left as it was found after ``close()``."""

from __future__ import annotations

import faulthandler
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from conftest import free_ports, wait_for
from torch import nn

import stragglerwatch
from stragglerwatch.record.events import read_events
from stragglerwatch.runtime.capture import probes
from stragglerwatch.runtime.capture.devices import graph_class
from stragglerwatch.runtime.capture.taps import ISSUE_METHODS, process_group_class, scaler_class, work_class
from stragglerwatch.runtime.output import writer


def quiet(model: nn.Module, run: Path, **settings):
    settings = {"context_interval_s": 0, "control_interval_s": 0, "watchdog_timeout_s": 0, **settings}
    return stragglerwatch.attach(model, run, **settings)


def train(model: nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_another_models_optimizer_does_not_end_the_watched_step(tmp_path: Path) -> None:
    """Two models and two optimizers in one process, one watched: only its optimizer ends its steps, and
    the other's optimizer time is not its optimizer time."""
    watched, other = nn.Linear(8, 8), nn.Linear(8, 8)
    opt_w, opt_o = torch.optim.SGD(watched.parameters(), lr=0.01), torch.optim.SGD(other.parameters(), lr=0.01)
    opt_o.register_step_pre_hook(lambda *_: time.sleep(0.02))  # the other model's optimizer is slow
    watch = quiet(watched, tmp_path / "run")
    for _ in range(6):
        train(watched, opt_w)
        train(other, opt_o)
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    assert sorted(df["step"]) == list(range(6)), "one step per iteration, not two"
    assert (df["optimizer_s"] < 0.01).all(), "the other model's slow optimizer is not the watched one's"


def test_a_loop_without_an_optimizer(tmp_path: Path) -> None:
    """A hand-written update: no optimizer ever steps. The step is closed after MAX_MICRO_BATCHES forwards
    and said to be unavailable; ``watch.step()`` marks the steps instead."""
    model = nn.Linear(8, 8)
    watch = quiet(model, tmp_path / "unmarked")
    for _ in range(probes.MAX_MICRO_BATCHES + 5):
        model(torch.randn(2, 8)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    stats = watch.stats()
    watch.close()
    assert any("watch.step()" in r for r in stats["busy_unavailable"])
    df = stragglerwatch.load_run(tmp_path / "unmarked")
    assert len(df) == 1 and df["micro_batches"].iloc[0] == probes.MAX_MICRO_BATCHES, "closed, not grown forever"
    marked = quiet(model, tmp_path / "marked")
    for _ in range(5):
        model(torch.randn(2, 8)).sum().backward()
        time.sleep(0.005)
        marked.step()
    marked.close()
    df = stragglerwatch.load_run(tmp_path / "marked")
    assert sorted(df["step"]) == list(range(5)) and (df["micro_batches"] == 1).all()
    assert (df["step_s"] >= 0.004).all()


def test_a_manual_step_with_an_optimizer_too(tmp_path: Path) -> None:
    """Once ``watch.step()`` is used, it alone ends steps: two optimizer steps per marked step are one step."""
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = quiet(model, tmp_path / "run")
    watch.step()  # before the loop: steps are marked by hand from the first one
    for _ in range(4):
        train(model, opt, 2)
        watch.step()
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    assert sorted(df["step"]) == list(range(4)) and (df["micro_batches"] == 2).all()


def test_the_queue_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "MAX_QUEUED", 10)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = quiet(model, tmp_path / "run", flush_interval_s=3600)
    train(model, opt, 25)
    assert len(watch._writer._queue) == 10 and watch.stats()["dropped_steps"] == 15
    watch.close()


def test_a_filesystem_that_does_not_answer_costs_the_bound_once(tmp_path: Path, monkeypatch) -> None:
    """A write that never returns (a hung network filesystem): ``flush()`` waits its bound once, then
    not again; ``close()`` returns within ``close_timeout_s``; training goes on at full speed."""
    release = threading.Event()
    real_write = writer.EventLogWriter._write

    def hung(self, records):
        release.wait(60)  # the write does not return until the test lets it
        return real_write(self, records)

    monkeypatch.setattr(writer.EventLogWriter, "_write", hung)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = quiet(model, tmp_path / "run", flush_interval_s=0.05, close_timeout_s=1.0)
    train(model, opt, 3)
    wait_for(lambda: watch._writer._busy_since is not None, 5, "the log thread to be stuck in its write")
    t0 = time.monotonic()
    assert watch.flush(timeout_s=0.5) is False
    first = time.monotonic() - t0
    t0 = time.monotonic()
    for _ in range(20):
        watch.flush(timeout_s=0.5)
        train(model, opt)
    later = time.monotonic() - t0
    assert 0.4 <= first < 1.5 and later < 1.0, f"first flush {first:.2f} s, the next 20 with steps {later:.2f} s"
    t0 = time.monotonic()
    watch.close()
    took = time.monotonic() - t0
    release.set()
    assert took < 1.0 + 2.5, f"close took {took:.1f} s on a filesystem that does not answer"
    assert watch.stats()["problems"], "said, and counted"


def _our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stragglerwatch") and t.is_alive()]


def test_close_leaves_the_process_as_it_found_it(tmp_path: Path) -> None:
    """Handlers, wakeup fd, excepthook, taps, optimizer hooks and threads: after close, as before attach;
    and the faulthandler timer is off (a fork right after close exits cleanly)."""
    import sys

    def user_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, user_handler)
    try:
        before_hook, before_threads = sys.excepthook, _our_threads()
        classes = [(work_class(), "wait"), (scaler_class(), "step")]
        classes += [(process_group_class(), n) for n in ISSUE_METHODS if n in process_group_class().__dict__]
        graph = graph_class()
        classes += [(graph, n) for n in ("capture_begin", "capture_end") if graph is not None and n in graph.__dict__]
        methods = {(c, n): c.__dict__[n] for c, n in classes}
        hooks_before = (len(optimizer_module._global_optimizer_pre_hooks),
                        len(optimizer_module._global_optimizer_post_hooks))  # fmt: skip
        model = nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=30, context_interval_s=1,
                                      prometheus_port=free_ports(1), prometheus_addr="127.0.0.1")  # fmt: skip
        train(model, opt, 3)
        assert signal.getsignal(signal.SIGTERM) != user_handler and _our_threads()
        watch.close()
        wait_for(lambda: not set(_our_threads()) - set(before_threads), 5, "our threads to end")
        assert signal.getsignal(signal.SIGTERM) is user_handler
        assert signal.set_wakeup_fd(-1) == -1, "no wakeup fd left behind"
        assert sys.excepthook is before_hook
        assert all(c.__dict__[n] is m for (c, n), m in methods.items()), "every tap taken off"
        assert (len(optimizer_module._global_optimizer_pre_hooks), len(optimizer_module._global_optimizer_post_hooks)) \
            == hooks_before, "the optimizer hooks taken off"
        faulthandler.dump_traceback_later(3600)  # re-arming works and nothing of ours is armed any more
        faulthandler.cancel_dump_traceback_later()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_closed_off_the_main_thread_the_handler_passes_signals_on(tmp_path: Path) -> None:
    """close() from another thread cannot restore signal handlers: ours stays, but only passes the signal
    on to what came before it, records nothing, and a second attach chains through it."""
    seen = []

    def user_handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, user_handler)
    try:
        model = nn.Linear(8, 8)
        watch = quiet(model, tmp_path / "run", watchdog_timeout_s=30)
        closer = threading.Thread(target=watch.close)
        closer.start()
        closer.join(10)
        second = quiet(model, tmp_path / "run2", watchdog_timeout_s=30)
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert seen == [signal.SIGTERM], "the user's handler ran once"
        events, _ = read_events(tmp_path / "run")
        assert "sigterm" not in [e["kind"] for e in events], "the closed watch recorded nothing"
        second.close()
        events, _ = read_events(tmp_path / "run2")
        assert [e["kind"] for e in events].count("sigterm") == 1, "the open one did"
    finally:
        signal.signal(signal.SIGTERM, previous)
