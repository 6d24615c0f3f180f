"""The Python entry point of the analysis: :func:`analyze` runs what ``stragglerwatch analyze`` runs and
returns the typed report, which renders itself as the command's text, JSON and HTML.

    report = stragglerwatch.analyze("stragglerwatch-runs/RUN_ID")
    for s in report.stragglers:
        print(s.rank, s.cause, s.saves_seconds)
    print(report.to_text())

The command line, the examples and the docs go through it, so every view reads the same report.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stragglerwatch._units import parse_slowdown
from stragglerwatch.analysis.report import Analysis, analyze_run, empty_analysis
from stragglerwatch.analysis.reportschema import Report
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.record.steplog import RunDirError
from stragglerwatch.runtime.config import ConfigError

#: The detector's settings ``analyze`` takes by keyword (``DetectConfig``'s fields), with the range each
#: must lie in: (lowest, highest, what it is). None: unbounded on that side.
SETTINGS: dict[str, tuple[float | None, float | None, str]] = {
    "window": (2, None, "steps of the short median a flag must persist over"),
    "level_window": (2, None, "steps of the level median"),
    "confirm": (1, None, "consecutive steps a test must hold"),
    "min_slowdown": (1.0, 1.99, "the smallest slowdown flagged, a ratio to the peers' busy time: 1.06 or '6%' is "
                     "6% busier"),
    "tolerance": (1.0, 1.99, "a slowdown ratio: a rank this much slower from the start is healthy"),
    "z": (0.1, None, "the level test's margin, in standard errors"),
    "decision": (0.1, None, "the CUSUM's alarm level, in nats"),
    "min_cost_share": (0.0, 0.99, "the least share of the job's time a flag must cost while it lasts"),
}
#: The settings that are slowdowns: given as ratios (``_units``), held by ``DetectConfig`` as fractions.
RATIOS = ("min_slowdown", "tolerance")
ENGINES = ("local", "ray")
#: What ``analyze --fail-on`` (and :meth:`AnalysisReport.findings`) can fail on.
FINDINGS = ("straggler", "hang", "imbalance")


class AnalysisReport(Report):
    """A :class:`~stragglerwatch.analysis.reportschema.Report` as :func:`analyze` returns it: the same fields,
    and the views of the command line. ``to_dict()`` is ``analyze --format json``'s object."""

    _analysis: Analysis | None = None

    def to_text(self, width: int = 80) -> str:
        """``analyze``'s text report."""
        from stragglerwatch.presentation.render import render_text

        return render_text(self.to_dict(), width)

    def to_html(self) -> str:
        """``analyze --format html``'s page (its figures need every step, so not for the Ray engine)."""
        from stragglerwatch.presentation.htmlreport import render_html

        if self._analysis is None or not self._analysis.matrix.values:
            raise ValueError("the HTML report needs every step of every rank in this process: analyze with "
                             "engine='local'")  # fmt: skip
        return render_html(dataclasses.replace(self._analysis, report=self.to_dict()))

    def findings(self, kinds: Iterable[str] = FINDINGS) -> list[str]:
        """One line per finding of ``kinds`` (of :data:`FINDINGS`): what ``analyze --fail-on`` exits 1 for."""
        unknown = sorted(set(kinds) - set(FINDINGS))
        if unknown:
            raise ConfigError(f"unknown finding kind(s) {', '.join(unknown)}; known: {', '.join(FINDINGS)}")
        out = []
        if "straggler" in kinds:
            out += [f"straggler: rank {s.rank} ({s.cause}, {s.slowdown:.2f}x from step {s.first_step})"
                    for s in self.stragglers]  # fmt: skip
        if "hang" in kinds:
            out += [f"hang: culprit rank(s) {', '.join(map(str, h.get('culprit_ranks') or [])) or 'unknown'} at step "
                    f"{h.get('step')}" for h in self.hangs]  # fmt: skip
            verdict = self.hang_verdict
            if not self.hangs and verdict:  # PyTorch's logs or dumps alone saw it
                culprits = ", ".join(map(str, verdict.get("culprit_ranks") or [])) or "unknown"
                out.append(f"hang: culprit rank(s) {culprits} (decided by {verdict.get('decided_by') or '?'})")
        if "imbalance" in kinds:
            out += [f"imbalance: group {g.group} {g.slowdown:.2f}x as busy as the others" for g in self.group_imbalance]
            if self.imbalance is not None and self.imbalance.detected:
                s = self.imbalance.slowdown
                out.append(f"imbalance: unequal {self.imbalance.unit or 'work'}" + (f" (S {s:.2f})" if s else ""))
        return out


