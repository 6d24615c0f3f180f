"""What Flight Recorder dumps say about a hang: pure functions from :class:`~.frdumps.Dumps` to a verdict.

Design. A collective of a process group completes only when every member has issued it, and each
rank's dump says, per group, the last collective it issued (``pg_status``' last enqueued, else the
highest sequence number in its buffer) and the last it completed. So, per group:

- the *first collective not entered by every member* is one past the smallest issued count;
  the members that issued fewer are *missing* from it, the others are waiting in it;
- members without a dump are *unknown*: when every member that dumped waits in the same collective,
  they are the suspects (a dead rank, or one stuck holding the GIL, dumps nothing);
- the entrants' ``time_created_ns`` give how late each entered it (``late`` when after the first
  entrant's timeout had run out), and over the group's last complete collectives, which rank
  entered last most often (a slow rank, not a stuck one); the clocks are each host's own;
- collectives issued by several ranks under the same sequence number must be the same operation on
  tensors of the same sizes and types: any difference is a *mismatch* (a desync bug, not a slow rank).

Across groups the rule is the one the live watchdog uses (``hangs.classify``): a rank that issued
more in a group waits for the members that issued fewer; the culprits are the ranks others wait for
that wait for nobody. Ranks that dumped but have no entries (Flight Recorder off) say nothing.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from stragglerwatch.analysis.hangs import classify
from stragglerwatch.evidence.frdumps import Dump, Dumps, Entry

_LAG_WINDOW = 64  # complete collectives per group used for the entry-lag figures
_MAX_MISMATCHES = 10
_SYMMETRIC = ("all_reduce", "allreduce", "broadcast", "reduce", "barrier", "_allgather_base", "all_gather_into",
              "_reduce_scatter_base", "reduce_scatter_tensor", "allreduce_coalesced")  # fmt: skip


def _members(group: str, dumps: dict[int, Dump], world_size: int) -> tuple[list[int], str]:
    """A group's ranks: from a dump's pg_config, the whole world for the default group, else the
    ranks whose dumps mention it."""
    for d in dumps.values():
        ranks = (d.groups.get(group) or {}).get("ranks")
        if ranks:
            return sorted(set(ranks)), "pg_config"
    descs = {e.desc for d in dumps.values() for e in d.entries if e.group == group}
    if group == "0" or "default_pg" in descs:
        return list(range(world_size)), "world"
    seen = {r for r, d in dumps.items() if group in d.status or any(e.group == group for e in d.entries)}
    return sorted(seen), "dumps"


def _by_seq(d: Dump, group: str) -> dict[int, list[Entry]]:
    out: dict[int, list[Entry]] = {}
    for e in d.entries:
        if e.group == group and not e.p2p and e.seq is not None:
            out.setdefault(e.seq, []).append(e)
    return out


def _issued(d: Dump, group: str, seqs: dict[int, list[Entry]]) -> int:
    st = d.status.get(group) or {}
    return max([st.get("enqueued") or 0, *seqs.keys(), 0])


def _tracks_states(d: Dump) -> bool:
    return any(e.state in ("started", "completed") for e in d.entries)


def _completed(d: Dump, group: str, seqs: dict[int, list[Entry]]) -> int | None:
    st = (d.status.get(group) or {}).get("completed")
    if st is not None and st >= 0:
        return st
    if st is not None and any((x.get("completed") if x.get("completed") is not None else -1) >= 0
                              for x in d.status.values()):  # fmt: skip
        return 0  # the rank counts completions (another group has some): none of this group's completed
    if _tracks_states(d):
        done = [s for s, es in seqs.items() if all(e.state == "completed" for e in es)]
        return max(done, default=0)
    return None


def _started(d: Dump, group: str, seqs: dict[int, list[Entry]], seq: int) -> bool | None:
    """Whether collective ``seq`` started on the rank's device (NCCL records it; gloo does not: None)."""
    st = (d.status.get(group) or {}).get("started")
    if st is not None and st >= 0:
        return st >= seq
    if _tracks_states(d) and seq in seqs:
        return any(e.state in ("started", "completed") for e in seqs[seq])
    return None


