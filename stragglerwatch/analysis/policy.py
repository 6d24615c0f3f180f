"""When a policy acts on a straggler, and the host lists it writes: pure functions, data in, actions out.

Design: the detector flags a rank as soon as it is consistently slower than its peers by more than its
tolerance (5%), which is right for a report and too eager for an action that drains a node: a healthy
host that drifts by a few percent, or a chance run of slow steps in a two-mode job, is flagged for tens
of steps (the held-out accuracy page counts them). An action therefore asks more of a verdict than a
flag does (:class:`ActRule`): the rank is *still* flagged at the end of the data, has been for at least
``after_s`` seconds and ``min_steps`` steps, is at least ``min_slowdown`` as busy as its peers for the
same work, its cause is one the user acts on, and it is not **busier by design** (:func:`by_design`):
rank 0 or a node's local rank 0 whose data or other excess was there from the start of its attempt
(per-step logging, ``.item()``, wandb), or a rank of a group of ranks busier together from the start,
with no ``role`` given, that one slow host does not explain (an unlabelled pipeline stage). Load
imbalance never reaches here: the detector compares busy time for the same work, so a rank that draws
heavy batches is not flagged.

What the rule accepts goes to every action, with ``host_evidence``: the context signals (``explain``)
that put the excess on its node (:data:`EVIDENCE`). The built-in *exclude* asks more
(:func:`exclusion_declined`): a cause a node change can fix, with a signal of that node behind it
(``compute`` and ``optimizer``: its GPU or its host's CPUs; ``data``: its host's storage or its loader's
CPUs; ``other``: never), and one host for all its flagged steps (a rank that stayed slow when a restart
moved it to another host, or whose flag outlasted the move, names no one host).

An episode is a straggler's latest spell (:func:`current_episode`: its flagged stretches a short pause apart;
a report keeps one entry per rank, with all its stretches); it acts once,
keyed by ``(restart, attach, rank, first_step)``, the attempt of its first flagged step (steps are
numbered on across attempts). The live analysis sees a bounded window of steps; :class:`Episodes`
carries an episode's start, hosts and by-design reason from one window to the next. The host a verdict
names is the one its rank ran on in the attempts of its flagged steps (``rundir.where_ran``), never
just the latest attempt's. The same rule serves rank 0's policy thread, the tests and the benchmarks.

The exclusion file: one host a line, each followed by a ``# ...`` comment (rank, cause, evidence, the
time added in UTC, the run); a line added more than ``expire_s`` ago is dropped when the file is next
written (:func:`exclusion_text`); a line without that time (by hand, or an older version's) is kept.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.attempts import attempt_index
from stragglerwatch.analysis.episodes import spells
from stragglerwatch.record.rundir import where_ran

#: The causes a straggler can be given (``stages.CAUSES``).
CAUSES = ("data", "compute", "optimizer", "other")

#: The context signals (``explain.SIGNALS``) that put a straggler's excess on its node, by kind. Left out:
#: clock settings (``gpu_sync_boost``, ``gpu_applications_clocks_setting``) and a narrower CPU binding
#: (``affinity_cpus``), which are the job's settings and follow it to any node.
HARDWARE = ("xid", "ecc_uncorrected", "ecc_corrected", "gpu_sw_power_cap", "gpu_hw_slowdown",
            "gpu_sw_thermal_slowdown", "gpu_hw_thermal_slowdown", "gpu_hw_power_brake_slowdown", "sm_clock",
            "temperature", "power_limit", "pcie_replays", "nvlink_errors")  # fmt: skip
HOST = ("run_delay", "cpu_pressure", "invol_switches", "others_cpu", "steal", "load_per_cpu", "memory_pressure",
        "swap_used")  # fmt: skip
LOADER = ("workers_invol_switches",)  # its data-loader workers' CPUs taken
STORAGE = ("io_pressure",)
EVIDENCE = {**dict.fromkeys(HARDWARE, "hardware"), **dict.fromkeys(HOST + LOADER, "host"),
            **dict.fromkeys(STORAGE, "storage")}  # fmt: skip
#: What the *exclude* action needs (with ``exclude_needs_evidence``): per cause, the signals of a node that a
#: node change leaves behind. ``data``: its host's storage, or its loader's CPUs or memory taken by others.
EXCLUDE_SIGNALS: dict[str, tuple[str, ...]] = {
    "compute": HARDWARE + HOST,
    "optimizer": HARDWARE + HOST,
    "data": STORAGE + LOADER + ("others_cpu", "steal", "memory_pressure", "swap_used"),
    "other": (),
}

#: The start of an attempt that tells a duty from a fault: steps ``START_SKIP`` to ``START_SKIP + START_STEPS``
#: of each attempt (the first few warm up), and the share of today's excess that must have been there then.
START_SKIP, START_STEPS, START_SHARE = 5, 50, 0.5
#: ... and for a stage, the share of its busy time over the fastest group's now that it had at the start.
STAGE_START_SHARE = 0.75
#: A group of ranks busier together must hold at least this share of the ranks (and 2) to be a stage.
STAGE_SHARE = 1 / 32


@dataclass(frozen=True)
class ActRule:
    """What a straggler verdict must show before a policy acts on it."""

    after_s: float = 300.0  # flagged for at least this long (the job's seconds, from its first flagged step)
    min_slowdown: float = 1.15  # busy time at least this many times its peers', for the same work
    min_steps: int = 200  # flagged for at least this many steps
    causes: tuple[str, ...] = CAUSES  # the causes acted on
    exclude_needs_evidence: bool = True  # "exclude" acts only with a signal of its node (EXCLUDE_SIGNALS)


Episode = tuple[int | None, int | None, int, int]


def episode(straggler: Mapping[str, Any]) -> Episode:
    """The key of a straggler's episode: the attempt of its first flagged step, its rank and that step."""
    restart, attach = straggler.get("restart"), straggler.get("attach")
    return (None if restart is None else int(restart), None if attach is None else int(attach),
            int(straggler["rank"]), int(straggler["first_step"]))  # fmt: skip


