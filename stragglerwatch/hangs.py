"""Hang diagnosis: pure functions over ranks' published progress and recorded events.

Design (DESIGN.md, "Hangs and timeouts"): when a rank stalls, every rank that can
publishes ``(step, phase, since)``. In a hang caused by one rank, the others wait in
the all-reduce of the latest step: they are *victims*. A *culprit* is a rank stuck
outside a collective, or at an earlier step, or one that published nothing (dead,
or stuck in native code holding the GIL). The same rule serves the live watchdog
(on the states read from the store) and the post-hoc analyzer (on the states the
ranks' events recorded), so both name the same ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

WAITING = "allreduce_wait"
TERMINAL = ("sigterm", "exception", "closed")


def classify(states: dict[int, dict[str, Any] | None], world_size: int) -> dict[str, Any]:
    """Culprits, victims and silent ranks from each rank's ``{"step", "phase"}`` (None: nothing heard)."""
    alive = {r: s for r, s in states.items() if s is not None and 0 <= r < world_size}
    silent = sorted(set(range(world_size)) - set(alive))
    if not alive:
        return {"culprit_ranks": silent, "victim_ranks": [], "silent_ranks": silent, "step": None, "phase": None}
    latest = max(int(s["step"]) for s in alive.values())
    stuck = sorted(r for r, s in alive.items() if s.get("phase") != WAITING or int(s["step"]) < latest)
    culprits = sorted(set(stuck) | set(silent))
    victims = sorted(r for r in alive if r not in culprits)
    first = next((alive[r] for r in stuck), None)
    return {
        "culprit_ranks": culprits,
        "victim_ranks": victims,
        "silent_ranks": silent,
        "step": int(first["step"]) if first else latest,
        "phase": first.get("phase") if first else (WAITING if victims else None),
    }


def _cluster(events: list[dict[str, Any]], gap_s: float) -> list[list[dict[str, Any]]]:
    clusters: list[list[dict[str, Any]]] = []
    for ev in sorted(events, key=lambda e: e.get("detected_at", 0.0)):
        if clusters and ev.get("detected_at", 0.0) - clusters[-1][-1].get("detected_at", 0.0) <= gap_s:
            clusters[-1].append(ev)
        else:
            clusters.append([ev])
    return clusters


def hangs_from_events(
    events: Iterable[dict[str, Any]], world_size: int, last_steps: dict[int, int] | None = None
) -> list[dict[str, Any]]:
    """Hangs of a run from its ranks' events (stall, diagnosis, recovery, sigterm, exception,
    closed) and, when no rank diagnosed anything, from the shape of the logs: at an abnormal
    end, the ranks that left no final record at all are the silent culprits."""
    events = list(events)
    stalls = [e for e in events if e.get("kind") in ("stall", "diagnosis")]
    hangs = []
    for group in _cluster(stalls, gap_s=max([e.get("threshold_s", 0.0) for e in stalls] + [10.0])):
        states: dict[int, dict[str, Any] | None] = {}
        for ev in sorted(group, key=lambda e: e.get("detected_at", 0.0)):
            for rank, state in (ev.get("peers") or {}).items():
                if state is not None:
                    states[int(rank)] = state
            if ev.get("kind") == "stall":  # what the rank itself was doing when it noticed
                states[int(ev["rank"])] = {"step": ev["step"], "phase": ev["phase"]}
        heard_all = any(e.get("kind") == "diagnosis" and e.get("evidence") == "store" for e in group)
        # with only local evidence, a rank that recorded nothing is not known to be silent
        verdict = classify(states, world_size) if heard_all else local_verdict(states, world_size)
        culprit_events = [e for e in group if e.get("kind") == "stall" and int(e["rank"]) in verdict["culprit_ranks"]]
        first = min(group, key=lambda e: e.get("detected_at", 0.0))
        recovered = [
            e for e in events if e.get("kind") == "recovery" and e.get("stall_id") in {x.get("id") for x in group}
        ]
        hangs.append(
            {
                **verdict,
                "detected_at": first.get("detected_at"),
                "waited_s": max(e.get("waited_s", 0.0) for e in group),
                "threshold_s": first.get("threshold_s"),
                "evidence": "store" if heard_all else "local",
                "recovered": bool(recovered),
                "stacks": {str(e["rank"]): e.get("stacks", {}) for e in culprit_events if e.get("stacks")},
            }
        )
    shutdown = _shutdown_hang(events, world_size, last_steps or {})
    if shutdown is not None:
        hangs.append(shutdown)
    return hangs


def local_verdict(states: dict[int, dict[str, Any] | None], world_size: int) -> dict[str, Any]:
    """Without the peers' word: ranks that say they are stuck outside a collective are culprits."""
    heard = {r: s for r, s in states.items() if s is not None}
    verdict = classify(heard, world_size)
    verdict["culprit_ranks"] = [r for r in verdict["culprit_ranks"] if r in heard]
    verdict["silent_ranks"] = []
    return verdict


def _shutdown_hang(events: list[dict[str, Any]], world_size: int, last_steps: dict[int, int]) -> dict[str, Any] | None:
    terminal: dict[int, dict[str, Any]] = {}
    for ev in events:
        if ev.get("kind") in TERMINAL:
            terminal.setdefault(int(ev["rank"]), ev)
            if ev["kind"] != "closed":
                terminal[int(ev["rank"])] = ev
    abnormal = [e for e in terminal.values() if e["kind"] in ("sigterm", "exception")]
    if not abnormal:
        return None
    silent = sorted(r for r in range(world_size) if r not in terminal)
    if silent:
        culprits = silent
    elif last_steps:  # everybody left a record: the ranks that stopped at the earliest step
        lowest = min(last_steps.values())
        culprits = sorted(r for r, s in last_steps.items() if s == lowest and len(set(last_steps.values())) > 1)
    else:
        culprits = []
    first = min(abnormal, key=lambda e: e.get("detected_at", 0.0))
    return {
        "culprit_ranks": culprits,
        "victim_ranks": sorted(r for r in terminal if r not in culprits),
        "silent_ranks": silent,
        "step": first.get("step"),  # where the job was when it went down
        "phase": "unknown (no record: killed?)" if silent else first.get("phase"),
        "detected_at": first.get("detected_at"),
        "waited_s": None,
        "threshold_s": None,
        "evidence": "shutdown",
        "recovered": False,
        "reasons": sorted({str(e.get("reason", e["kind"]))[:200] for e in abnormal}),
        "stacks": {},
    }