def _op(es: list[Entry]) -> str:
    return "+".join(dict.fromkeys(e.op for e in es))


def _describe(es: list[Entry]) -> dict[str, Any]:
    e = es[0]
    return {"op": _op(es), "in_sizes": [list(x) if isinstance(x, tuple) else x for x in (e.in_sizes or ())],
            "dtypes": list(e.in_dtypes or ()), "timeout_ms": e.timeout_ms, "where": e.where}  # fmt: skip


def _signature(es: list[Entry]) -> tuple[str, Any, Any]:
    op = _op(es)
    sizes = tuple(e.in_sizes for e in es) if any(s in op for s in _SYMMETRIC) else None
    return op, sizes, tuple(e.in_dtypes for e in es)


def _mismatches(group: str, per_rank: dict[int, dict[int, list[Entry]]]) -> list[dict[str, Any]]:
    """Sequence numbers at which ranks issued different operations, sizes or types."""
    out: list[dict[str, Any]] = []
    common = sorted(set().union(*[set(s) for s in per_rank.values()])) if per_rank else []
    for seq in common:
        sigs = {r: _signature(s[seq]) for r, s in per_rank.items() if seq in s}
        if len(sigs) < 2:
            continue
        for i, what in enumerate(("op", "sizes", "dtypes")):
            values = {r: sig[i] for r, sig in sigs.items()}
            if len(set(values.values())) > 1:
                counts = Counter(values.values())
                usual = counts.most_common(1)[0][0] if len(counts) > 1 and counts.most_common(2)[1][1] < \
                    counts.most_common(1)[0][1] else None  # fmt: skip
                odd = sorted(r for r, v in values.items() if usual is not None and v != usual)
                out.append({"group": group, "seq": seq, "differs_in": what, "odd_ranks": odd,
                            "by_rank": {str(r): _op(per_rank[r][seq]) if what == "op" else
                                        _describe(per_rank[r][seq])["in_sizes" if what == "sizes" else "dtypes"]
                                        for r in sorted(values)}})  # fmt: skip
                break
        if len(out) >= _MAX_MISMATCHES:
            break
    return out


def _entry_lags(per_rank: dict[int, dict[int, list[Entry]]], upto: int) -> dict[str, Any] | None:
    """How late each rank entered the group's last complete collectives, and who entered last."""
    ranks = sorted(per_rank)
    if len(ranks) < 2:
        return None
    seqs = sorted(set.intersection(*[set(per_rank[r]) for r in ranks]))
    seqs = [s for s in seqs if s <= upto][-_LAG_WINDOW:]
    lags: dict[int, list[float]] = {r: [] for r in ranks}
    last: Counter[int] = Counter()
    for s in seqs:
        t = {r: per_rank[r][s][0].created_ns for r in ranks}
        if any(v is None for v in t.values()):
            continue
        first = min(v for v in t.values() if v is not None)
        for r in ranks:
            lags[r].append((t[r] - first) / 1e9)  # type: ignore[operator]
        last[max(ranks, key=lambda r: t[r])] += 1  # type: ignore[arg-type,return-value]
    n = sum(last.values())
    if n == 0:
        return None
    return {"collectives": n, "median_lag_s": {str(r): round(statistics.median(v), 6) for r, v in lags.items() if v},
            "entered_last": {str(r): c for r, c in sorted(last.items())}}  # fmt: skip


