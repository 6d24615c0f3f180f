"""Hang diagnosis: pure functions over ranks' published progress and recorded events.

Design (docs/hangs.md, "The watchdog"): when a rank stalls, every rank that can
publishes ``(step, phase, since)`` and ``collectives``: for each process group, how
many collectives it has *issued* (the group's own sequence number, which counts
DDP's C++ all-reduces and broadcasts too). A collective completes only when every
member has issued it, so a rank that issued more in a group than another member
is waiting for it: that is a wait-for edge. The *culprits* are the ranks that others
wait for and that wait for nobody (or, in a cycle of waits, the ranks of the cycle),
plus ranks that published nothing (dead, or stuck in native code holding the GIL);
everybody else is a *victim*. This holds on NCCL too, where the host does not block
in the collective and victims stop later, at a host sync, in whatever phase that is.

On NCCL a GPU that never finishes a kernel leaves every host's *issued* counts equal (each
host enqueues the same collectives, then blocks at its next host sync): there what
*completed* decides: per group the last collective started and completed (Flight
Recorder's status), or where each GPU is by the probe's latest completed CUDA events (a
victim's GPU waits inside a collective, the culprit's is stuck elsewhere or behind).
Where no count decides, the phase does, as on a host-blocking backend: ranks waiting in a
collective (``allreduce_wait``, ``collective_wait``) at the latest step are victims,
a rank stuck elsewhere or at an earlier step is a culprit. A rule that would blame every
rank, or none of several, decides nothing: the verdict is then ``undecided``, with the
evidence, never "every rank". The same rules serve the
live watchdog (on the states read from the store) and the post-hoc analyzer (on the
states the ranks' events recorded), so both name the same ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

WAITING = ("allreduce_wait", "collective_wait")
TERMINAL = ("sigterm", "exception", "closed")
#: What a rank's note may hold beside its issued counts: per group the last collective started and
#: completed (Flight Recorder's status), and where its GPU is (``devices.device_progress``).
PROGRESS_KEYS = ("started", "completed", "device")
#: The per-group counts that can decide, in the order they are tried, and the basis each names.
COUNT_RULES = (("collectives", "collective counts"), ("started", "started counts"),
               ("completed", "completed counts"))  # fmt: skip


def waits_for(states: dict[int, dict[str, Any]], key: str = "collectives") -> dict[int, set[int]]:
    """For each rank, the ranks it waits for: members of a group with a lower count under ``key``
    (issued, started or completed collectives)."""
    groups: dict[str, dict[int, int]] = {}
    for rank, state in states.items():
        for group, count in (state.get(key) or {}).items():
            groups.setdefault(str(group), {})[rank] = int(count)
    edges: dict[int, set[int]] = {r: set() for r in states}
    for counts in groups.values():
        for r, c in counts.items():
            edges[r].update(s for s, d in counts.items() if d < c)
    return edges


def _reachable_cycle(edges: dict[int, set[int]], blamed: set[int]) -> set[int]:
    """Ranks on a cycle of waits (A waits for B in one group, B for A in another)."""
    on_cycle = set()
    for start in blamed:
        seen, todo = set(), list(edges.get(start, ()))
        while todo:
            r = todo.pop()
            if r == start:
                on_cycle.add(start)
                break
            if r not in seen:
                seen.add(r)
                todo.extend(edges.get(r, ()))
    return on_cycle


def _by_counts(alive: dict[int, dict[str, Any]], key: str) -> list[int] | None:
    """The ranks the others wait for by the counts under ``key``; None when some rank has no such
    counts or they are equal in every group (they do not decide)."""
    if not all(s.get(key) for s in alive.values()):
        return None
    edges = waits_for(alive, key)
    blamed = set().union(*edges.values())
    if not blamed:
        return None
    waiting = {r for r, e in edges.items() if e}
    return sorted((blamed - waiting) or _reachable_cycle(edges, blamed) or blamed)


def _device(state: dict[str, Any]) -> dict[str, Any] | None:
    d = state.get("device")
    return d if isinstance(d, dict) and d.get("step") is not None and d.get("phase") else None


def _by_phases(alive: dict[int, dict[str, Any]], where: Any) -> list[int] | None:
    """Ranks not waiting in a collective at the latest step, by ``where(state) -> (step, phase)``;
    None where that blames every rank or none of several (it tells no culprit from a victim)."""
    at = {r: where(s) for r, s in alive.items()}
    latest = max(int(step) for step, _ in at.values())
    stuck = sorted(r for r, (step, phase) in at.items() if phase not in WAITING or int(step) < latest)
    if len(alive) > 1 and len(stuck) in (0, len(alive)):
        return None
    return stuck


def _waiting(state: dict[str, Any]) -> bool:
    """Blocked in a collective, on the host or (where known) on the GPU."""
    device = _device(state)
    return state.get("phase") in WAITING or (device is not None and device["phase"] in WAITING)


def _owes_nothing(state: dict[str, Any]) -> bool:
    """Every collective it issued has completed (where that is known), and its GPU, where known, is not in
    one: nothing of the others' can hold it, so its stall is its own (a checkpoint, a compile, its loader)."""
    issued, completed = state.get("collectives") or {}, state.get("completed")
    if not issued or not isinstance(completed, dict):
        return False
    done = {str(g): int(c) for g, c in completed.items()}
    device = _device(state)
    return all(done.get(str(g), -1) >= int(c) for g, c in issued.items()) and (
        device is None or device["phase"] not in WAITING)


