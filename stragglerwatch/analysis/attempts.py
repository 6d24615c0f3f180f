"""The attempts of a run: who ran each, what changed from one to the next, why each ended, and what
each cost. Pure functions over the plan's attempts, the ranks' metadata and their events.

A job restarted by torchrun runs again as a new attempt (``restart``); a process that attaches again
starts one too (``attach``). A plain restart runs the same ranks on the same nodes. An elastic job
(``torchrun --nnodes MIN:MAX``) re-forms after a node is lost with other ranks: fewer, or the same
numbers on other nodes. A **world** is a run of consecutive attempts with the same ranks on the same
nodes (host and torchrun agent). Within one world, rank r's steps are one series; across a change, rank
r is another GPU in a job of another shape, so detection cuts every rank's series where a world begins
(:func:`world_cuts`, read by ``stages.intervals`` and ``detect``), a straggler is one entry per rank and
world, and its lost GPU-seconds count the ranks of its own attempt.

Why an attempt ended is read from the ranks' events: a rank's ``exception`` or ``sigterm``, the hang
policy's ``abort``, the watchdog's stall, ranks that stopped recording before the others with no word
(killed, or their node lost), or every rank's ``closed`` (it finished).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from stragglerwatch.record.rundir import where_ran

Key = tuple[int, int]  # (restart, attach)
_NATIVE_PLACE = re.compile(r"\[[^\]]*\.(?:cc|cpp|c|h|hpp):\d+\]\s*")  # "[/path/pair.cc:553] " in C++ errors
#: Steps a rank may stop before the last of its attempt and still be counted as there at its end (ranks
#: are torn down together, each after the step it was in).
_TAIL = 2


def _key(a: Mapping[str, Any]) -> Key:
    return int(a["restart"]), int(a["attach"])


def members(attempts: list[dict[str, Any]], rank_meta: Mapping[int, Mapping[str, Any]]
            ) -> list[dict[int, dict[str, Any]]]:  # fmt: skip
    """Per attempt, the ranks whose metadata names it, with where each ran (``rundir.where_ran``)."""
    ran = {int(r): where_ran(dict(m)) for r, m in rank_meta.items()}
    return [{r: w[_key(a)] for r, w in ran.items() if _key(a) in w} for a in attempts]


def _node(w: Mapping[str, Any]) -> tuple[str, int | None]:
    return str(w.get("host")), w.get("agent")


def _world_size(m: dict[int, dict[str, Any]]) -> int | None:
    sizes = [int(w["world_size"]) for w in m.values() if w.get("world_size")]
    return max(sizes) if sizes else (len(m) or None)


def new_world(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> bool:
    """Whether an attempt (``after``: its ranks and where they ran) is another world than the one before
    it: another world size, or a rank on another node. Unknowns (files of an earlier release) never cut."""
    if not before or not after:
        return False
    wb, wa = _world_size(before), _world_size(after)
    if wb and wa and wb != wa:
        return True
    for r in before.keys() & after.keys():
        hb, ab = _node(before[r])
        ha, aa = _node(after[r])
        if hb != ha or (ab is not None and aa is not None and ab != aa):
            return True
    return False


def worlds(attempts: list[dict[str, Any]], rank_meta: Mapping[int, Mapping[str, Any]],
           m: list[dict[int, dict[str, Any]]] | None = None) -> list[int]:  # fmt: skip
    """The world of each attempt: 0 for the first, one more at each attempt that is a new world (``m``: the
    attempts' :func:`members`, where known)."""
    m = members(attempts, rank_meta) if m is None else m
    out: list[int] = []
    for i in range(len(attempts)):
        out.append(0 if i == 0 else out[-1] + int(new_world(m[i - 1], m[i])))
    return out


def world_cuts(attempts: list[dict[str, Any]], rank_meta: Mapping[int, Mapping[str, Any]],
               known: list[int] | None = None) -> tuple[int, ...]:  # fmt: skip
    """The steps (the run's numbering) where a new world begins: where detection cuts every rank's series.
    ``known``: the attempts' :func:`worlds`, where the caller kept them."""
    w = worlds(attempts, rank_meta) if known is None else known
    return tuple(int(attempts[i]["first_step"]) for i in range(1, len(attempts)) if w[i] != w[i - 1])


def cut_indices(cuts: Iterable[int], steps: np.ndarray) -> np.ndarray:
    """The cut steps as indices into ``steps`` (the first step at or after each), inside the run."""
    idx = np.searchsorted(steps, np.asarray(list(cuts), dtype=np.int64))
    return np.unique(idx[(idx > 0) & (idx < len(steps))])


def attempt_index(step: int, attempts: list[Mapping[str, Any]]) -> int | None:
    """The index of the attempt that holds ``step`` (the run's numbering)."""
    for i, a in enumerate(attempts):
        if int(a["first_step"]) <= step <= int(a["last_step"]):
            return i
    return None


def rank_ranges(ranks: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7]."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])  # type: ignore[arg-type]
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)  # type: ignore[misc]


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _node_names(m: dict[int, dict[str, Any]], all_members: list[dict[int, dict[str, Any]]]) -> dict[int, str]:
    """Per rank, its node's name: the host, with the agent's pid where one host ran several agents."""
    agents: dict[str, set[Any]] = {}
    for mm in all_members:
        for w in mm.values():
            agents.setdefault(str(w.get("host")), set()).add(w.get("agent"))
    out = {}
    for r, w in m.items():
        host, agent = _node(w)
        out[r] = f"{host} (agent {agent})" if agent is not None and len(agents.get(host, ())) > 1 else host
    return out