def _group_state(group: str, dumps: dict[int, Dump], world_size: int) -> dict[str, Any]:
    members, members_from = _members(group, dumps, world_size)
    present = [r for r in members if r in dumps and dumps[r].entries]
    per_rank = {r: _by_seq(dumps[r], group) for r in present}
    issued = {r: _issued(dumps[r], group, per_rank[r]) for r in present}
    completed = {r: _completed(dumps[r], group, per_rank[r]) for r in present}
    unknown = [r for r in members if r not in present]
    desc = next((e.desc for d in dumps.values() for e in d.entries if e.group == group and e.desc), None)
    state: dict[str, Any] = {"group": group, "desc": desc, "members": members, "members_from": members_from,
                             "no_dump": unknown, "issued": {str(r): n for r, n in issued.items()},
                             "completed": {str(r): c for r, c in completed.items()}, "stuck": None}  # fmt: skip
    if issued:
        low, high = min(issued.values()), max(issued.values())
        pending = [r for r in present if completed[r] is not None and completed[r] < issued[r]]  # type: ignore[operator]
        if low < high:
            seq = low + 1
        elif unknown or pending:
            seq = high  # every rank that dumped issued it: it waits for the unknown, or for the transport
        else:
            seq = None
        if seq is not None:
            state["stuck"] = _stuck(seq, per_rank, issued, unknown)
            started = {r: _started(dumps[r], group, per_rank[r], seq) for r in state["stuck"]["entered"]}
            if any(started.values()):  # some devices run it, others never got to it: they are behind
                state["stuck"]["not_started"] = sorted(r for r, v in started.items() if v is False)
    state["mismatches"] = _mismatches(group, per_rank)
    upto = (state["stuck"]["seq"] - 1) if state["stuck"] else max(issued.values(), default=0)
    state["entry_lag"] = _entry_lags(per_rank, upto)
    return state


def _stuck(seq: int, per_rank: dict[int, dict[int, list[Entry]]], issued: dict[int, int],
           unknown: list[int]) -> dict[str, Any]:  # fmt: skip
    entered = sorted(r for r, n in issued.items() if n >= seq)
    missing = sorted(r for r, n in issued.items() if n < seq)
    seen = [per_rank[r][seq] for r in entered if seq in per_rank[r]]
    out: dict[str, Any] = {"seq": seq, "entered": entered, "missing": missing, "no_dump": unknown,
                           **(_describe(seen[0]) if seen else {"op": None})}  # fmt: skip
    times = {r: per_rank[r][seq][0].created_ns for r in entered if seq in per_rank[r]}
    known = {r: t for r, t in times.items() if t is not None}
    if known:
        first = min(known.values())
        out["entry_lag_s"] = {str(r): round((t - first) / 1e9, 6) for r, t in sorted(known.items())}
        timeout = out.get("timeout_ms")
        out["late"] = sorted(r for r, t in known.items() if timeout and (t - first) / 1e6 > timeout)
    out["missing_last"] = {str(r): {"seq": issued[r], "op": _op(per_rank[r][issued[r]]) if issued[r] in per_rank[r]
                                    else None} for r in missing}  # fmt: skip
    return out