def _undecided(alive: dict[int, dict[str, Any]]) -> str:
    """What was compared, for a verdict that names nobody."""
    def counts(s: dict[str, Any], key: str) -> str:
        return ",".join(f"{g}:{c}" for g, c in sorted((s.get(key) or {}).items())) or "?"

    parts = []
    for r, s in sorted(alive.items()):
        text = f"rank {r}: step {s.get('step')} {s.get('phase')}, issued {counts(s, 'collectives')}"
        if s.get("completed"):
            text += f", completed {counts(s, 'completed')}"
        if _device(s):
            text += f", GPU in {s['device']['phase']} (step {s['device']['step']})"
        parts.append(text)
    return ("no rank is behind the others: every one issued and completed the same collectives and is "
            "in the same kind of phase; " + "; ".join(parts))  # fmt: skip


def classify(states: dict[int, dict[str, Any] | None], world_size: int) -> dict[str, Any]:
    """Culprits, victims and silent ranks from each rank's ``{"step", "phase", "collectives"}`` and,
    where known, what it completed (:data:`PROGRESS_KEYS`); None: nothing heard.

    The rules, in order, each used only where it decides: the collectives each rank *issued* per
    group, then the silent ranks (the others issued the same and wait for them; a rank all of whose
    collectives completed waits for nobody and is behind with them), the collectives
    *started* and *completed* per group (on NCCL a stuck GPU leaves the issued counts equal), where
    each GPU is (inside a collective or not), and last the host phases. ``basis`` names the rule;
    where none decides, ``basis`` is ``undecided``, ``culprit_ranks`` holds only silent ranks, and
    ``detail`` says what was compared: never "every rank"."""
    alive = {r: s for r, s in states.items() if s is not None and 0 <= r < world_size}
    silent = sorted(set(range(world_size)) - set(alive))
    if not alive:
        return {"culprit_ranks": silent, "victim_ranks": [], "silent_ranks": silent, "step": None, "phase": None,
                "basis": "silence", "undecided": False}  # fmt: skip
    counted = all(s.get("collectives") for s in alive.values())
    stuck, basis = _by_counts(alive, "collectives"), "collective counts"
    if stuck is None and counted and silent:  # every rank that spoke issued the same: they wait for the silent,
        # all but those with nothing pending (a lone rank that noticed its own pause before its peers spoke)
        stuck = [r for r, s in alive.items() if _owes_nothing(s)]
    for key, name in COUNT_RULES[1:]:
        if stuck is None:
            stuck, basis = _by_counts(alive, key), name
    on_device = stuck is None and all(_device(s) for s in alive.values())
    if on_device:
        stuck, basis = _by_phases(alive, lambda s: (s["device"]["step"], s["device"]["phase"])), "device progress"
    if stuck is None:
        stuck, basis = _by_phases(alive, lambda s: (s["step"], s.get("phase"))), "phases"
    undecided = stuck is None and not silent
    if stuck is None:  # nobody is behind: the silent ranks, if any, are what the others wait for
        stuck, basis = [], "undecided" if undecided else "silence"
    culprits = sorted(set(stuck) | set(silent))
    victims = sorted(r for r in alive if r not in culprits and (not undecided or _waiting(alive[r])))
    first = next((alive[r] for r in stuck), None)
    latest_state = max(alive.values(), key=lambda s: int(s["step"]))
    # behind, yet itself blocked in a collective: a collective the others never issue (mismatch)?
    mismatch = basis == "collective counts" and bool(stuck) and all(alive[r].get("phase") in WAITING for r in stuck)
    phase = first.get("phase") if first else (latest_state.get("phase") if victims else None)
    if first is not None and basis == "device progress":
        phase = f"{first['device']['phase']} (on the GPU)"
    verdict = {
        "culprit_ranks": culprits,
        "victim_ranks": victims,
        "silent_ranks": silent,
        "step": int(first["step"]) if first else int(latest_state["step"]),
        "phase": phase,
        "basis": basis,
        "mismatch_suspected": mismatch,
        "undecided": undecided,
    }
    if undecided:
        verdict["detail"] = _undecided(alive)
    return verdict


