"""When a policy acts on a straggler, and the host lists it writes: pure functions, data in, actions out.

Design: the detector flags a rank as soon as it is consistently slower than its peers by more than its
tolerance (5%), which is right for a report and too eager for an action that drains a node: a healthy
host that drifts by a few percent, or a chance run of slow steps in a two-mode job, is flagged for tens
of steps (the held-out accuracy page counts them). An action therefore asks more of a verdict than a
flag does (:class:`ActRule`): the rank is *still* flagged at the end of the data, has been for at least
``after_s`` seconds and ``min_steps`` steps, is at least ``min_slowdown`` as busy as its peers for the
same work, and its cause is one the user acts on. Load imbalance never reaches here: the detector
compares busy time for the same work, so a rank that draws heavy batches is not flagged.

An episode is one straggler verdict (``detect`` merges stretches a short pause apart); it acts once,
keyed by ``(rank, first_step)``. The same rule serves rank 0's policy thread and the tests, which run it
over simulated healthy jobs of every noise model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: The causes a straggler can be given (``stages.CAUSES``).
CAUSES = ("data", "compute", "optimizer", "other")


@dataclass(frozen=True)
class ActRule:
    """What a straggler verdict must show before a policy acts on it."""

    after_s: float = 300.0  # flagged for at least this long (the job's seconds, from its first flagged step)
    min_slowdown: float = 1.15  # busy time at least this many times its peers', for the same work
    min_steps: int = 200  # flagged for at least this many steps
    causes: tuple[str, ...] = CAUSES  # the causes acted on


def episode(straggler: dict[str, Any]) -> tuple[int, int]:
    """The key of a straggler's episode: its rank and first flagged step."""
    return int(straggler["rank"]), int(straggler["first_step"])


def why_not(straggler: dict[str, Any], rule: ActRule, last_step: int | None) -> str | None:
    """Why ``rule`` does not act on ``straggler`` (a report's ``stragglers`` entry) now, or None when it does.
    ``last_step`` is the report's last step."""
    if straggler.get("last_step") is not None:
        return "no longer flagged"
    if straggler.get("cause") not in rule.causes:
        return f"cause {straggler.get('cause')} is not acted on"
    slowdown = straggler.get("slowdown")
    if slowdown is None or slowdown < rule.min_slowdown:
        return f"slowdown {slowdown} below {rule.min_slowdown}"
    steps = (last_step - int(straggler["first_step"]) + 1) if last_step is not None else 0
    if steps < rule.min_steps:
        return f"flagged for {steps} steps, fewer than {rule.min_steps}"
    span = straggler.get("time_span")
    if not span:
        return "the flagged steps' times are unknown"
    if span[1] - span[0] < rule.after_s:
        return f"flagged for {span[1] - span[0]:.0f} s, less than {rule.after_s:g} s"
    return None


def due(report: dict[str, Any], rule: ActRule, acted: Iterable[tuple[int, int]] = ()) -> list[dict[str, Any]]:
    """The verdicts to act on now: stragglers of ``report`` (``analyze``'s JSON) that ``rule`` accepts and
    whose episode is not in ``acted``. Each is what the action receives (:func:`verdict`)."""
    if report.get("busy_unavailable"):
        return []
    done = set(acted)
    return [verdict(s) for s in report.get("stragglers") or []
            if episode(s) not in done and why_not(s, rule, report.get("last_step")) is None]  # fmt: skip


def verdict(straggler: dict[str, Any]) -> dict[str, Any]:
    """What an ``on_straggler`` action is told of a straggler."""
    span = straggler.get("time_span") or [None, None]
    return {
        "rank": int(straggler["rank"]),
        "host": straggler.get("host"),
        "cause": straggler.get("cause"),
        "since": span[0],  # Unix seconds: the start of its first flagged step
        "since_step": int(straggler["first_step"]),
        "flagged_s": round(span[1] - span[0], 3) if span[0] is not None else None,
        "slowdown": straggler.get("slowdown"),
        "lost_seconds": straggler.get("lost_seconds"),
        "lost_gpu_seconds": straggler.get("lost_gpu_seconds"),
        "where": straggler.get("where"),
        "hints": list(straggler.get("hints") or []),
    }


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def slurm_hostlist(hosts: Iterable[str]) -> str:
    """``hosts`` as one Slurm hostlist expression (``scontrol show hostnames`` reads it back), for
    ``--exclude``: names that differ only in a trailing number of the same width go into one bracket,
    runs of numbers into ranges (``node[01-03,07],login``)."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for host in {h.strip() for h in hosts if h and h.strip()}:
        m = _NUMBERED.match(host)
        if m is None or "[" in host or "," in host:
            plain.add(host)
        else:
            groups.setdefault((m.group(1), len(m.group(2))), set()).add(int(m.group(2)))
    parts = sorted(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        if len(numbers) == 1:
            parts.append(f"{prefix}{next(iter(numbers)):0{width}d}")
            continue
        runs, ordered = [], sorted(numbers)
        start = prev = ordered[0]
        for n in [*ordered[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            runs.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts)


def actions_from_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The policies' actions of a run (its ``action`` events), in time order, as the report lists them:
    ``action`` (``abort`` or ``straggler``), ``rank`` (the rank that acted), ``at`` (Unix seconds), ``restart``,
    and per kind: an abort's ``stall_id``, ``culprit_ranks``, ``exit_status`` and ``bound_s``; a straggler
    action's ``verdict`` (what the actions were told), ``done`` (the actions that ran) and ``exclude_file``."""
    keep = ("stall_id", "culprit_ranks", "victim_ranks", "stalled_s", "exit_status", "bound_s", "verdict",
            "done", "exclude_file")  # fmt: skip
    out = []
    for e in sorted((e for e in events if e.get("kind") == "action"), key=lambda e: e.get("detected_at", 0.0)):
        entry = {"action": e.get("action"), "rank": e.get("rank"), "at": e.get("detected_at"),
                 "restart": e.get("restart", 0)}  # fmt: skip
        entry.update({k: e[k] for k in keep if k in e})
        out.append(entry)
    return out