def _last_completed(d: Dump, groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank's last completed collective, the latest by creation time over its groups."""
    best: tuple[int, dict[str, Any]] | None = None
    for g in groups:
        c = g["completed"].get(str(d.rank))
        if not c:
            continue
        es = _by_seq(d, g["group"]).get(c)
        t = es[0].created_ns if es and es[0].created_ns else 0
        failed = g["stuck"] is not None and c >= g["stuck"]["seq"]  # a rooted op (broadcast) can end early
        item = {"group": g["group"], "seq": c, "op": _op(es) if es else None, "before_all_entered": failed}
        if best is None or t > best[0]:
            best = (t, item)
    return best[1] if best else None


def analyze_dumps(dumps: Dumps, world_size: int | None = None) -> dict[str, Any]:
    """Per-group collective state and one hang verdict from every rank's dump (see the module doc)."""
    by_rank = dumps.by_rank
    sized = max([world_size or 0, len(by_rank), *(r + 1 for r in by_rank)]
                + [max(g["ranks"]) + 1 for d in by_rank.values() for g in d.groups.values() if g.get("ranks")])
    names = sorted({e.group for d in by_rank.values() for e in d.entries} | {g for d in by_rank.values()
                   for g in d.status}, key=lambda g: (len(g), g))  # fmt: skip
    groups = [_group_state(g, by_rank, sized) for g in names]
    empty = sorted(r for r, d in by_rank.items() if not d.entries)
    out: dict[str, Any] = {
        "source": dumps.source, "dumps": len(by_rank), "world_size": sized,
        "versions": sorted({d.version for d in by_rank.values() if d.version}),
        "no_dump": sorted(set(range(sized)) - set(by_rank)), "empty_dumps": empty,
        "skipped_files": [{"file": f, "reason": why} for f, why in dumps.skipped], "groups": groups,
        "last_completed": {str(r): _last_completed(d, groups) for r, d in sorted(by_rank.items()) if d.entries},
        "pending_p2p": {str(r): [e.op for e in d.entries if e.p2p and e.state != "completed" and not e.retired]
                        for r, d in sorted(by_rank.items()) if any(e.p2p for e in d.entries)},
    }  # fmt: skip
    out["verdict"] = _verdict(groups, by_rank, sized)
    return out


def _verdict(groups: list[dict[str, Any]], by_rank: dict[int, Dump], world_size: int) -> dict[str, Any]:
    stuck = [g for g in groups if g["stuck"]]
    speaking = {r: d for r, d in by_rank.items() if d.entries}
    if not speaking:
        return {"culprit_ranks": [], "victim_ranks": [], "basis": "no entries (Flight Recorder off?)",
                "collective": None,
                "summary": "the dumps hold no collectives: Flight Recorder off (TORCH_FR_BUFFER_SIZE=0)?"}
    odd = [m for g in groups for m in g["mismatches"] if m["odd_ranks"]]
    if not stuck:
        if odd:
            m = odd[0]
            return {"culprit_ranks": m["odd_ranks"], "victim_ranks": [], "basis": "mismatch", "collective":
                    {"group": m["group"], "seq": m["seq"], "op": None}, "summary": _mismatch_text(m)}  # fmt: skip
        return {"culprit_ranks": [], "victim_ranks": [], "basis": "nothing pending", "collective": None,
                "summary": "every member of every group issued and completed the same collectives: no hang "
                "in the dumps"}  # fmt: skip
    states: dict[int, dict[str, Any] | None] = {r: None for r in range(world_size)}
    for r in speaking:
        counts = {g["group"]: int(g["issued"][str(r)]) for g in groups if str(r) in g["issued"]}
        completed = {g["group"]: int(c) for g in groups if (c := g["completed"].get(str(r))) is not None}
        pending = any(g["stuck"] and r in g["stuck"]["entered"] for g in groups)
        states[r] = {"step": 0, "phase": "collective_wait" if pending else "outside",
                     "collectives": counts or {"_": 0}, "completed": completed}  # fmt: skip
    v = classify(states, world_size)
    unknown = set(range(world_size)) - set(speaking)  # no dump, or Flight Recorder off there
    # the counts of the ranks that dumped decide; only when nobody is behind are the unknown the suspects
    culprits = [r for r in v["culprit_ranks"] if r not in unknown] or sorted(unknown - set(by_rank)) or sorted(unknown)
    waiting = {r for g in stuck for r in g["stuck"]["entered"]}
    if 0 < len(free := [r for r in culprits if r not in waiting]) < len(culprits):
        culprits = free  # the others wait inside a collective of a group whose missing member the dumps lack
    main = min(stuck, key=lambda g: (not set(g["stuck"]["missing"] + g["stuck"]["no_dump"]) & set(culprits),
                                     g["stuck"]["seq"]))  # fmt: skip
    s = main["stuck"]
    mism = next((m for m in main["mismatches"] if m["seq"] == s["seq"] and m["odd_ranks"]), None)
    if mism and not s["missing"]:
        culprits, basis = mism["odd_ranks"], "mismatch"
    elif not s["missing"] and not s["no_dump"] and s.get("not_started"):
        culprits, basis = s["not_started"], "not started on the device"
    else:
        basis = ("collective counts" if not set(culprits) & unknown else "no dump") if culprits else "none missing"
    if basis == "mismatch" and mism:
        summary = f"rank(s) {ranks_text(culprits)} issued another collective than the others: {_mismatch_text(mism)}"
    elif basis == "collective counts" and len(culprits) > 1 and set(culprits) <= waiting:
        basis = "cycle of waits"
        blocked = {r: sorted({w for g in stuck if r in g["stuck"]["missing"] for w in g["stuck"]["entered"]})
                   for r in culprits}  # fmt: skip
        culprits = sorted(culprits, key=lambda r: (-len(blocked[r]), r))
        summary = (f"rank(s) {ranks_text(culprits)} wait for each other: collectives issued in another order on "
                   "different groups; " + "; ".join(f"rank {r} holds up {ranks_text(blocked[r])}" for r in culprits)
                   + ". " + "; ".join(_stuck_text(g, []) for g in stuck))  # fmt: skip
    else:
        held = [_stuck_text(g, []) for g in stuck if g is not main and set(g["stuck"]["entered"]) & set(s["missing"])]
        summary = "; ".join([_stuck_text(main, culprits), *(f"meanwhile {h}" for h in held)]
                            + ([_mismatch_text(mism)] if mism else []))  # fmt: skip
    return {"culprit_ranks": culprits, "victim_ranks": sorted(r for r in speaking if r not in culprits),
            "silent_ranks": sorted(set(range(world_size)) - set(by_rank)), "basis": basis,
            "collective": {"group": main["group"], "seq": s["seq"], "op": s.get("op")}, "summary": summary}  # fmt: skip


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 12 else f"{len(ranks)} ranks ({ranks[0]}..{ranks[-1]})"


def _stuck_text(g: dict[str, Any], culprits: list[int]) -> str:
    s = g["stuck"]
    name = f"group {g['group']}" + (f" ({g['desc']})" if g.get("desc") else "")
    what = f"collective #{s['seq']}" + (f" {s['op']}" if s.get("op") else "")
    parts = [f"{name}: {what} was entered by rank(s) {ranks_text(s['entered'])}" if s["entered"] else
             f"{name}: {what} was entered by no rank that dumped"]  # fmt: skip
    if s["missing"]:
        lasts = "; ".join(f"rank {r} stopped at #{x['seq']}" + (f" {x['op']}" if x["op"] else "")
                          for r, x in list(s["missing_last"].items())[:6])  # fmt: skip
        parts.append(f"never by rank(s) {ranks_text(s['missing'])} ({lasts})")
    if s["no_dump"]:
        parts.append(f"rank(s) {ranks_text(s['no_dump'])} left no dump")
    if s.get("not_started"):
        parts.append(f"rank(s) {ranks_text(s['not_started'])} issued it but never started it on the device, "
                     "while the others did: they are behind (busy, or stuck in earlier work)")  # fmt: skip
    if s.get("late"):
        parts.append(f"rank(s) {ranks_text(s['late'])} entered after the first entrant's timeout")
    if not s["missing"] and not s["no_dump"] and g.get("members_from") == "dumps":
        parts.append("the dumps do not name this group's members (gloo records none): a member whose dump does not "
                     "show this group never entered it")  # fmt: skip
    elif not s["missing"] and not s["no_dump"] and not s.get("not_started"):
        parts.append("every member entered it and none completed it: the collective itself (transport, network "
                     "or a rank slow inside it) is stuck, no rank is missing")  # fmt: skip
    lead = f"rank(s) {ranks_text(culprits)} hold the job up: " if culprits else ""
    return lead + ", ".join(parts)


def _mismatch_text(m: dict[str, Any]) -> str:
    vals = "; ".join(f"rank {r}: {v}" for r, v in list(m["by_rank"].items())[:6])
    return f"group {m['group']} collective #{m['seq']} differs in {m['differs_in']} across ranks ({vals})"