def _cluster(events: list[dict[str, Any]], gap_s: float, ended: dict[Any, float],
             ended_step: dict[Any, int] | None = None) -> list[list[dict[str, Any]]]:  # fmt: skip
    """Stall and diagnosis events in clusters, one hang each. A diagnosis joins the cluster of the stall it
    speaks of. A stall joins the cluster before it when it came within ``gap_s`` of that cluster's last
    event, or when it had begun by then (a rank that held the GIL in native code could not run its watchdog:
    it notices its stall late, once it runs again, however long the hold; its stall overlapped the others'
    all the same) -- unless every stall of that cluster had ended (``ended``: stall id -> when its rank was
    seen to move on) before this one was noticed, and this one is at a later step or began after the last of
    those ends: then the job moved on in between, and this is the next hang (a checkpoint, then a compile a
    few steps later, are two pauses, not one)."""
    clusters: list[list[dict[str, Any]]] = []
    of_stall: dict[Any, list[dict[str, Any]]] = {}
    for ev in sorted(events, key=lambda e: e.get("detected_at", 0.0)):
        if ev.get("kind") == "diagnosis" and ev.get("stall_id") in of_stall:
            of_stall[ev["stall_id"]].append(ev)
            continue
        last = clusters[-1][-1].get("detected_at", 0.0) if clusters else None
        overlapped = ev.get("kind") == "stall" and ev.get("since") is not None and last is not None \
            and ev["since"] <= last  # fmt: skip
        if last is not None and (ev.get("detected_at", 0.0) - last <= gap_s or overlapped) \
                and not _moved_on_before(clusters[-1], ev, ended, ended_step):  # fmt: skip
            clusters[-1].append(ev)
        else:
            clusters.append([ev])
        if ev.get("kind") == "stall":
            of_stall[ev.get("id")] = clusters[-1]
    return clusters


def _moved_on_before(cluster: list[dict[str, Any]], ev: dict[str, Any], ended: dict[Any, float],
                     ended_step: dict[Any, int] | None = None) -> bool:  # fmt: skip
    """Whether every stall of ``cluster`` had ended before the stall ``ev`` was noticed, and ``ev`` is
    a new one: at a later step than all of them, or begun after the last of them ended. A stall whose
    recovery was recorded late (its rank held the GIL again right after, so its watchdog could not run)
    ended in time all the same when that recovery found its rank at ``ev``'s step or later
    (``ended_step``): the rank had left its stalled step before the job got to ``ev``'s."""
    stalls = [e for e in cluster if e.get("kind") == "stall"]
    if ev.get("kind") != "stall" or not stalls or any(e.get("id") not in ended for e in stalls):
        return False
    step = int(ev.get("step", -1))
    later_step = step > max(int(e.get("step", -1)) for e in stalls)
    at_step = ended_step or {}
    in_time = [ended[e.get("id")] <= ev.get("detected_at", 0.0)
               or (later_step and at_step.get(e.get("id"), -1) >= step) for e in stalls]  # fmt: skip
    if not all(in_time):
        return False
    last_end = max(ended[e.get("id")] for e in stalls)
    return later_step or float(ev.get("since") or 0.0) >= last_end


