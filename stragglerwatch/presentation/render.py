"""Text rendering of an analysis report (a dict, see ``analysis.py``): verdict first (load imbalance
among it, where work per step was recorded), then the per-rank table and, with work, a table of each
rank's work per step and busy time per unit of it, in 80 columns."""

from __future__ import annotations

from typing import Any

from stragglerwatch.analysis.attempts import rank_ranges
from stragglerwatch.analysis.codeprofile import NO_SAMPLES, describe_site
from stragglerwatch.presentation.hangrender import action_lines, flight_recorder_lines, hang_verdict_lines

MAX_TABLE_ROWS = 16


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


MAX_EPISODES = 4  # episodes listed by step; the rest are counted


def episodes_text(episodes: list[list[Any]]) -> str:
    """``steps 10-40, 95-130 and 200-`` (an open episode has no end)."""
    parts = [f"{e[0]}-{'' if e[1] is None else e[1]}" for e in episodes[:MAX_EPISODES]]
    more = len(episodes) - len(parts)
    if more:
        parts.append(f"{more} more")
    return "steps " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def _steps(s: dict[str, Any]) -> str:
    episodes = s.get("episodes") or []
    still = ", still slow at the end" if s["last_step"] is None else ""
    if len(episodes) > 1:
        return f"in {len(episodes)} episodes ({episodes_text(episodes)}{still})"
    if s["last_step"] is None:
        return f"since step {s['first_step']} (still slow at the end)"
    return f"from step {s['first_step']} to step {s['last_step']}"


def minor_lines(report: dict[str, Any]) -> list[str]:
    """The brief flags of negligible cost (``detect._headline``): one line for them all."""
    minor = report.get("minor") or []
    if not minor:
        return []
    parts = [f"rank {m['rank']} ({m['cause']}, {episodes_text(m['episodes'])}, "
             f"fixing it saves {_duration(m['saves_seconds'])})" for m in minor[:MAX_TABLE_ROWS]]  # fmt: skip
    more = f" and {len(minor) - MAX_TABLE_ROWS} more" if len(minor) > MAX_TABLE_ROWS else ""
    return [f"brief flags of negligible cost (details, not stragglers): {'; '.join(parts)}{more}."]


def code_text(s: dict[str, Any]) -> str:
    """Where in the code a straggler's excess lies, or why that is not known."""
    sites = s.get("code") or []
    if not sites:
        note = s.get("code_note")
        return f"not located ({note})" if note and note != NO_SAMPLES else ""
    total = sum(c["excess_ms"] for c in sites) / max(sum(c["share"] for c in sites), 1e-9)
    parts = [f"{c['share']:.0%} at {describe_site(c)}" for c in sites]
    return f"of its extra {total:.1f} ms/step, " + "; ".join(parts)