def _done(key: Episode, done: set[Episode]) -> bool:
    """``key`` was acted on (an action of an older version recorded no attempt: its rank and step match)."""
    return key in done or (None, None, key[2], key[3]) in done


def why_not(straggler: Mapping[str, Any], rule: ActRule, last_step: int | None) -> str | None:
    """Why ``rule`` does not act on ``straggler`` (a view's, or a report's, ``stragglers`` entry) now, or
    None when it does. ``last_step`` is the data's last step."""
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
    if straggler.get("by_design"):
        return f"busier by design: {straggler['by_design']}"
    return None


def due(view: Mapping[str, Any], rule: ActRule, acted: Iterable[Episode] = ()) -> list[dict[str, Any]]:
    """The verdicts to act on now: stragglers of ``view`` (:func:`view`, or ``analyze``'s JSON) that ``rule``
    accepts and whose episode is not in ``acted``. Each is what the actions receive (:func:`verdict`)."""
    if view.get("busy_unavailable"):
        return []
    done = set(acted)
    return [verdict(s, rule) for s in view.get("stragglers") or []
            if not _done(episode(s), done) and why_not(s, rule, view.get("last_step")) is None]  # fmt: skip


def declined(view: Mapping[str, Any], rule: ActRule, acted: Iterable[Episode] = ()
             ) -> list[tuple[Episode, dict[str, Any]]]:  # fmt: skip
    """The stragglers ``rule`` would act on now but for being busier by design, with their episodes: what
    the policy says instead of acting."""
    if view.get("busy_unavailable"):
        return []
    done, out = set(acted), []
    for s in view.get("stragglers") or []:
        acts = why_not({**s, "by_design": None}, rule, view.get("last_step")) is None
        if s.get("by_design") and acts and not _done(episode(s), done):
            out.append((episode(s), s))
    return out