def hangs_from_events(
    events: Iterable[dict[str, Any]], world_size: int, last_steps: dict[int, int] | None = None
) -> list[dict[str, Any]]:
    """Hangs of a run from its ranks' events (stall, diagnosis, recovery, sigterm, exception,
    closed) and, when no rank diagnosed anything, from the shape of the logs: at an abnormal
    end, the ranks that left no final record at all are the silent culprits."""
    events = list(events)
    stalls = [e for e in events if e.get("kind") in ("stall", "diagnosis")]
    hangs = []
    recoveries = [e for e in events if e.get("kind") == "recovery"]
    ended = {e.get("stall_id"): e.get("detected_at", 0.0) for e in recoveries}
    ended_step = {e.get("stall_id"): int(e["step"]) for e in recoveries if isinstance(e.get("step"), int)}
    for group in _cluster(stalls, max([e.get("threshold_s", 0.0) for e in stalls] + [10.0]), ended, ended_step):
        states: dict[int, dict[str, Any] | None] = {}
        for ev in sorted(group, key=lambda e: e.get("detected_at", 0.0)):
            for rank, state in (ev.get("peers") or {}).items():
                if state is not None:
                    states[int(rank)] = state
            if ev.get("kind") == "stall":  # what the rank itself was doing when it noticed
                states[int(ev["rank"])] = {"step": ev["step"], "phase": ev["phase"],
                                           "collectives": ev.get("collectives"),
                                           **{k: ev[k] for k in PROGRESS_KEYS if ev.get(k) is not None}}  # fmt: skip
        heard_all = any(e.get("kind") == "diagnosis" and e.get("evidence") == "store" for e in group)
        # with only local evidence, a rank that recorded nothing is not known to be silent
        verdict = classify(states, world_size) if heard_all else local_verdict(states, world_size)
        culprit_events = [e for e in group if e.get("kind") == "stall" and int(e["rank"]) in verdict["culprit_ranks"]]
        first = min(group, key=lambda e: e.get("detected_at", 0.0))
        recovered = _recovered(group, events)
        ids = {e.get("id") for e in group if e.get("kind") == "stall"}
        aborted = sorted({int(e["rank"]) for e in events if _aborted(e) and e.get("stall_id") in ids})
        busy = _busy(events, ids, verdict["culprit_ranks"])
        hangs.append(
            {
                **verdict,
                "detected_at": first.get("detected_at"),
                "waited_s": max(e.get("waited_s", 0.0) for e in group),
                "threshold_s": first.get("threshold_s"),
                "evidence": "store" if heard_all else "local",
                "recovered": bool(recovered),
                "stacks": _culprit_stacks(culprit_events, events, verdict["culprit_ranks"], first, _began(group)),
                **({"aborted_ranks": aborted} if aborted else {}),  # ended by the hang policy (``on_hang``)
                **({"busy": busy} if busy else {}),  # culprits at work, not hung (the policy's ``confirm``)
            }
        )
    shutdown = _shutdown_hang(events, world_size, last_steps or {})
    if shutdown is not None:
        stuck = hangs[-1] if hangs and not hangs[-1]["recovered"] else None
        if stuck is not None and set(shutdown["culprit_ranks"]) <= set(stuck["culprit_ranks"]):
            stuck["ended"] = {"at": shutdown["detected_at"], "reasons": shutdown["reasons"]}  # the stall's end
        else:
            hangs.append(shutdown)
    return hangs


_UNWIND_S = 5.0  # a "recovery" this close to the rank's exception or SIGTERM is the crash unwinding