def arrival_lines(report: dict[str, Any]) -> list[str]:
    """What the arrival order at the collectives adds to the verdict: ranks it clears, ranks on which it
    disagrees with busy time, and groups it could not compare."""
    arrivals = report.get("arrivals")
    if not arrivals or report.get("busy_unavailable"):
        return []
    lines = [f"coverage: {note}." for note in arrivals.get("coverage") or []]
    if arrivals.get("busy_adjusted"):
        lines.append("busy time less the waits for later arrivals that no bracket saw (the phases keep them).")
    for c in arrivals.get("cleared") or []:
        lines.append(f"not a straggler: rank {c['rank']}: {c['reason']}.")
    for d in arrivals.get("disagree") or []:
        lines.append(f"busy time and arrival order disagree on rank {d['rank']}: {d['reason']}.")
    skipped = arrivals.get("groups_skipped") or {}
    if skipped:
        lines.append(f"arrival order not compared in {len(skipped)} group(s) whose ranks span hosts (their "
                     "clocks are not comparable).")  # fmt: skip
    lost = sum((arrivals.get("lost_entries") or {}).values())
    if lost:
        lines.append(f"arrival order: {lost} collectives PyTorch recorded were not read before its ring "
                     "overwrote them (reads wait for close once one is costly); the rest were compared.")  # fmt: skip
    return lines


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The verdict in a few sentences; shared by the text report and the dashboard banner."""
    lines = []
    stragglers = report["stragglers"]
    unavailable = report.get("busy_unavailable") or []
    arrived = {x["rank"]: x for x in (report.get("arrivals") or {}).get("ranks") or []}
    for u in unavailable:
        lines.append(f"busy time unavailable: {u['reason']} (rank {_ranks(u['ranks'])}).")
    if unavailable:
        lines.append("no straggler verdict: busy times that still hold communication cannot be compared.")
    elif stragglers:
        n = len(stragglers)
        lines.append(f"{n} straggler{'s' if n > 1 else ''}:")
        same = " for the same work" if (report.get("imbalance") or {}).get("detected") else ""
        for s in stragglers:
            excess = s["excess_ms"].get(s["cause"], 0.0)
            where = f"{s['where']}, " if s.get("where") else ""
            at = f" in attempt {s['attempt']}" if s.get("attempt") is not None else ""
            lines.append(
                f"  rank {s['rank']}{at} is {s['slowdown']:.2f}x as busy as its peers{same} {_steps(s)}; "
                f"cause: {s['cause']} ({where}+{excess:.1f} ms/step); cost {_duration(s['lost_seconds'])} "
                f"({s['lost_gpu_seconds']:.0f} GPU-s){_saves(s)}"
            )
            why = context_text(s)
            if why:
                lines.append(f"    why: {why}")
            code = code_text(s)
            if code:
                lines.append(f"    code: {code}")
            lines += [f"    try: {h}" for h in s.get("hints") or []]
            mine = arrived.get(s["rank"])
            if mine is not None:
                lines.append(f"    arrivals: entered {mine['last_share']:.0%} of its collectives last "
                             f"({mine['collectives_per_step']:g} a step compared)")  # fmt: skip
    else:
        lines.append("no consistently slow rank.")
    if not unavailable:
        lines += minor_lines(report)
    lines += arrival_lines(report)
    attempts = report.get("attempts") or []
    if len(attempts) > 1:
        lines.append(f"{len(attempts)} attempts, steps numbered on across them:")
        lines += [f"  {attempt_text(a, i)}" for i, a in enumerate(attempts)]
    for g in report.get("group_imbalance", []):
        lines.append(f"group imbalance: {g['group']} (ranks {_ranks(g['ranks'])}) is {g['slowdown']:.2f}x as busy")
    if report.get("unpaired"):
        roles = {row["rank"]: row.get("role") for row in report.get("ranks", [])}
        alone = ", ".join(f"{r} ({roles.get(r)})" if roles.get(r) else str(r) for r in report["unpaired"])
        lines.append(f"not compared: rank{'s' if len(report['unpaired']) > 1 else ''} {alone}, each alone in its peer "
                     "group (role, e.g. a pipeline stage of one rank): a rank is compared only with ranks of its own "
                     "role, so none of these can be flagged; the groups are compared instead.")
    lines += imbalance_lines(report)
    for h in report.get("hangs", []):
        lines.append(hang_line(h))
    lines += action_lines(report)
    if report["communication_bound"]:
        lines.append(
            f"communication-bound: even the busiest rank waits {report['comm_fraction']:.0%} of each step "
            "in communication (no rank straggles; the network or collective is the limit)."
        )
    if unavailable:
        return lines
    ideal = ("if every op took its typical time (what-if replay)" if "whatif_verdict" in report
             else "if every rank ran at its peers' median")  # fmt: skip
    split = report.get("lost_split")
    lost_to = _split_text(split) if split and "whatif_verdict" not in report else f" to {_lost_to(report)}"
    lines.append(
        f"job slowdown S = {report['job_slowdown']:.3f}: {_duration(report['job_seconds'])} actual vs "
        f"{_duration(report['ideal_seconds'])} {ideal} "
        f"({_duration(report['lost_seconds'])} lost{lost_to}; {report['lost_gpu_seconds']:.0f} GPU-s)"
    )
    lines += jitter_tax_lines(report)
    return lines


def jitter_tax_lines(report: dict[str, Any]) -> list[str]:
    """What jitter alone would cost as the job grows (``jittertax.py``), where projected."""
    tax = report.get("jitter_tax") or {}
    if tax.get("note"):
        return [f"jitter tax as the job grows: not projected ({tax['note']})."]
    points = tax.get("projections") or []
    if len(points) < 2:
        return []
    now, later = points[0], points[1:]
    parts = [f"{p['share']:.1%} at {p['ranks']:,} ranks ({p['low']:.1%}-{p['high']:.1%}"
             + (", beyond the run's data: at least" if p.get("beyond_data") else "") + ")" for p in later]  # fmt: skip
    return [f"jitter tax as the job grows (this run's noise, slowest of more ranks): {now['share']:.1%} of each "
            f"step at {now['ranks']:,} ranks today; " + ", ".join(parts) + " (90% range)."]  # fmt: skip


def _saves(s: dict[str, Any]) -> str:
    """What fixing a straggler would save, where known (reports of earlier releases do not say)."""
    if s.get("saves_seconds") is None:
        return ""
    return f"; fixing it saves {_duration(s['saves_seconds'])} ({s['saves_share']:.1%} of the job's time while slow)"


def _split_text(split: dict[str, float]) -> str:
    """Where the lost time went, the parts in words."""
    parts = [f"{_duration(split.get('stragglers', 0.0))} to the flagged stragglers"]
    if split.get("imbalance"):
        parts.append(f"{_duration(split['imbalance'])} to unequal work")
    if split.get("groups"):
        parts.append(f"{_duration(split['groups'])} to unequal peer groups (the busier stage or role)")
    parts.append(f"{_duration(split.get('jitter', 0.0))} to jitter (whichever rank is slowest at a step)")
    return ": " + ", ".join(parts)


def imbalance_lines(report: dict[str, Any]) -> list[str]:
    """Load imbalance (ranks given unequal work in the same step), when work per step was recorded:
    its cost and what work size explains, the heaviest ranks, what to try; one line when there is none."""
    imb = report.get("imbalance")
    if not imb:
        return []
    unit = imb["unit"]
    if not imb["detected"]:
        if not imb.get("varies", True) and not imb.get("note"):
            return []  # the same work on every rank in every step: nothing to say
        s = f" (S {imb['slowdown']:.2f}x)" if imb.get("slowdown") is not None else ""
        note = [f"  note: {imb['note']}"] if imb.get("note") else []
        return [f"work per step recorded ({unit}): no load imbalance worth reporting{s}.", *note]
    cost = []
    if imb.get("lost_seconds") is not None:
        gpu = f", {imb['lost_gpu_seconds']:.0f} GPU-s" if imb.get("lost_gpu_seconds") is not None else ""
        alone = f" (S {imb['slowdown']:.2f} from imbalance alone)" if imb.get("slowdown") is not None else ""
        cost.append(f"imbalance cost {_duration(imb['lost_seconds'])}{gpu}{alone}")
    if imb.get("explained") is not None:
        cost.append(f"work size explains {imb['explained']:.0%} of the spread of busy time across ranks")
    lines = [f"load imbalance: ranks got unequal {unit} in the same step (not a slow rank):"]
    if cost:
        lines.append("  " + ", ".join(cost))
    work = work_text(imb)
    if work:
        lines.append(f"    work: {work}")
    lines += [f"    try: {h}" for h in imb.get("hints") or []]
    if imb.get("note"):
        lines.append(f"    note: {imb['note']}")
    return lines


def work_text(imb: dict[str, Any]) -> str:
    """How the work was spread (the report's ``imbalance``), in one sentence; "" if nothing is known."""
    parts = []
    if imb.get("work_spread") is not None:
        parts.append(f"a step's heaviest rank has {imb['work_spread']:.0%} more {imb['unit']} than the mean "
                     "(median over steps)")  # fmt: skip
    heaviest = imb.get("heaviest_ranks") or []
    if heaviest:
        share = f" (the first in {imb['heaviest_share']:.0%} of the steps)" if imb.get("heaviest_share") else ""
        share = share.replace("the first in", "in") if len(heaviest) == 1 else share
        parts.append(f"heaviest most often: rank{'s' if len(heaviest) > 1 else ''} {_ranks(heaviest)}{share}")
    if imb.get("seconds_per_unit") is not None:
        cost = _per_unit_us(imb["seconds_per_unit"] * 1e6)
        parts.append(f"one more {_singular(imb['unit'])} costs a healthy rank {cost}")
    return "; ".join(parts)


def _per_unit_us(us: float) -> str:
    return f"{us / 1000:.3g} ms" if us >= 1000 else f"{us:.3g} µs"


def _singular(unit: str) -> str:
    return unit[:-1] if unit.endswith("s") and len(unit) > 1 else unit


def _lost_to(report: dict[str, Any]) -> str:
    imb = report.get("imbalance")
    return "stragglers, load imbalance and jitter" if imb and imb.get("detected") else "stragglers and jitter"


def context_text(straggler: dict[str, Any]) -> str:
    """What its host and GPU context say about a straggler (``explain.py``), in one sentence; "" if nothing."""
    return "; ".join(f["text"] for f in straggler.get("context") or [])


_BASIS_TEXT = {
    "collective counts": " (by the collectives each rank issued)",
    "started counts": " (by the collectives each rank's GPU started)",
    "completed counts": " (by the collectives each rank completed)",
    "device progress": " (by where each rank's GPU is: inside a collective or not)",
}


def hang_line(h: dict[str, Any]) -> str:
    """One sentence on a hang: who, where, who waited, what became of it."""
    culprits = _ranks(h.get("culprit_ranks", [])) or "none identified"
    kind = "job went down" if h.get("evidence") == "shutdown" else "stall"
    text = f"{kind} at step {h.get('step')}: culprit rank(s) {culprits} in {h.get('phase')}"
    if h.get("silent_ranks"):
        text += f" (silent: {_ranks(h['silent_ranks'])}, dead or stuck in native code)"
    if h.get("victim_ranks"):
        text += f"; waiting for it in a collective: {_ranks(h['victim_ranks'])}"
    text += _BASIS_TEXT.get(str(h.get("basis")), "")
    if h.get("undecided"):
        text += f"; undecided: {str(h.get('detail', ''))[:400]}"
    if h.get("mismatch_suspected"):
        text += "; the culprits are themselves blocked in a collective: one the others never issue (mismatch)?"
    if h.get("waited_s"):
        text += f"; noticed after {h['waited_s']:.1f} s"
    if h.get("busy"):
        doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(h["busy"].items(), key=lambda x: int(x[0]))[:4])
        text += f"; busy, not hung ({doing[:400]})"
    if h.get("aborted_ranks"):
        text += f"; ended by the hang policy on rank(s) {_ranks(h['aborted_ranks'])}"
    elif h.get("ended"):
        reason = (h["ended"].get("reasons") or ["?"])[0]
        text += f"; the job went down while it lasted ({reason[:120]})"
    elif h.get("evidence") != "shutdown":
        text += "; it recovered" if h.get("recovered") else "; no recovery recorded"
    return text + "."