def host_evidence(straggler: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The context signals of ``straggler`` (``explain``'s, in its ``context``) that put its excess on its
    node: ``{"signal", "kind", "value", "peers", "text"}``; kind ``hardware``, ``host`` or ``storage``."""
    return [{"signal": c["signal"], "kind": EVIDENCE[c["signal"]], "value": c.get("value"), "peers": c.get("peers"),
             "text": c.get("text")} for c in straggler.get("context") or [] if c.get("signal") in EVIDENCE]  # fmt: skip


def exclusion_declined(straggler: Mapping[str, Any], rule: ActRule) -> str | None:
    """Why the *exclude* action leaves ``straggler``'s host alone (it acts when None)."""
    cause = straggler.get("cause")
    hosts = {h for _, _, h in straggler.get("hosts") or [] if h}
    if cause == "other":
        return "its excess is in 'other' (the loop's own work outside the timed phases): no node change fixes it"
    if len(hosts) > 1:
        where = ", ".join(f"{h} in restart {r}" for r, _, h in straggler.get("hosts") or [] if h)
        return (f"its flagged steps ran on {len(hosts)} hosts ({where}): a restart moved the rank, and which host "
                "is to blame is not known")  # fmt: skip
    if not straggler.get("host"):
        return "the rank's host is not known"
    if rule.exclude_needs_evidence:
        wanted = EXCLUDE_SIGNALS.get(str(cause), ())
        found = [c["signal"] for c in straggler.get("context") or [] if c.get("signal") in wanted]
        if not found:
            gpu = "its GPU (clock, throttling, errors) or its host's CPUs (contention, steal)"
            what = {"data": "its host's storage (I/O pressure) or its data loader's CPUs or memory", "compute": gpu,
                    "optimizer": gpu}  # fmt: skip
            return (
                f"no signal of {what.get(str(cause), 'its node')} differs from its peers' while it was slow: "
                "nothing shows that another node would be faster (exclude_needs_evidence)"
            )
    return None


def verdict(straggler: Mapping[str, Any], rule: ActRule | None = None) -> dict[str, Any]:
    """What an ``on_straggler`` action is told of a straggler. ``exclude``: whether the built-in *exclude*
    acts on it under ``rule``, and ``not_excluded``: why not."""
    span = straggler.get("time_span") or [None, None]
    why = exclusion_declined(straggler, rule or ActRule())
    return {
        "rank": int(straggler["rank"]),
        "host": straggler.get("host"),
        "hosts": [list(h) for h in straggler.get("hosts") or []],  # [restart, attach, host] of its flagged steps
        "restart": straggler.get("restart"),  # the attempt of its first flagged step
        "attach": straggler.get("attach"),
        "cause": straggler.get("cause"),
        "since": span[0],  # Unix seconds: the start of its first flagged step
        "since_step": int(straggler["first_step"]),
        "flagged_s": round(span[1] - span[0], 3) if span[0] is not None else None,
        "slowdown": straggler.get("slowdown"),
        "lost_seconds": straggler.get("lost_seconds"),
        "lost_gpu_seconds": straggler.get("lost_gpu_seconds"),
        "where": straggler.get("where"),
        "hints": list(straggler.get("hints") or []),
        "host_evidence": host_evidence(straggler),
        "exclude": why is None,
        "not_excluded": why,
    }


# -- what the rule is given: a view of the analysis -------------------------------------------------


def attempt_of(step: int, attempts: list[Mapping[str, Any]]) -> tuple[int, int] | None:
    """The attempt ``(restart, attach)`` whose steps (in the run's numbering) hold ``step``."""
    i = attempt_index(step, attempts)
    return None if i is None else (int(attempts[i]["restart"]), int(attempts[i]["attach"]))


def start_profile(busy: Any, duty: Any, ranks: Iterable[int], roles: Mapping[int, Any] | None = None
                  ) -> dict[int, dict[str, float]]:  # fmt: skip
    """Each rank's start of an attempt, from its steps there (``busy`` and ``duty``: steps x ranks seconds,
    ``duty`` the data wait plus other time): ``busy_s`` its median busy time, ``duty_ms`` its median duty
    over its peers' (ms). Peers: the ranks of its role."""

    import numpy as np

    busy, duty = np.asarray(busy, dtype=float), np.asarray(duty, dtype=float)
    ranks = [int(r) for r in ranks]
    if not busy.size or not ranks:
        return {}
    roles = roles or {}
    out = {}
    with ignoring(), np.errstate(all="ignore"):  # a rank with no step there: NaN
        b, d = np.nanmedian(busy, axis=0), np.nanmedian(duty, axis=0)
        for j, r in enumerate(ranks):
            peers = [k for k, q in enumerate(ranks) if roles.get(q) == roles.get(r)]
            pd = float(np.nanmedian(d[peers]))
            if math.isfinite(b[j]) and b[j] > 0 and math.isfinite(d[j]) and math.isfinite(pd):
                out[r] = {"busy_s": round(float(b[j]), 7), "duty_ms": round((float(d[j]) - pd) * 1e3, 4)}
    return out


def by_design(straggler: Mapping[str, Any], start: Mapping[int, Mapping[str, float]] | None,
              ranks: list[Mapping[str, Any]], local_rank: int | None, role: Any,
              hosts: Mapping[int, str | None]) -> str | None:  # fmt: skip
    """Why ``straggler`` looks busier by design (None: it does not). ``start``: :func:`start_profile` of the
    attempt it is flagged in; ``ranks``: the report's per-rank rows (``rank``, ``busy_ms``); ``local_rank``,
    ``role``: its own; ``hosts``: each rank's host in that attempt.

    - rank 0, or a node's local rank 0, whose ``data`` or ``other`` excess was at least half there at the
      start of its attempt: a duty (per-step logging, ``.item()``, wandb), not its node;
    - a rank of a group of ranks about as busy as it (at least 2, and :data:`STAGE_SHARE` of the ranks; the
      ranks split into groups at gaps in their busy times), with ranks faster than them, on more than one
      host, or one of several busier groups, or as many as the fastest group (one slow host among many is
      none of these), busier from the start, and no ``role``: an unlabelled pipeline stage."""
    rank, cause = int(straggler["rank"]), straggler.get("cause")
    mine = (start or {}).get(rank)
    excess = straggler.get("excess_ms") or {}
    if cause in ("data", "other") and (rank == 0 or local_rank == 0) and mine is not None:
        now = float(excess.get("data") or 0.0) + float(excess.get("other") or 0.0)
        then = float(mine.get("duty_ms") or 0.0)
        if now > 0 and then >= START_SHARE * now:
            who = "rank 0" if rank == 0 else "its node's local rank 0"
            return (
                f"{who}, busier in {cause} by {now:.1f} ms a step, {then:.1f} ms of it from the start of its "
                "attempt: a duty of that rank (per-step logging, .item(), wandb), not its node"
            )
    slowdown = straggler.get("slowdown")
    if role is not None or mine is None or not slowdown or slowdown <= 1.0:
        return None
    busy = {int(r["rank"]): float(r["busy_ms"]) for r in ranks if r.get("busy_ms")}
    if rank not in busy:
        return None
    levels = _levels(busy, max(0.03, (slowdown - 1.0) / 4.0))
    at = next(k for k, level in enumerate(levels) if rank in level)
    like, faster = levels[at], [r for level in levels[:at] for r in level]
    on = {hosts.get(r) for r in like if hosts.get(r)}
    staircase = sum(len(level) >= 2 for level in levels[1:]) >= 2  # several busier groups: more than one slow host
    # how much busier than the fastest group it is now, and was at the start of its attempt
    now = busy[rank] / sorted(busy[r] for r in levels[0])[len(levels[0]) // 2] - 1.0
    before = sorted(start[r]["busy_s"] for r in levels[0] if start and r in start)  # type: ignore[index]
    then = mine["busy_s"] / before[len(before) // 2] - 1.0 if before else 0.0
    if (len(like) >= max(2, math.ceil(STAGE_SHARE * len(busy))) and len(faster) >= 2
            and (len(on) > 1 or staircase or len(like) == len(levels[0])) and now > 0
            and then >= STAGE_START_SHARE * now):  # fmt: skip
        where = (f"on {len(on)} hosts" if len(on) > 1 else "one of several busier groups" if staircase
                 else f"as many as the fastest group ({len(levels[0])})")  # fmt: skip
        return (
            f"{len(like)} ranks {where} ({_ranks(like)}) are busier together than {len(faster)} others from the "
            "start of its attempt, and no role is given: an unlabelled pipeline stage (pass role= to attach "
            "for each stage)"
        )
    return None


def _levels(busy: Mapping[int, float], gap: float) -> list[list[int]]:
    """The ranks by busy time, split where one is more than ``gap`` busier than the next faster one."""
    order = sorted(busy, key=lambda r: busy[r])
    levels: list[list[int]] = [[order[0]]]
    for a, b in zip(order, order[1:], strict=False):
        if busy[b] > busy[a] * (1.0 + gap):
            levels.append([])
        levels[-1].append(b)
    return levels


def _ranks(ranks: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return f"ranks {shown}" + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


def current_episode(straggler: Mapping[str, Any]) -> tuple[int, list[float] | None]:
    """The first step and the time span of a straggler's latest episode, what the rule acts on: its last
    flagged stretches, each at most :data:`WINDOW_SLACK` steps after the one before (a short pause is no new
    episode). A report entry holds all the stretches of its rank (``episodes``); an older one, one episode."""
    episodes = straggler.get("episodes") or []
    spans = straggler.get("episode_spans") or []
    if len(episodes) < 2 or len(spans) != len(episodes) or any(len(e) < 3 for e in episodes):
        return int(straggler["first_step"]), straggler.get("time_span")
    first = spells(episodes, WINDOW_SLACK)[-1][0]
    k = next(i for i, e in enumerate(episodes) if int(e[0]) == first)
    since, whole = spans[k], straggler.get("time_span")
    if k == 0:
        return first, whole
    return first, [since[0], whole[1]] if since and whole else since


def view(report: Mapping[str, Any], rank_meta: Mapping[int, Mapping[str, Any]],
         starts: Mapping[tuple[int, int], Mapping[int, Mapping[str, float]]], window: list[int] | None = None
         ) -> dict[str, Any]:  # fmt: skip
    """What the rule needs of an analysis (``report``: ``analyze``'s JSON, or the live window's), small enough
    for a line of JSON: the run's scalars and, per straggler, its figures, context and hints, the attempt of
    its first flagged step (``restart``, ``attach``), the host of each attempt of its flagged steps (``hosts``;
    ``host`` when they agree) and why it looks busier by design (``by_design``). ``starts``: each attempt's
    :func:`start_profile`."""
    attempts = [dict(a) for a in report.get("attempts") or []]
    last = report.get("last_step")
    ran = {int(r): where_ran(dict(m)) for r, m in rank_meta.items()}
    keep = ("rank", "cause", "slowdown", "first_step", "last_step", "time_span", "where", "excess_ms",
            "lost_seconds", "lost_gpu_seconds", "hints", "context")  # fmt: skip
    out = []
    for s in report.get("stragglers") or []:
        entry = {k: s.get(k) for k in keep}
        entry["first_step"], entry["time_span"] = current_episode(s)
        rank, first = int(s["rank"]), int(entry["first_step"])
        end = int(s["last_step"]) if s.get("last_step") is not None else (int(last) if last is not None else first)
        first_at, end_at = attempt_of(first, attempts), attempt_of(end, attempts)
        entry["restart"], entry["attach"] = first_at if first_at else (None, None)
        mine = ran.get(rank, {})
        seen = [(int(a["restart"]), int(a["attach"])) for a in attempts
                if int(a["first_step"]) <= end and int(a["last_step"]) >= first]  # fmt: skip
        seen = seen or ([end_at] if end_at else [])
        entry["hosts"] = [[k[0], k[1], (mine.get(k) or {}).get("host")] for k in seen]
        named = {h for _, _, h in entry["hosts"]}
        entry["host"] = next(iter(named)) if len(named) == 1 else None
        where = (mine.get(end_at) or {}) if end_at else {}
        hosts = {r: ((m.get(end_at) or {}).get("host") if end_at else None) for r, m in ran.items()}
        meta = rank_meta.get(rank) or {}
        local = where.get("local_rank") if where else meta.get("local_rank")
        entry["by_design"] = by_design(s, starts.get(end_at) if end_at else None, report.get("ranks") or [],
                                       local, meta.get("role"), hosts)  # fmt: skip
        out.append(entry)
    for entry in out:  # a rank slow in several worlds of an elastic run (one entry each) ran on all their hosts
        others = [h for e in out if e is not entry and e["rank"] == entry["rank"] for h in e["hosts"]]
        if others:
            merged = [*entry["hosts"], *others]
            entry["hosts"] = [h for i, h in enumerate(merged) if h not in merged[:i]]
            named = {h for _, _, h in entry["hosts"]}
            entry["host"] = next(iter(named)) if len(named) == 1 else None
    return {"run_id": report.get("run_id"), "world_size": report.get("world_size"),
            "ranks_seen": report.get("ranks_seen"), "last_step": last, "window": window,
            "busy_unavailable": bool(report.get("busy_unavailable")), "attempts": attempts,
            "stragglers": out}  # fmt: skip


#: Views an episode is remembered for while it does not show as open (a look at a moment the ranks' logs
#: were apart, a flag the detector took back): it goes on if it shows again where it was last seen.
GRACE_VIEWS = 3
#: Steps from a window's start within which a flag counts as flagged from it (the detector's short median).
WINDOW_SLACK = 16


class Episodes:
    """The open episodes seen so far, carried from one view of a window of steps to the next: a straggler
    flagged from before the window keeps its first step and time, the attempts and hosts of its flagged
    steps, and its by-design reason (once found). Its state is a few fields per flagged rank."""

    def __init__(self) -> None:
        self.open: dict[int, dict[str, Any]] = {}

    def carry(self, view: dict[str, Any]) -> dict[str, Any]:
        """``view`` with its open stragglers' episodes continued from the views before (in place)."""
        seen_to = view.get("last_step")
        window = view.get("window")
        now: dict[int, dict[str, Any]] = {}
        for s in view.get("stragglers") or []:
            if s.get("last_step") is not None:
                continue
            old = self.open.get(int(s["rank"]))
            first = int(s["first_step"])
            # the same stretch seen again; or, where more steps came between two looks than the window holds,
            # open when last seen and flagged from this window's start
            whole = bool(window and view.get("skipped")) and first <= int(window[0]) + WINDOW_SLACK  # type: ignore[index]
            if old is not None and (first <= old["seen_to"] + 1 or whole):
                span = s.get("time_span")
                if old["first_step"] < int(s["first_step"]):  # it began before this window
                    s["first_step"], s["restart"], s["attach"] = old["first_step"], old["restart"], old["attach"]
                    if span and old["since"] is not None:
                        s["time_span"] = [old["since"], span[1]]
                hosts = [list(h) for h in old["hosts"]]
                hosts += [list(h) for h in s.get("hosts") or [] if list(h) not in hosts]
                s["hosts"] = hosts
                named = {h for _, _, h in hosts}
                s["host"] = next(iter(named)) if len(named) == 1 else None
                s["by_design"] = s.get("by_design") or old["by_design"]
            span = s.get("time_span")
            now[int(s["rank"])] = {"first_step": int(s["first_step"]), "restart": s.get("restart"),
                                   "attach": s.get("attach"), "since": span[0] if span else None,
                                   "hosts": [list(h) for h in s.get("hosts") or []], "by_design": s.get("by_design"),
                                   "seen_to": int(seen_to) if seen_to is not None else int(s["first_step"]),
                                   "misses": 0}  # fmt: skip
        for rank, old in self.open.items():  # not open in this view: remembered for a few views
            if rank in now or old["misses"] >= GRACE_VIEWS:
                continue
            ends = [int(s["last_step"]) for s in view.get("stragglers") or [] if int(s["rank"]) == rank
                    and s.get("last_step") is not None and int(s["last_step"]) >= old["first_step"]]  # fmt: skip
            now[rank] = {**old, "seen_to": max([old["seen_to"], *ends]), "misses": old["misses"] + 1}
        self.open = now
        return view


# -- the exclusion file -----------------------------------------------------------------------------

_ADDED = re.compile(r"\badded (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


@dataclass(frozen=True)
class Exclusion:
    """One host of an exclusion file: its line's comment, and when it was added (None: not said)."""

    host: str
    note: str
    added: float | None

    def age_s(self, now: float | None = None) -> float | None:
        return None if self.added is None else (time.time() if now is None else now) - self.added


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def exclusion_note(verdict: Mapping[str, Any], run_id: str | None, now: float) -> str:
    """The comment a host's line carries: the rank, its cause and slowdown, the evidence, when, the run."""
    found = verdict.get("host_evidence") or []
    evidence = "; ".join(f"{e['signal']}: {e.get('text') or e.get('value')}" for e in found)
    text = (
        f"rank {verdict.get('rank')}, {verdict.get('cause')}, {verdict.get('slowdown')}x; evidence: "
        f"{evidence or 'none'}; added {utc(now)}; run {run_id or '?'}"
    )
    return " ".join(text.replace("#", "No.").split())


def parse_exclusions(text: str) -> tuple[list[Exclusion], list[str]]:
    """The hosts of an exclusion file's text (one a line, ``#`` comments), and its lines of comment alone."""
    hosts, comments = [], []
    for line in text.splitlines():
        host, _, note = line.partition("#")
        host, note = host.strip(), note.strip()
        if not host:
            if note:
                comments.append(line.rstrip())
            continue
        m = _ADDED.search(note)
        added = None
        if m:
            try:
                added = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
            except ValueError:
                added = None
        hosts.append(Exclusion(host, note, added))
    return hosts, comments


def exclusion_text(text: str, add: tuple[str, str] | None, now: float, expire_s: float | None
                   ) -> tuple[str, list[Exclusion], list[Exclusion]]:  # fmt: skip
    """An exclusion file's text rewritten: ``add`` (host, comment) added, or its line renewed; lines added
    more than ``expire_s`` ago dropped (None: none expire); a host named once. Returns the text, the hosts
    kept and the hosts dropped."""
    entries, comments = parse_exclusions(text)
    kept: dict[str, Exclusion] = {}
    dropped = []
    for e in entries:
        if expire_s is not None and e.added is not None and now - e.added > expire_s:
            dropped.append(e)
        elif e.host not in kept:
            kept[e.host] = e
    if add is not None:
        kept[add[0]] = Exclusion(add[0], add[1], now)
    lines = [*comments, *(f"{e.host}  # {e.note}" if e.note else e.host for e in kept.values())]
    return "".join(f"{line}\n" for line in lines), list(kept.values()), dropped


# -- hostlists, and the actions a run recorded ---------------------------------------------------------

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
    and per kind: an abort's ``stall_id``, ``culprit_ranks``, ``exit_status`` and ``bound_s`` (and ``error``
    where the collective the rank waited in failed first, as a culprit left: the rank left from there); a straggler
    action's ``verdict`` (what the actions were told), ``done`` (the actions that ran), ``declined`` (the
    actions that left it alone, and why) and ``exclude_file``."""
    keep = ("stall_id", "culprit_ranks", "victim_ranks", "stalled_s", "exit_status", "bound_s", "error", "verdict",
            "done", "declined", "exclude_file")  # fmt: skip
    out = []
    for e in sorted((e for e in events if e.get("kind") == "action"), key=lambda e: e.get("detected_at", 0.0)):
        entry = {"action": e.get("action"), "rank": e.get("rank"), "at": e.get("detected_at"),
                 "restart": e.get("restart", 0)}  # fmt: skip
        entry.update({k: e[k] for k in keep if k in e})
        out.append(entry)
    return out
