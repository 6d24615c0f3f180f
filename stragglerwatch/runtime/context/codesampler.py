"""The code sampler: where in the code the training thread is, a few dozen times a second.

Design: a daemon thread of its own reads the training thread's current Python frame
(``sys._current_frames()``, no signal, nothing on the training thread) every ``1 / hz`` seconds,
with the phase the probes say the thread is in (``StepProbe.where``). A sample is counted under
(phase, site, leaf, native): ``site`` is the innermost frame of the user's own code (not the
standard library, not an installed package, not torch, not ours) as ``path:line function``;
``leaf`` is the innermost frame of all but ours (a library's, often); ``native`` says the thread
was inside a call into native code there, which Python cannot see into. Counts are kept per
window (``window_s``) and each window is appended to the run dir's code stream (``codelog.py``).
``analyze`` compares a flagged rank's locations with its peers' over the same span and phase
(``codeprofile.py``). ``top()`` is the latest window's busiest locations, for the exporter.

Cost: one sample walks the frames up to the first user frame and looks each code object up in a
cache (``benchmarks/code_sampler_cost.py`` measures it against an unsampled job); it holds the
GIL for tens of microseconds, so at 20 Hz it takes well under a thousandth of the thread's time.
Never harm training: a failure of ours is one log line and a counter (``errors``).
"""

from __future__ import annotations

import dis
import inspect
import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from stragglerwatch.record.codelog import CODE_SCHEMA, code_path, compact, rows_to_batch
from stragglerwatch.record.streams import SegmentAppender
from stragglerwatch.runtime.log import Problems

#: Most samples per second; the sampler is low-rate by design.
MAX_HZ = 200.0
#: Locations (phase, site) the latest window's ``top()`` names, at most: the exporter's label values.
TOP = 5
#: Frames looked at from the innermost one, at most.
MAX_DEPTH = 128
#: Code that runs in a frame a caller resumes (generators, coroutines): never a thread's outermost frame.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
#: Instructions that call: a frame whose latest instruction is one, with no Python frame above it, is
#: inside a native function (an operator on a native object, such as ``memmap[i]``, is not told apart).
_CALLS = {dis.opmap[n] for n in ("CALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_METHOD",
                                 "CALL_KW", "PRECALL") if n in dis.opmap}  # fmt: skip
_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the package
#: Modules of ours that are a user's training script, not instrumentation: the demo job.
_OUR_SCRIPTS = tuple(_OURS + os.path.join("cli", name) for name in ("demo_job.py", "demo.py"))
_STDLIB = tuple({str(Path(p).resolve()) + os.sep for k in ("stdlib", "platstdlib") if (p := sysconfig.get_path(k))})
_PACKAGES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


class Locator:
    """Turns a frame into (site, leaf, native); caches what it learns of each code object."""

    def __init__(self, cwd: str | None = None):
        self._cwd = (cwd or os.getcwd()).rstrip(os.sep) + os.sep
        self._codes: dict[CodeType, tuple[str, int]] = {}  # code -> (label, kind: 0 ours, 1 library, 2 user)
        torch = sys.modules.get("torch")  # torch built from a source tree is a library too
        where = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep if getattr(torch, "__file__", None) else None
        self._libs = _STDLIB + ((where,) if where else ())

    def _kind(self, code: CodeType) -> tuple[str, int]:
        known = self._codes.get(code)
        if known is not None:
            return known
        name = code.co_filename
        path = os.path.abspath(name) if not name.startswith("<") else name
        if path.startswith(_OURS) and not path.startswith(_OUR_SCRIPTS):
            kind = 0
        elif name.startswith("<frozen") or path.startswith(self._libs) or any(p in path for p in _PACKAGES):
            kind = 1
        else:
            kind = 2
        if len(self._codes) > 50_000:  # code objects of generated code: never grow without end
            self._codes.clear()
        self._codes[code] = known = (self._label(path), kind)
        return known

    def _label(self, path: str) -> str:
        for marker in _PACKAGES:
            if marker in path:
                return path.split(marker, 1)[1]
        if path.startswith(self._cwd):
            return path[len(self._cwd):]
        for root in _STDLIB:
            if path.startswith(root):
                return path[len(root):]
        parts = Path(path).parts
        return os.sep.join(parts[-2:]) if len(parts) > 2 else path

    def locate(self, frame: FrameType | None) -> tuple[str, str, bool] | None:
        """(site, leaf, native) of a thread's innermost frame; None when only our frames are there, or when the
        stack was cut while it was read (it ends in a generator's frame: the thread ran on while this one let go
        of the interpreter lock, and the generator returned, which unlinks its frame from its caller)."""
        leaf: FrameType | None = None
        lib_site: FrameType | None = None
        depth = 0
        last = frame
        while frame is not None and depth < MAX_DEPTH:
            label, kind = self._kind(frame.f_code)
            if kind:
                if leaf is None:
                    leaf = frame
                if kind == 2:
                    break
                if lib_site is None and not label.startswith("torch" + os.sep):
                    lib_site = frame  # a library's own code (not torch's): the site if no user code is found
            last, frame = frame, frame.f_back
            depth += 1
        if leaf is None or (frame is None and last is not None and last.f_code.co_flags & _RESUMABLE):
            return None
        site = frame if frame is not None and depth < MAX_DEPTH else (lib_site or leaf)
        return self._where(site), self._where(leaf), _in_call(leaf)

    def _where(self, frame: FrameType) -> str:
        return f"{self._codes[frame.f_code][0]}:{frame.f_lineno} {frame.f_code.co_name}"