def main_stack(stacks: dict[str, str], lines: int = 8) -> str:
    """The last lines of the main thread's stack (where the culprit is stuck); of a faulthandler
    dump (most recent call first), the first lines of the thread that runs ``<module>``."""
    if "faulthandler" in stacks:
        blocks = stacks["faulthandler"].split("\n\n")
        main_block = next((b for b in blocks if "<module>" in b), blocks[-1]).strip().splitlines()
        return "\n".join(["(stuck in native code holding the GIL; most recent call first)", *main_block[1 : lines + 1]])
    main = next((v for k, v in stacks.items() if k.startswith("MainThread")), None)
    if main is None and stacks:
        main = next(iter(stacks.values()))
    return "\n".join((main or "").rstrip().splitlines()[-lines:])


def whatif_lines(report: dict[str, Any], width: int = 80) -> list[str]:
    """The what-if replay of an op-level trace (``analyze TRACE --meta``)."""
    if "whatif_verdict" not in report:
        return []
    att = report["attribution"]
    head = (f"what-if replay: S = {report['job_slowdown']:.2f} ({report['whatif_verdict']}); "
            "S with only one part's durations real (compute and transfers):")  # fmt: skip
    lines = ["", *_wrap(head, width)]
    workers = ", ".join(f"rank {w['rank']} (dp {w['dp_rank']}, stage {w['stage']}) {w['slowdown']:.2f}"
                        for w in att["workers"][:3])  # fmt: skip
    stages = ", ".join(f"stage {s['stage']} {s['slowdown']:.2f}" for s in att["stages"])
    ops = ", ".join(f"{o['optype']} {o['slowdown']:.2f}" for o in att["optypes"])
    for text in (f"  workers: {workers}", f"  stages: {stages}", f"  op types: {ops}"):
        lines += _wrap(text, width)
    return lines