def detect_config(settings: dict[str, Any]) -> DetectConfig:
    """The detector's settings, each checked: :class:`ConfigError` names the setting, the value and what is
    allowed. None leaves a setting at its default."""
    given = {k: v for k, v in settings.items() if v is not None}
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown analysis setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    for name, value in given.items():
        lo, hi, what = SETTINGS[name]
        if name in RATIOS:
            try:
                given[name] = parse_slowdown(name, value, lo, hi, inclusive=name == "tolerance") - 1.0
            except ValueError as exc:
                raise ConfigError(f"{exc} ({what})") from None
            continue
        integer = isinstance(lo, int) and not isinstance(lo, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            kind = "an integer" if integer else "a number"
            raise ConfigError(f"{name}={value!r} is not {kind} ({what})")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
            raise ConfigError(f"{name}={value!r} is out of range: {bounds} ({what})")
    if given.get("level_window", DetectConfig.level_window) < given.get("window", DetectConfig.window):
        raise ConfigError("level_window must be at least window")
    return DetectConfig(**given)


def _stage_ticks(progress: Callable[[int, int], None] | None, total: int) -> Callable[[str], None] | None:
    """A ``progress(done, total)`` told of each stage of ``total`` as one step."""
    if progress is None:
        return None
    done = [0]

    def tick(stage: str) -> None:
        done[0] = min(done[0] + 1, total - 1)
        progress(done[0], total)

    return tick


def analyze(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    engine: str = "local",
    address: str | None = None,
    logs: Iterable[str | os.PathLike[str]] = (),
    flight_recorder: str | os.PathLike[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    **settings: Any,
) -> AnalysisReport:
    """Analyse a run dir (and PyTorch's failure logs, ``logs``, and Flight Recorder dumps, a dir or a file:
    ``flight_recorder``): stragglers with cause and cost, hangs, imbalance, attempts. ``engine="ray"``
    runs it on the Ray cluster at ``address`` (None: a local one). ``settings`` are the detector's
    (:data:`SETTINGS`, e.g. ``min_slowdown=1.06`` (or ``"6%"``) for the fixed floor of earlier releases).

    Raises :class:`RunDirError` for a run dir that cannot be read (or holds no step and no hang),
    :class:`ConfigError` for a setting that cannot be used, ``ValueError`` for unreadable logs or dumps;
    each message is one line."""
    from stragglerwatch.evidence.combine import add_flight_recorder, add_hang_verdict, add_pytorch_logs
    from stragglerwatch.evidence.torchlogs import parse_files

    config = detect_config(settings)
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not one of {', '.join(ENGINES)}")
    if address is not None and engine != "ray":
        raise ConfigError("address is the Ray cluster's: give engine='ray' with it")
    logs = [str(p) for p in logs]
    if run_dir is None and not logs and flight_recorder is None:
        raise ConfigError("nothing to analyse: give a run dir, logs or flight_recorder")
    if run_dir is None:
        analysis = empty_analysis()
    elif engine == "ray":
        from stragglerwatch.analysis.rayengine import STAGES, analyze_on_ray

        analysis = analyze_on_ray(run_dir, config, address=address, progress=_stage_ticks(progress, STAGES))
        if progress:
            progress(STAGES, STAGES)
    else:
        analysis = analyze_run(run_dir, config, progress=progress)
    report = analysis.report
    if run_dir is not None and report["steps"] == 0 and not (logs or flight_recorder) and not report["hangs"]:
        raise RunDirError(f"{Path(run_dir)}: empty run (no step recorded yet)")
    if logs:
        add_pytorch_logs(report, parse_files(logs))
    add_flight_recorder(report, None if flight_recorder is None else str(flight_recorder))
    add_hang_verdict(report)
    return as_report(analysis)


def as_report(analysis: Analysis) -> AnalysisReport:
    """The typed report of ``analysis`` (its JSON object, with what the evidence added), keeping the
    analysis for the HTML page."""
    typed = Report.from_dict(analysis.report)
    out = AnalysisReport(**{f.name: getattr(typed, f.name) for f in dataclasses.fields(Report)})
    out._analysis = analysis
    return out