def _ended(a: dict[str, Any], events: list[dict[str, Any]], last_own: Mapping[int, int], names: dict[int, str],
           is_last: bool) -> str:  # fmt: skip
    """Why attempt ``a`` ended, in a line, from its ranks' events and where each stopped recording."""
    key = _key(a)
    mine = [e for e in events if (e.get("restart", 0), e.get("attach", 0)) == key and "rank" in e]
    why: list[str] = []
    end = max(last_own.values()) if last_own else None
    early = sorted(r for r, s in last_own.items() if end is not None and s < end - _TAIL)
    said = {int(e["rank"]) for e in mine if e.get("kind") in ("exception", "sigterm", "closed")}
    silent = [r for r in early if r not in said]
    if silent:
        nodes = sorted({names.get(r, "?") for r in silent})
        why.append(f"{_who(silent)} left no record after step {max(last_own[r] for r in silent)} and "
                   f"no word (killed, or their node was lost: {', '.join(nodes)})")
    aborted = sorted({int(e["rank"]) for e in mine if e.get("kind") == "action" and e.get("action") == "abort"})
    if aborted:
        why.append(f"the hang policy ended {_who(aborted)}")
    for kind, label in (("exception", "failed"), ("sigterm", "were sent SIGTERM")):
        ranks = sorted({int(e["rank"]) for e in mine if e.get("kind") == kind})
        if ranks:
            reason = next((str(e.get("reason") or "") for e in mine if e.get("kind") == kind), "")
            short = _NATIVE_PLACE.sub("", reason.split("\n")[0]).split(". ")[0][:160]
            why.append(f"{_who(ranks)} {label}" + (f" ({short})" if kind == "exception" and short else ""))
    if why:
        return "; then ".join(why)
    closed = {int(e["rank"]) for e in mine if e.get("kind") == "closed"}
    if last_own and closed >= set(last_own):
        return "finished (every rank closed)"
    return "still running, or ended with no word" if is_last else "ended with no word (the next attempt began)"


def describe(attempts: list[dict[str, Any]], rank_meta: Mapping[int, Mapping[str, Any]],
             events: list[dict[str, Any]], last_own: Mapping[Key, Mapping[int, int]],
             step_seconds: np.ndarray | None, step_lost: np.ndarray | None, steps: np.ndarray,
             m: list[dict[int, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The report's attempts: each one's ``world_size``, ``ranks`` (that recorded), ``nodes``, the ranks and
    nodes that ``joined`` and ``left`` since the attempt before, its ``world`` (a new one where the ranks or
    their nodes changed), why it ``ended``, and its cost: ``job_seconds``, ``lost_seconds`` and
    ``lost_gpu_seconds`` (its lost time times its own world size). ``last_own``: per attempt, each rank's
    last step there (the run's numbering); ``step_seconds``/``step_lost``: per step of ``steps``, the job's
    time and the time lost to stragglers, jitter and unequal groups (``detect.Verdict``); ``m``: the attempts'
    :func:`members`, where the caller kept them (a followed run of thousands of ranks, at every update)."""
    m = members(attempts, rank_meta) if m is None or len(m) != len(attempts) else m
    w = worlds(attempts, rank_meta, m)
    all_names = [_node_names(mm, m) for mm in m]
    out = []
    for i, a in enumerate(attempts):
        own = dict(last_own.get(_key(a), {}))
        here = m[i] or {r: {} for r in own}
        names = all_names[i]
        size = _world_size(m[i]) or len(own) or None
        entry: dict[str, Any] = {**a, "world": w[i], "world_size": size, "ranks": len(own),
                                 "nodes": len(set(names.values())) if names else None}  # fmt: skip
        if i:
            prev, prev_names = m[i - 1], all_names[i - 1]
            entry["joined"] = sorted(set(here) - set(prev)) if prev else []
            entry["left"] = sorted(set(prev) - set(here)) if prev and m[i] else []
            if prev and m[i]:
                entry["nodes_joined"] = sorted(set(names.values()) - set(prev_names.values()))
                entry["nodes_left"] = sorted(set(prev_names.values()) - set(names.values()))
                entry["moved"] = sorted(r for r in set(here) & set(prev) if names.get(r) != prev_names.get(r))
        entry["ended"] = _ended(a, events, own, names, i == len(attempts) - 1)
        if step_seconds is not None and step_lost is not None and len(steps) == len(step_seconds):
            rows = (steps >= int(a["first_step"])) & (steps <= int(a["last_step"]))
            job, lost = float(np.sum(step_seconds[rows])), float(np.sum(step_lost[rows]))
            entry["job_seconds"], entry["lost_seconds"] = round(job, 4), round(lost, 4)
            entry["lost_gpu_seconds"] = round(lost * size, 3) if size else None
        out.append(entry)
    return out