def pytorch_log_lines(report: dict[str, Any], width: int = 80, most: int = 12) -> list[str]:
    """What PyTorch's own log messages say (``analyze --logs``)."""
    if "log_events" not in report:
        return []
    events = report["log_events"]
    lines = ["", f"PyTorch logs: {report['log_lines']} lines, {len(events)} failure messages "
             f"({report['log_skipped_lines']} other lines skipped)"]  # fmt: skip
    first = report.get("first_failure")
    if first:
        label = "fingerprint SequenceNumber" if first.get("rule") == "collective mismatch" else "SeqNum"
        what = " ".join(str(x) for x in (f"{label} {first['seq']}" if first.get("seq") is not None else None,
                                         first.get("op")) if x)  # fmt: skip
        who = _ranks(first.get("ranks") or [first.get("rank")])
        lines += _wrap(f"  first failure: rank(s) {who}" + (f", collective {what}" if what else "")
                       + f" (by {first.get('rule', first.get('kind'))}: {first.get('kind')}, line "
                       f"{first.get('line_no')})" + (f"; it raised {first['error']}" if first.get("error") else ""),
                       width)  # fmt: skip
    for e in events[:most]:
        fields = [f"{k}={e[k]}" for k in ("rank", "pg", "seq", "op", "timeout_ms", "ran_for_ms", "exit_code",
                                          "signal", "peer", "error") if e.get(k) is not None]  # fmt: skip
        lines += _wrap(f"  line {e['line_no']}: {e['kind']} " + " ".join(fields), width)
    if len(events) > most:
        lines.append(f"  ... {len(events) - most} more (--format json for all)")
    return lines


