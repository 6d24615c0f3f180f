"""``on_straggler``: rank 0 acts, once per episode, on a rank that stays a straggler.

Design: a thread of rank 0's (no other rank runs one) holds no analysis. It starts a child process,
``python -m stragglerwatch.analysis.policyfeed RUN_DIR`` (:class:`ChildFeed`; lower priority, one numpy
thread), that follows the run dir in a bounded window of steps and writes, every ``policy_interval_s``,
one line of JSON: the view the rule needs (``analysis.policy.view``). The thread reads those lines,
continues episodes longer than the window (``policy.Episodes``), asks the pure rule (``policy.due``)
which verdicts to act on, and runs the actions in turn (``"exclude"`` writes the straggler's host into
the exclusion files, :func:`write_exclusion`, when ``policy.exclusion_declined`` finds nothing against
it; a callable receives the verdict), then records an ``action`` event in rank 0's events file with
what was done and what was declined, and why. A straggler busier by design is never acted on: the
policy says so once per episode (a log line and an ``action`` event with nothing done). So rank 0's
process spends on the policy only the parsing of a line every interval; the analysis runs in the child,
on a core the scheduler gives it at a lower priority. A child that dies is started again, at most
``RESTARTS`` times, and said once; where no child can be started the same windowed analysis runs on the
thread (:class:`ThreadFeed`, also what the tests drive), said once.

The episodes an earlier attempt acted on (its events) are not acted on again after a restart. Nothing
here runs on the training thread, and an action that raises or a file that cannot be written is one log
line and a counter. The thread sees the ranks whose logs reach rank 0's run dir: on several nodes the
run dir must be shared (as for ``analyze`` while the job runs); fewer ranks than the world are said
once in the log.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stragglerwatch.analysis.policy import (
    ActRule,
    Episode,
    Episodes,
    Exclusion,
    declined,
    due,
    episode,
    exclusion_note,
    exclusion_text,
    parse_exclusions,
    slurm_hostlist,
)
from stragglerwatch.analysis.policy import verdict as make_verdict
from stragglerwatch.record.events import EventFile, read_events
from stragglerwatch.record.rundir import read_run_meta
from stragglerwatch.runtime.log import LOGGER, Problems

if TYPE_CHECKING:  # the analysis (pandas) is imported by the thread feed only
    from stragglerwatch.analysis.policyfeed import WindowRun

#: The file the built-in action writes by default, in the run dir; the Slurm hostlist goes beside it.
EXCLUDE_NAME = "excluded-hosts.txt"
SLURM_SUFFIX = ".slurm"
#: How long a host stays in the exclusion file by default (``exclude_expire_s``): three days.
EXPIRE_S = 3 * 86400.0
#: Steps of every rank the live analysis keeps by default (``straggler_window_steps``).
WINDOW_STEPS = 2000
#: How many times a dead analysis process is started again.
RESTARTS = 3
FEED_MODULE = "stragglerwatch.analysis.policyfeed"
#: Views in a row with fewer ranks than the world before that is said (the ranks start writing one by one).
PARTIAL_VIEWS = 3


def read_hosts(path: Path) -> list[str]:
    """The hosts of an exclusion file (one a line; blank lines and ``#`` comments skipped), expired or not."""
    return [e.host for e in read_exclusions(path)]


def read_exclusions(path: Path) -> list[Exclusion]:
    """The hosts of an exclusion file, each with its line's comment (rank, cause, evidence, run) and when
    it was added (``Exclusion.added``, None for a line without that time: by hand or an older file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return parse_exclusions(text)[0]


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_exclusion(path: Path, host: str | None, note: str = "", now: float | None = None,
                    expire_s: float | None = EXPIRE_S) -> list[str]:  # fmt: skip
    """Add ``host`` (None: none) to the exclusion file ``path``, its line followed by ``# note``, or renew its
    line; drop the lines added more than ``expire_s`` ago (None: keep all; lines without a time are kept);
    write ``<path>.slurm`` anew (the hosts kept, as one Slurm hostlist); each replaced atomically. The
    hosts kept."""
    now = time.time() if now is None else now
    try:
        before = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        before = ""
    text, kept, _ = exclusion_text(before, (host, note) if host else None, now, expire_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, text)
    _replace(path.with_name(path.name + SLURM_SUFFIX), slurm_hostlist(e.host for e in kept) + "\n")
    return [e.host for e in kept]


def prune_exclusions(path: Path, expire_s: float | None, now: float | None = None) -> list[Exclusion]:
    """Rewrite the exclusion files without the hosts that expired, if any did; those hosts."""
    now = time.time() if now is None else now
    try:
        before = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    _, _, dropped = exclusion_text(before, None, now, expire_s)
    if dropped:
        write_exclusion(path, None, now=now, expire_s=expire_s)
    return dropped


def acted_before(run_dir: Path) -> set[Episode]:
    """The episodes an earlier attempt of the run acted on, or declined (its ``action`` events): a restarted
    job does not act again on a straggler it acted on before the restart (steps are numbered on across
    attempts)."""
    events, _ = read_events(run_dir)
    out = set()
    for e in events:
        verdict = e.get("verdict") if e.get("kind") == "action" and e.get("action") == "straggler" else None
        if isinstance(verdict, dict) and "rank" in verdict and "since_step" in verdict:
            out.add(episode({**verdict, "first_step": verdict["since_step"]}))
    return out


# -- where the views come from --------------------------------------------------------------------------


class ThreadFeed:
    """The windowed analysis on the policy thread itself (no process): the tests', and the fallback."""

    def __init__(self, run_dir: Path, window: int):
        self.run_dir, self.window = run_dir, window
        self.run: WindowRun | None = None

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        if self.run is None:
            from stragglerwatch.analysis.policyfeed import WindowRun

            self.run = WindowRun(self.run_dir, self.window)
        v = self.run.update()
        return [] if v is None else [v]

    def stop(self) -> None:
        self.run = None


class ChildFeed:
    """The windowed analysis in a child process (``policyfeed``), its views read from a pipe."""

    def __init__(self, run_dir: Path, window: int, interval_s: float, problems: Problems,
                 restarts: int = RESTARTS, nice: int = 10):  # fmt: skip
        self.run_dir, self.window, self.interval_s, self.problems = run_dir, window, interval_s, problems
        self.restarts, self.nice = restarts, nice
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0
        self.errors: list[str] = []
        self.last: dict[str, Any] | None = None  # the latest view's bookkeeping (took_s, cells, max_rss_mb)
        self._buf = b""
        self._err: Any = None
        self._said = False

    def command(self) -> list[str]:
        return [sys.executable, "-m", FEED_MODULE, str(self.run_dir), "--window", str(self.window),
                "--interval", f"{self.interval_s:g}", "--nice", str(self.nice)]  # fmt: skip

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "NUMEXPR_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        env.pop("STRAGGLERWATCH_DISABLE", None)
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed when the child ends
        self._buf = b""
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env, close_fds=True)  # fmt: skip
        self.started += 1

    def poll(self, timeout: float) -> list[dict[str, Any]]:
        """The views the child wrote within ``timeout`` seconds (none when it wrote none)."""
        if self.proc is None:
            if self.started > self.restarts:
                return []
            self.start()
        assert self.proc is not None and self.proc.stdout is not None
        out = []
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            end = time.monotonic() + timeout
            while True:
                ready = sel.select(max(0.0, end - time.monotonic()))
                if not ready:
                    break
                data = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not data:
                    self._died()
                    break
                self._buf += data
                *lines, self._buf = self._buf.split(b"\n")
                for line in lines:
                    item = self._parse(line)
                    if item is not None:
                        out.append(item)
                if out:
                    break
        return out

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        try:
            item = json.loads(line)
        except ValueError:
            return None
        if item.get("kind") == "error":
            self.errors.append(str(item.get("error")))
            self.problems.report("policy", f"straggler policy: its analysis process: {item.get('error')}")
            return None
        if item.get("kind") != "view":
            return None
        self.last = {k: item.pop(k, None) for k in ("took_s", "cells", "max_rss_mb")}
        return item

    def _died(self) -> None:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=5)
        tail = ""
        if self._err is not None:
            self._err.seek(0)
            tail = self._err.read()[-600:].decode(errors="replace").strip().replace("\n", " | ")
            self._err.close()
        self.proc = None
        left = self.restarts - self.started + 1
        if not self._said:
            self._said = True
            again = f"started again (at most {self.restarts} times)" if left > 0 else "not started again"
            self.problems.report("policy", f"straggler policy: its analysis process ended (status {code}): {again}"
                                 + (f"; it said: {tail}" if tail else ""))  # fmt: skip
        if left <= 0:
            LOGGER.warning("stragglerwatch: straggler policy: its analysis process ended %d times; the policy "
                           "acts no more in this process", self.started)  # fmt: skip

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the child reads its end's close and ends
            proc.wait(timeout=3)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        for f in (proc.stdout, self._err):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class StragglerPolicy:
    """Rank 0's policy thread. ``acted`` holds the verdicts acted on (for the exporter)."""

    def __init__(self, run_dir: Path, rule: ActRule, actions: list[Any], events: EventFile, world_size: int,
                 exclude_file: Path | None = None, interval_s: float = 30.0, problems: Problems | None = None,
                 ids: dict[str, Any] | None = None, window_steps: int = WINDOW_STEPS,
                 expire_s: float | None = EXPIRE_S, feed: str = "process"):  # fmt: skip
        self.run_dir, self.rule, self.actions, self.events = run_dir, rule, actions, events
        self.world_size, self.interval_s = world_size, interval_s
        self.window_steps, self.expire_s = window_steps, expire_s
        self.exclude_file = exclude_file or run_dir / EXCLUDE_NAME
        self.problems = problems or Problems()
        self.ids = ids or {}
        self.acted: list[dict[str, Any]] = []
        self.left_alone: list[dict[str, Any]] = []
        self.errors = 0
        self.checks = 0
        self.views = 0  # the analysis' views judged
        self.episodes = Episodes()
        self._done: set[Episode] | None = None
        self._said_partial = False
        self._partial = 0  # views in a row that saw fewer ranks than the world
        self._said_skipped = False
        self._run_id: str | None = None
        self.feed: ChildFeed | ThreadFeed = (ChildFeed(run_dir, window_steps, interval_s, self.problems)
                                             if feed == "process" else ThreadFeed(run_dir, window_steps))  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stragglerwatch-policy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.feed.stop()

    def _run(self) -> None:
        if isinstance(self.feed, ThreadFeed) and self._stop.wait(self.interval_s):
            return
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.check(wait_s=1.0 if isinstance(self.feed, ChildFeed) else 0.0)
            except Exception as exc:  # our own bug: a line and a counter, never the job
                self.errors += 1
                self.problems.report("policy", f"straggler policy: {type(exc).__name__}: {exc}")
            pause = self.interval_s if isinstance(self.feed, ThreadFeed) else 1.0 - (time.monotonic() - t0)
            if self._stop.wait(max(0.0, pause)):
                return

    def _start_feed(self) -> None:
        if isinstance(self.feed, ChildFeed) and self.feed.proc is None and not self.feed.started:
            try:
                self.feed.start()
            except OSError as exc:  # no process can be started here: the same analysis on this thread
                self.problems.report("policy", f"straggler policy: cannot start its analysis process ({exc}): it "
                                     "runs on the policy thread instead, in rank 0's process")  # fmt: skip
                self.feed = ThreadFeed(self.run_dir, self.window_steps)

    def check(self, wait_s: float = 0.0) -> list[dict[str, Any]]:
        """One look at what the analysis gave (waiting up to ``wait_s`` for it): the verdicts acted on now."""
        self.checks += 1
        if self._done is None:
            self._done = acted_before(self.run_dir)
            self._run_id = (read_run_meta(self.run_dir) or {}).get("run_id")
            if "exclude" in self.actions:
                for e in prune_exclusions(self.exclude_file, self.expire_s):
                    LOGGER.warning("stragglerwatch: straggler policy: %s left %s (added %s ago)", e.host,
                                   self.exclude_file, _age(e))  # fmt: skip
        self._start_feed()
        out = []
        for view in self.feed.poll(wait_s):
            out += self._judge(view)
        return out

    def _judge(self, view: dict[str, Any]) -> list[dict[str, Any]]:
        assert self._done is not None
        self.views += 1
        self.episodes.carry(view)
        if view.get("skipped") and not self._said_skipped:
            self._said_skipped = True
            self.problems.report("policy", f"straggler policy: {view['skipped']} steps came between two looks of its "
                                 f"analysis, more than its window of {self.window_steps} holds: an episode open at one "
                                 "look and flagged from the next window's start is taken as one; raise "
                                 "straggler_window_steps or lower policy_interval_s")  # fmt: skip
        seen = int(view.get("ranks_seen") or 0)
        self._partial = self._partial + 1 if 0 < seen < self.world_size else 0
        if self._partial >= PARTIAL_VIEWS and not self._said_partial:  # not the ranks' first writes, one by one
            self._said_partial = True
            self.problems.report("policy", f"straggler policy: rank 0 reads {seen} of {self.world_size} ranks' logs "
                                 f"in {self.run_dir} (is the run dir on a filesystem every node shares?); it judges "
                                 "those it reads")  # fmt: skip
        for key, s in declined(view, self.rule, self._done):
            self._done.add(key)
            self._leave(s)
        out = []
        for verdict in due(view, self.rule, self._done):
            self._done.add(episode({**verdict, "first_step": verdict["since_step"]}))
            self._act(verdict)
            out.append(verdict)
        return out

    def _leave(self, s: dict[str, Any]) -> None:
        """A straggler busier by design: said, never acted on."""
        v = make_verdict(s, self.rule)
        why = f"busier by design: {s['by_design']}"
        self.left_alone.append(v)
        self.events.write({"kind": "action", "action": "straggler", "rank": 0, "straggler_rank": v["rank"],
                           "step": v["since_step"], "detected_at": time.time(), "verdict": v, "done": [],
                           "declined": {"all": why}, **self.ids})  # fmt: skip
        LOGGER.warning("stragglerwatch: straggler policy: rank %s (%s, %s, %sx for %s s) left alone: %s", v["rank"],
                       v["host"], v["cause"], v["slowdown"], v["flagged_s"], why)  # fmt: skip

    def _act(self, verdict: dict[str, Any]) -> None:
        done: list[str] = []
        refused: dict[str, str] = {}
        for action in self.actions:
            name = "exclude" if action == "exclude" else getattr(action, "__qualname__", type(action).__name__)
            if action == "exclude" and not verdict["exclude"]:
                refused["exclude"] = str(verdict["not_excluded"])
                continue
            try:
                self._run_action(action, verdict)
                done.append(name)
            except Exception as exc:
                self.errors += 1
                self.problems.report("policy", f"straggler policy: action {name} failed on rank {verdict['rank']}: "
                                     f"{type(exc).__name__}: {exc}")  # fmt: skip
        self.acted.append(verdict)
        event = {"kind": "action", "action": "straggler", "rank": 0, "straggler_rank": verdict["rank"],
                 "step": verdict["since_step"], "detected_at": time.time(), "verdict": verdict, "done": done,
                 **self.ids}  # fmt: skip
        if refused:
            event["declined"] = refused
        if "exclude" in done:
            event["exclude_file"] = str(self.exclude_file)
        self.events.write(event)
        evidence = ", ".join(e["signal"] for e in verdict["host_evidence"]) or "none"
        LOGGER.warning("stragglerwatch: straggler policy: rank %s (%s, %s, %sx for %s s; evidence: %s): %s%s",
                       verdict["rank"], verdict["host"], verdict["cause"], verdict["slowdown"], verdict["flagged_s"],
                       evidence, ", ".join(done) or "no action succeeded",
                       "".join(f"; {k} declined: {v}" for k, v in refused.items()))  # said every time  # fmt: skip

    def _run_action(self, action: Any, verdict: dict[str, Any]) -> None:
        if action == "exclude":
            now = time.time()
            write_exclusion(self.exclude_file, str(verdict["host"]), exclusion_note(verdict, self._run_id, now), now,
                            self.expire_s)  # fmt: skip
        else:
            call: Callable[[dict[str, Any]], Any] = action
            call(dict(verdict))


def _age(e: Exclusion) -> str:
    age = e.age_s()
    return "?" if age is None else f"{age / 3600:.1f} h"
