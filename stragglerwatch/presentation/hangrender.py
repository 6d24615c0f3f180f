"""Text of the Flight Recorder analysis, of the reconciled hang verdict and of the policies' actions
(``analyze``'s text and HTML, the dashboard)."""

from __future__ import annotations

from typing import Any

from stragglerwatch.evidence.flightrec import ranks_text


def _coll(c: dict[str, Any] | None) -> str:
    if not c or c.get("seq") is None:
        return ""
    group = f" of group {c['group']}" if c.get("group") is not None else ""
    return f"collective #{c['seq']}" + (f" {c['op']}" if c.get("op") else "") + group


def hang_verdict_lines(report: dict[str, Any]) -> list[str]:
    """The one hang verdict, which source decided it, which agree, and every difference explained or flagged."""
    v = report.get("hang_verdict")
    if not v:
        return []
    who = f"rank(s) {ranks_text(v['culprit_ranks'])}" if v["culprit_ranks"] else "no rank identified"
    where = ", ".join(x for x in (_coll(v.get("collective")), f"step {v['step']}" if v.get("step") is not None
                                  else "", f"phase {v['phase']}" if v.get("phase") else "") if x)  # fmt: skip
    lines = ["", f"Hang verdict: {who}" + (f" ({where})" if where else "") + f"; decided by {v['decided_by']}, "
             f"{v['agreement']}."]  # fmt: skip
    for e in v["evidence"]:
        lines.append(f"  {e['source']}: {e['says']}")
    for n in v["notes"]:
        lines.append(f"  note: {n}")
    return lines


def flight_recorder_lines(report: dict[str, Any], most: int = 8) -> list[str]:
    """Per group: the first collective not entered by every member, who is missing, late or mismatched."""
    fr = report.get("flight_recorder")
    if not fr:
        return []
    lines = ["", f"Flight Recorder: {fr['dumps']} dump(s) of {fr['world_size']} ranks from {fr['source']}"
             + (f" (format {', '.join(fr['versions'])})" if fr["versions"] else "")]  # fmt: skip
    if fr["no_dump"]:
        lines.append(f"  no dump from rank(s) {ranks_text(fr['no_dump'])}: their state is unknown")
    if fr["empty_dumps"]:
        lines.append(f"  rank(s) {ranks_text(fr['empty_dumps'])} recorded nothing (Flight Recorder off there: "
                     "TORCH_FR_BUFFER_SIZE=0?)")  # fmt: skip
    if fr["skipped_files"]:
        first = fr["skipped_files"][0]
        lines.append(f"  {len(fr['skipped_files'])} file(s) skipped, e.g. {first['file']}: {first['reason']}")
    lines.append(f"  verdict: {fr['verdict']['summary']}")
    for g in fr["groups"][:most]:
        name = f"group {g['group']}" + (f" ({g['desc']})" if g.get("desc") else "")
        members = f"ranks {ranks_text(g['members'])}" + (" (members as seen in the dumps)"
                                                           if g["members_from"] == "dumps" else "")  # fmt: skip
        issued = sorted(set(g["issued"].values()))
        state = "all issued the same collectives" if len(issued) <= 1 else f"issued {issued[0]}..{issued[-1]}"
        if g["stuck"]:
            s = g["stuck"]
            state += f"; #{s['seq']}" + (f" {s['op']}" if s.get("op") else "") + " not completed"
        lines.append(f"  {name}, {members}: {state}")
        for m in g["mismatches"][:3]:
            lines.append(f"    mismatch at #{m['seq']} in {m['differs_in']}: " + "; ".join(
                f"rank {r}: {val}" for r, val in list(m["by_rank"].items())[:6]))  # fmt: skip
        lag = g.get("entry_lag")
        if lag and len(lag["entered_last"]) > 0:
            r, n = max(lag["entered_last"].items(), key=lambda kv: kv[1])
            if n > lag["collectives"] / 2 and lag["collectives"] >= 8:
                lag_ms = lag["median_lag_s"].get(r, 0) * 1e3
                lines.append(f"    rank {r} entered last in {n} of the last {lag['collectives']} complete collectives "
                             f"(median {lag_ms:.1f} ms after the first; host clocks)")  # fmt: skip
    if len(fr["groups"]) > most:
        lines.append(f"  ... {len(fr['groups']) - most} more groups (--format json)")
    last = {r: c for r, c in fr["last_completed"].items() if c}
    if last:
        early = " (before every member entered it)"
        lines.append("  last completed collective: " + "; ".join(
            f"rank {r} #{c['seq']} {c['op'] or ''}".rstrip() + (early if c["before_all_entered"] else "")
            for r, c in list(last.items())[:most]) + (" ..." if len(last) > most else ""))  # fmt: skip
    return lines


def action_line(a: dict[str, Any], ranks: list[int] | None = None) -> str:
    """One sentence on an action of the policies (``on_hang``, ``on_straggler``); ``ranks``: the ranks an
    abort speaks for (default: its own)."""
    when = f" (restart {a['restart']})" if a.get("restart") else ""
    if a.get("action") == "abort":
        culprits = ranks_text(a.get("culprit_ranks") or []) or "none identified"
        who = f"rank(s) {ranks_text(ranks)}" if ranks is not None else f"rank {a.get('rank')}"
        return (f"hang policy: {who}{when} left the job (exit status {a.get('exit_status')}) "
                f"{a.get('stalled_s', 0):.0f} s into a stall whose culprit was rank(s) {culprits}")
    v = a.get("verdict") or {}
    declined = a.get("declined") or {}
    if not a.get("done") and "all" in declined:
        done = f"left alone: {declined['all']}"
    else:
        done = ", ".join(a.get("done") or []) or "no action succeeded"
    where = f" into {a['exclude_file']}" if a.get("exclude_file") else ""
    why = "".join(f"; {k} declined: {r}" for k, r in declined.items() if k != "all")
    return (
        f"straggler policy{when}: rank {v.get('rank')} on {v.get('host') or 'an unknown host'} ({v.get('cause')}, "
        f"{v.get('slowdown')}x for {v.get('flagged_s')} s from step {v.get('since_step')}): {done}{where}{why}"
    )


def action_lines(report: dict[str, Any]) -> list[str]:
    """The policies' actions: the aborts of one stall in one line, each straggler action in its own."""
    actions = report.get("actions") or []
    aborts: dict[Any, list[dict[str, Any]]] = {}
    lines = []
    for a in actions:
        if a.get("action") == "abort":
            aborts.setdefault((a.get("restart"), a.get("culprit_ranks") and tuple(a["culprit_ranks"])), []).append(a)
        else:
            lines.append(action_line(a))
    for group in aborts.values():
        failed = sorted({int(a["rank"]) for a in group if a.get("error")})
        after = (f"; rank(s) {ranks_text(failed)} as a culprit left (their collective's error, or torchrun's "
                 "SIGTERM)" if failed else "")  # fmt: skip
        lines.insert(0, action_line(group[0], sorted({int(a["rank"]) for a in group})) + after)
    return lines