def attempt_text(a: dict[str, Any], index: int) -> str:
    """One attempt of the run in a line: its steps, ranks and nodes, who left or joined, its cost, and why
    it ended."""
    head = f"attempt {index} (restart {a['restart']}" + (f", attach {a['attach']}" if a.get("attach") else "") + ")"
    parts = [f"steps {a['first_step']}-{a['last_step']}"]
    if a.get("world_size"):
        parts.append(f"{a['world_size']} ranks" + (f" on {a['nodes']} node(s)" if a.get("nodes") else ""))
    for key, label in (("left", "left"), ("joined", "joined"), ("moved", "moved to another node")):
        if a.get(key):
            parts.append(f"ranks {rank_ranges(a[key])} {label}")
    for key, label in (("nodes_left", "nodes left"), ("nodes_joined", "nodes joined")):
        if a.get(key):
            parts.append(f"{label}: " + ", ".join(a[key]))
    if a.get("lost_seconds") is not None:
        gpu = f" ({a['lost_gpu_seconds']:.0f} GPU-s)" if a.get("lost_gpu_seconds") is not None else ""
        parts.append(f"{_duration(a['job_seconds'])} long, {_duration(a['lost_seconds'])} lost{gpu}")
    return f"{head}: " + ", ".join(parts) + (f"; ended: {a['ended']}." if a.get("ended") else ".")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _wrap(line: str, width: int) -> list[str]:
    indent = len(line) - len(line.lstrip())
    out, cur = [], ""
    for word in line.split():
        if cur and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = " " * (indent + 2) + word
        else:
            cur = f"{cur} {word}" if cur else " " * indent + word
    return out + [cur]