def _aborted(event: dict[str, Any]) -> bool:
    """An event of the hang policy ending its rank (``on_hang="abort"``)."""
    return event.get("kind") == "action" and event.get("action") == "abort"


def _busy(events: list[dict[str, Any]], ids: set[Any], culprits: list[int]) -> dict[str, str]:
    """What the culprits of a stall were doing, by rank: what the hang policy saw while it waited for them
    (``deferred`` events), else a culprit's own last progress when it recovered."""
    out: dict[str, str] = {}
    for e in sorted(events, key=lambda e: e.get("detected_at", 0.0)):
        if e.get("stall_id") not in ids:
            continue
        if e.get("kind") in ("deferred", "recovery") and isinstance(e.get("busy"), dict):
            out.update({str(r): str(d) for r, d in e["busy"].items()})
        if e.get("kind") == "recovery" and e.get("doing") and e.get("rank") in culprits:
            out.setdefault(str(e["rank"]), str(e["doing"]))
    return out


def _recovered(group: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
    """Whether the stall ended in progress: a rank moved on, and not because its collective failed
    or it was being torn down (a victim moves on only once the culprit has issued the collective)."""
    ids = {x.get("id") for x in group}
    ends = {}
    for e in events:
        if e.get("kind") in ("exception", "sigterm") or _aborted(e):
            ends.setdefault(int(e["rank"]), []).append(e.get("detected_at", 0.0))
    moved = {int(e["rank"]) for e in events if e.get("kind") == "recovery" and e.get("stall_id") in ids
             and not any(abs(t - e.get("detected_at", 0.0)) <= _UNWIND_S for t in ends.get(int(e["rank"]), []))}
    return bool(moved)


def _began(group: list[dict[str, Any]]) -> float | None:
    """When the latest stall of a cluster began (Unix seconds; None: its stalls do not say). One cluster can
    hold a stall that recovered and the next one, a few seconds later: the verdict, from each rank's latest
    state, speaks of the later one."""
    return max((float(e["since"]) for e in group if e.get("kind") == "stall" and e.get("since") is not None),
               default=None)  # fmt: skip


#: The first line of a faulthandler dump, and when it was written where ``NativeStacks.collect`` said so.
_DUMP = re.compile(r"^Timeout \([^)\n]*\)!(?: dumped at (\d+(?:\.\d+)?))?", re.MULTILINE)


def native_dumps(text: str) -> list[tuple[float | None, str]]:
    """The faulthandler dumps in ``text``, each with when it was written (None: not said, an older record)."""
    heads = list(_DUMP.finditer(text))
    ends = [m.start() for m in heads[1:]] + [len(text)] if heads else []
    return [(float(m[1]) if m[1] else None, text[m.start() : end]) for m, end in zip(heads, ends, strict=True)]


def _culprit_stacks(
    stalls: list[dict[str, Any]], events: list[dict[str, Any]], culprits: list[int], first: dict[str, Any],
    began: float | None = None,
) -> dict[str, dict[str, str]]:  # fmt: skip
    """Each culprit's stacks: faulthandler's dump when the rank was stuck in native code holding
    the GIL (its own watchdog could not run then, so its stall event, if any, came late), else the stacks
    its watchdog took at the stall. Of the dumps it collected since the cluster began, the first written
    once the stall the verdict speaks of had begun (``began``), else the last one before: an earlier
    dump, of an earlier hold or of a rank too loaded to run its watchdog for a while, shows where the
    rank was then, not where this stall holds it. Dumps that do not say when they were written (older
    records): the first collected after the stall began, as they come."""
    out = {str(e["rank"]): e["stacks"] for e in stalls if e.get("stacks")}
    start = first.get("detected_at", 0.0) - (first.get("threshold_s") or 0.0)
    began = start if began is None else max(began, start)
    collected = sorted((e for e in events if e.get("kind") == "native_stacks" and e.get("detected_at", 0.0) >= start),
                       key=lambda e: e.get("detected_at", 0.0))  # fmt: skip
    for rank in culprits:
        texts = [(ev.get("stacks") or {}).get("faulthandler") or "" for ev in collected if ev.get("rank") == rank]
        texts += [(e.get("stacks") or {}).get("faulthandler") or "" for e in stalls if int(e["rank"]) == rank]
        dumps = sorted({(at, dump) for text in texts for at, dump in native_dumps(text) if at is not None})
        if dumps:
            dump = next((d for at, d in dumps if at >= began), dumps[-1][1])
            out[str(rank)] = {**out.get(str(rank), {}), "faulthandler": dump}
            continue
        ev = next((ev for ev in collected if ev.get("rank") == rank), None)
        if ev is not None:  # the first dump after the stall, as an older record holds it
            out[str(rank)] = ev.get("stacks") or {}
    return out


def local_verdict(states: dict[int, dict[str, Any] | None], world_size: int) -> dict[str, Any]:
    """Without the peers' word: ranks that say they are stuck outside a collective are culprits
    (one rank's counts alone cannot show who is behind)."""
    heard = {r: {k: v for k, v in s.items() if k != "collectives"} for r, s in states.items() if s is not None}
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


#: Seconds a culprit that leaves no note (dead, or holding the GIL in native code, so that its watchdog
#: cannot run) must have been silent before the hang policy acts, where its process cannot be read from the
#: deciding rank's host: a rank pickling a large object holds the GIL for minutes and is not hung.
SILENT_S = 300.0
#: A note older than this many seconds (and its writer's publishing interval) is silence.
STALE_S = 10.0


def confirm(verdict: dict[str, Any], notes: dict[int, dict[str, Any] | None], now: float, quiet_s: float,
            began: float, silent_s: float = SILENT_S,
            local: dict[int, float | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Whether the hang policy may act on a diagnosed stall: every culprit has made no progress for at least
    ``quiet_s`` seconds. ``verdict`` is :func:`classify`'s; ``notes`` the ranks' latest notes (``at``: Unix
    seconds; ``quiet_s``: seconds without progress when written, counted as such, never more; ``doing``: the
    last progress in words; ``progress.py``); ``now`` Unix seconds; ``began``: when the stall began (Unix
    seconds: silence counts from there, or from the culprit's last note if later); ``local``: for silent
    culprits whose process the deciding rank can read on its own host, their seconds without progress, or
    None.

    Returns ``{"act": bool, "why": str, "busy": {rank: what it was doing}}``. No action on an undecided
    verdict (nobody is behind: everyone waits alike, as while NCCL's communicators form), on a culprit that
    progressed within ``quiet_s``, nor on a silent one (no fresh note, its process not readable here) silent
    for less than ``silent_s``."""
    culprits = [int(r) for r in verdict.get("culprit_ranks") or []]
    if verdict.get("undecided") or not culprits:
        return {"act": False, "why": "no rank is behind the others (undecided): no action", "busy": {}}
    busy: dict[int, str] = {}
    waits: list[str] = []
    for rank in culprits:
        note = notes.get(rank)
        at = float((note or {}).get("at") or 0.0)
        if note is not None and note.get("quiet_s") is not None and now - at <= STALE_S:  # it speaks
            if float(note["quiet_s"]) < quiet_s:  # as of its note: the time since is not known to be quiet
                busy[rank] = str(note.get("doing") or "progressing")
            continue
        seen = (local or {}).get(rank)
        if seen is not None:  # silent, but its process can be read on this host
            if seen < quiet_s:
                busy[rank] = "its process is running (CPU time or I/O), its watchdog silent (the GIL held?)"
            continue
        silent_for = now - max(at, began)
        if silent_for < silent_s:
            waits.append(f"rank {rank} is silent ({silent_for:.0f} s; its progress cannot be read from this host): "
                         f"acting after {silent_s:g} s of silence")  # fmt: skip
    if busy:
        doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(busy.items()))
        return {"act": False, "why": f"the culprit is busy, not hung ({doing})", "busy": busy}
    if waits:
        return {"act": False, "why": "; ".join(waits), "busy": {}}
    return {"act": True, "why": f"no progress on rank(s) {culprits} for {quiet_s:g} s", "busy": {}}