def _in_call(frame: FrameType) -> bool:
    """Whether the frame is inside a call (into native code: a Python callee has its own frame)."""
    try:
        return frame.f_code.co_code[frame.f_lasti] in _CALLS
    except (IndexError, ValueError):
        return False


class CodeSampler:
    """Samples the training thread's code location ``hz`` times a second on its own thread.

    ``where`` returns (thread id, step, phase) of the training thread (the probe's), or None while
    nothing is to be sampled (no step under way, recording off)."""

    def __init__(
        self,
        run_dir: Path | None,
        rank: int,
        where: Callable[[], tuple[int, int, str] | None],
        *,
        hz: float = 20.0,
        window_s: float = 2.0,
        problems: Problems | None = None,
        wall: Callable[[], float] = time.time,
        locator: Locator | None = None,
    ):
        self.run_dir, self.rank = run_dir, rank
        self.interval_s = 1.0 / min(max(float(hz), 0.1), MAX_HZ)
        self.window_s = max(float(window_s), self.interval_s)
        self.problems = problems or Problems()
        self.samples = 0
        self.errors = 0
        self.cost_s = 0.0  # seconds spent sampling, in all
        self._where = where
        self._wall = wall
        self._locator = locator or Locator()
        self._counts: Counter[tuple[str, str, str, bool]] = Counter()
        self._window: list[Any] = [None, None, None, None, 0]  # t0, t1, step0, step1, total
        self._top: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream = SegmentAppender(lambda: code_path(run_dir, rank), CODE_SCHEMA,  # type: ignore[arg-type]
                                       lambda message: self._fail("write", message))  # fmt: skip
        self._thread = threading.Thread(target=self._run, name=f"stragglerwatch-code-{rank}", daemon=True)

    @property
    def file(self) -> Any:
        return self._stream.file

    def start(self) -> CodeSampler:
        self._thread.start()
        return self

    def top(self) -> list[dict[str, Any]]:
        """The latest closed window's locations by share of its samples (at most :data:`TOP`): ``phase``,
        ``site``, ``share``. Replaced whole, never mutated: safe to read from any thread."""
        return self._top

    def _fail(self, kind: str, message: str) -> None:
        self.errors += 1
        self.problems.report(f"code-{kind}", f"code sampler: {message} (training continues)")

    def _run(self) -> None:
        next_at = time.monotonic()
        window_end = next_at + self.window_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # fell behind (a long GIL hold): skip, never catch up in a burst
                next_at = now + self.interval_s
            try:
                self.sample_once()
                if now >= window_end:
                    window_end = now + self.window_s
                    self.close_window()
            except Exception as exc:  # never let the thread die of our own bug
                self._fail("sample", f"{type(exc).__name__}: {exc}")

    def sample_once(self) -> bool:
        """Take one sample now (the thread does this ``hz`` times a second); True when counted."""
        t0 = time.perf_counter()
        where = self._where()
        if where is None:
            return False
        tid, step, phase = where
        found = self._locator.locate(sys._current_frames().get(tid))
        if found is None:
            return False
        with self._lock:
            w = self._window
            if w[0] is None:
                w[0], w[2] = self._wall(), step
            w[1], w[3] = self._wall(), step
            w[4] += 1
            self._counts[(phase, *found)] += 1
            self.samples += 1
        self.cost_s += time.perf_counter() - t0
        return True

    def close_window(self) -> None:
        """Append the window's counts to the stream and start a new window."""
        with self._lock:
            counts, w = self._counts, self._window
            self._counts, self._window = Counter(), [None, None, None, None, 0]
            if not counts:
                return
            total = int(w[4])
            rows = [{"rank": self.rank, "t0": w[0], "t1": w[1], "step0": w[2], "step1": w[3], "phase": phase,
                     "site": site, "leaf": leaf, "native": native, "samples": n, "total": total}
                    for (phase, site, leaf, native), n in counts.most_common()]  # fmt: skip
            by_site: Counter[tuple[str, str]] = Counter()
            for (phase, site, _, _), n in counts.items():
                by_site[(phase, site)] += n
            self._top = [{"phase": p, "site": s, "share": n / total} for (p, s), n in by_site.most_common(TOP)]
            if self.run_dir is not None:
                self._stream.append(rows_to_batch(rows))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, write the last window, compact the stream. Never raises."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        try:
            self.close_window()
            with self._lock:
                self._stream.finish(compact)
                self.run_dir = None
        except Exception as exc:
            self._fail("close", f"cannot finish {self._stream.path} (it stays readable as a stream): {exc}")