def render_text(report: dict[str, Any], width: int = 80) -> str:
    pytorch = [x for line in pytorch_log_lines(report, width) + flight_recorder_lines(report)
               + hang_verdict_lines(report) for x in (_wrap(line, width) if line else [line])]  # fmt: skip
    if not report["ranks_seen"] and not report.get("hangs"):  # PyTorch's evidence alone
        return "\n".join(pytorch[1:])
    sizes = [a.get("world_size") for a in report.get("attempts") or []]
    resized = len({x for x in sizes if x}) > 1  # an elastic job that went on with another number of ranks
    head = (
        f"run {report.get('run_id') or '?'}: {report['ranks_seen']} of {report['world_size']} ranks"
        + (f" (by attempt: {', '.join(str(x or '?') for x in sizes)})" if resized else "")
        + f", {report['steps']} steps"
    )
    lines = [head, ""]
    for line in verdict_lines(report):
        lines += _wrap(line, width)
    lines += whatif_lines(report, width)
    lines += pytorch
    for h in report.get("hangs", []):
        for rank, stacks in (h.get("stacks") or {}).items():
            lines += ["", f"rank {rank}, main thread, when the stall was noticed:"]
            lines += ["  " + line[: width - 2] for line in main_stack(stacks).splitlines()]
    lines += ["", *rank_table(report)]
    return "\n".join(lines)


def rank_table(report: dict[str, Any], limit: int | None = MAX_TABLE_ROWS) -> list[str]:
    """The report's per-rank table (``analyze`` shows at most ``limit`` rows: the flagged and the slowest;
    ``summary`` every one), and the work table under it where work was recorded."""
    lines = ["per rank, medians over its steps in ms (busy = step - exposed comm - eval;",
             "vs peers = busy_vs_peers, its busy time over its peers'; * = flagged):",
             f"{'rank':>6} {'step':>7} {'busy':>7} {'data':>6} {'fwd':>6} {'bwd':>6} {'comm':>7} "
             f"{'opt':>5} {'other':>6} {'vs peers':>8}"]  # fmt: skip
    rows = report["ranks"]
    if limit is not None and len(rows) > limit:
        ordered = sorted(rows, key=lambda r: (not r["flagged"], -(r["busy_vs_peers"] or r["busy_ms"] or 0)))
        shown = sorted(ordered[:limit], key=lambda r: r["rank"])
    else:
        shown = rows
    for r in shown:
        flag = " *" if r["flagged"] else ""
        lines.append(
            f"{r['rank']:>6} {_f(r['step_ms'], 7)} {_f(r['busy_ms'], 7)} {_f(r['data_wait_ms'], 6)} "
            f"{_f(r['forward_ms'], 6)} {_f(r['backward_ms'], 6)} {_f(r.get('comm_wait_ms'), 7)} "
            f"{_f(r['optimizer_ms'], 5)} {_f(r['other_ms'], 6)} {_f(r['busy_vs_peers'], 7, 2)}x{flag}"
        )
    if len(rows) > len(shown):
        lines.append(f"  ... {len(rows) - len(shown)} more ranks (flagged and slowest shown; --format json for all)")
    return lines + work_table_lines(report, shown)


def work_table_lines(report: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The work per step and busy time per unit of work of ``rows``, when any rank has them: a table of
    its own under the per-rank one (together they would not fit 80 columns)."""
    if not any(r.get("work") is not None or r.get("busy_per_work_us") is not None for r in rows):
        return []
    unit = (report.get("imbalance") or {}).get("unit") or "units"
    one = _singular(unit)
    lines = ["", f"work per rank (medians; work in {unit} per step, busy µs per {one}):",
             f"{'rank':>6} {'work/step':>11} {'busy/' + one:>14} {'busy ms':>8} {'vs peers':>8}"]  # fmt: skip
    for r in rows:
        flag = " *" if r["flagged"] else ""
        lines.append(f"{r['rank']:>6} {_g(r.get('work'), 11)} {_g(r.get('busy_per_work_us'), 14)} "
                     f"{_f(r['busy_ms'], 8)} {_f(r['busy_vs_peers'], 7, 2)}x{flag}")  # fmt: skip
    return lines


def _g(value: float | None, width: int) -> str:
    """Digits by size, thousands separated (work is tokens or elements, from fractions to millions; and
    busy time per unit of it from nanoseconds to milliseconds)."""
    if value is None:
        return f"{'-':>{width}}"
    size = abs(value)
    spec = ",.0f" if size >= 1000 else ".1f" if size >= 10 else ".2f" if size >= 1 else ".3g"
    return f"{value:>{width}{spec}}"


def _f(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
