"""``on_straggler``: rank 0 acts, once per episode, on a rank that stays a straggler.

Design: a thread of rank 0's (no other rank runs one) follows the run dir every ``policy_interval_s``
with the live analysis the dashboard uses (``analysis.live.LiveRun``: only what is new is read), and
asks the pure rule (``analysis.policy.due``) which verdicts to act on. For each, it runs the actions in
turn (``"exclude"`` writes the straggler's host into the exclusion files, :func:`write_exclusion`; a
callable receives the verdict), then records an ``action`` event in rank 0's events file with what was
done. The episodes an earlier attempt acted on (its events) are not acted on again after a restart.
Nothing here runs on the training thread, and an action that raises or a file that cannot be written is
one log line and a counter. The thread sees the ranks whose logs reach rank 0's run dir: on several
nodes the run dir must be shared (as for ``analyze`` while the job runs); fewer ranks than the world
are said once in the log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stragglerwatch.analysis.policy import ActRule, due, episode, slurm_hostlist
from stragglerwatch.record.events import EventFile, read_events
from stragglerwatch.runtime.log import LOGGER, Problems

if TYPE_CHECKING:  # the analysis (pandas) is imported by the thread, on rank 0 with a policy only
    from stragglerwatch.analysis.live import LiveRun

#: The file the built-in action writes by default, in the run dir; the Slurm hostlist goes beside it.
EXCLUDE_NAME = "excluded-hosts.txt"
SLURM_SUFFIX = ".slurm"


def read_hosts(path: Path) -> list[str]:
    """The hosts of a plain exclusion file (one a line; blank lines and ``#`` comments skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return [h for h in (line.split("#", 1)[0].strip() for line in lines) if h]


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_exclusion(path: Path, host: str) -> list[str]:
    """Add ``host`` to the exclusion file ``path`` (the hosts one a line, kept from earlier jobs) and
    write ``<path>.slurm`` anew (all of them as one Slurm hostlist); each replaced atomically. The hosts."""
    hosts = read_hosts(path)
    if host not in hosts:
        hosts.append(host)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, "".join(f"{h}\n" for h in hosts))
    _replace(path.with_name(path.name + SLURM_SUFFIX), slurm_hostlist(hosts) + "\n")
    return hosts


def acted_before(run_dir: Path) -> set[tuple[int, int]]:
    """The episodes an earlier attempt of the run acted on (its ``action`` events): a restarted job does
    not act again on a straggler it acted on before the restart (steps are numbered on across attempts)."""
    events, _ = read_events(run_dir)
    out = set()
    for e in events:
        verdict = e.get("verdict") if e.get("kind") == "action" and e.get("action") == "straggler" else None
        if isinstance(verdict, dict) and "rank" in verdict and "since_step" in verdict:
            out.add((int(verdict["rank"]), int(verdict["since_step"])))
    return out


class StragglerPolicy:
    """Rank 0's policy thread. ``acted`` holds the verdicts acted on (for the exporter)."""

    def __init__(self, run_dir: Path, rule: ActRule, actions: list[Any], events: EventFile, world_size: int,
                 exclude_file: Path | None = None, interval_s: float = 30.0, problems: Problems | None = None,
                 ids: dict[str, Any] | None = None):  # fmt: skip
        self.run_dir, self.rule, self.actions, self.events = run_dir, rule, actions, events
        self.world_size, self.interval_s = world_size, interval_s
        self.exclude_file = exclude_file or run_dir / EXCLUDE_NAME
        self.problems = problems or Problems()
        self.ids = ids or {}
        self.acted: list[dict[str, Any]] = []
        self.errors = 0
        self.checks = 0
        self._done: set[tuple[int, int]] = set()
        self._live: LiveRun | None = None
        self._said_partial = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stragglerwatch-policy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # our own bug: a line and a counter, never the job
                self.errors += 1
                self.problems.report("policy", f"straggler policy: {type(exc).__name__}: {exc}")

    def check(self) -> list[dict[str, Any]]:
        """One look at the run: the verdicts acted on now."""
        self.checks += 1
        if self._live is None:
            from stragglerwatch.analysis.live import LiveRun

            self._live = LiveRun(self.run_dir)
            self._done |= acted_before(self.run_dir)
        if not self._live.update() and self.checks > 1:
            return []
        report = self._live.analysis.report
        seen = int(report.get("ranks_seen") or 0)
        if 0 < seen < self.world_size and not self._said_partial:
            self._said_partial = True
            self.problems.report("policy", f"straggler policy: rank 0 reads {seen} of {self.world_size} ranks' logs "
                                 f"in {self.run_dir} (is the run dir on a filesystem every node shares?); it judges "
                                 "those it reads")  # fmt: skip
        out = []
        for verdict in due(report, self.rule, self._done):
            self._done.add(episode({"rank": verdict["rank"], "first_step": verdict["since_step"]}))
            self._act(verdict)
            out.append(verdict)
        return out

    def _act(self, verdict: dict[str, Any]) -> None:
        done: list[str] = []
        for action in self.actions:
            name = "exclude" if action == "exclude" else getattr(action, "__qualname__", type(action).__name__)
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
        if "exclude" in done:
            event["exclude_file"] = str(self.exclude_file)
        self.events.write(event)
        LOGGER.warning("stragglerwatch: straggler policy: rank %s (%s, %s, %sx for %s s): %s", verdict["rank"],
                       verdict["host"], verdict["cause"], verdict["slowdown"], verdict["flagged_s"],
                       ", ".join(done) or "no action succeeded")  # an action is said every time, never rate-limited

    def _run_action(self, action: Any, verdict: dict[str, Any]) -> None:
        if action == "exclude":
            if not verdict.get("host"):
                raise ValueError("the rank's host is not known")
            write_exclusion(self.exclude_file, str(verdict["host"]))
        else:
            call: Callable[[dict[str, Any]], Any] = action
            call(dict(verdict))
