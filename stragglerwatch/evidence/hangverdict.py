"""One hang verdict from every source at hand, saying which evidence supports what.

Sources, strongest first:

1. **Flight Recorder** (``flightrec.analyze_dumps``): PyTorch's per-group count of collectives
   each rank issued, and the operations themselves (mismatches).
2. **Our watchdog** (``hangs.hangs_from_events``): the same per-group counts, read live at the stall
   and exchanged through the job's store ("store" evidence), or only phases, or a rank's own view
   ("local"), or the shape of a torn-down job ("shutdown").
3. **PyTorch's logs** (``torchlogs.LogParse.first_failure``): a desync report names the lagging
   ranks; otherwise last enqueued / completed work numbers; otherwise only the first rank whose
   timeout fired, or torchrun's "root cause" (the first process to exit).

The strongest source decides. Every other source either names the same ranks, or its difference is
explained by what it measures (the first timeout in a log is a victim's: the victim's watchdog fires,
the culprit is not in the collective; torchrun's root cause is the first process to *exit*; a rank
that left no record is unknown to a source, not innocent), or it is flagged as a disagreement
that nobody explains. Pure function: report parts in, verdict out.
"""

from __future__ import annotations

from typing import Any


def _norm_op(op: Any) -> str | None:
    return str(op).lower().replace("_", "").replace("gloo:", "").replace("nccl:", "") if op else None


def _from_fr(fr: dict[str, Any] | None) -> dict[str, Any] | None:
    if not fr or not fr.get("verdict"):
        return None
    v = fr["verdict"]
    decisive = ("collective counts", "mismatch", "not started on the device", "cycle of waits")
    strength = 5 if v["basis"] in decisive else 2 if v["culprit_ranks"] else 0
    entered = set()
    c = v.get("collective")
    for g in fr.get("groups", []):
        if c and g["group"] == c["group"] and g.get("stuck"):
            entered = set(g["stuck"]["entered"])
    return {"source": "flight recorder", "culprit_ranks": v["culprit_ranks"], "collective": c, "basis": v["basis"],
            "says": v["summary"], "strength": strength, "entered": sorted(entered),
            "unknown": v.get("silent_ranks", [])}  # fmt: skip


def _from_watchdog(hangs: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not hangs:
        return None
    live = [h for h in hangs if not h.get("recovered")]
    h = (live or hangs)[-1]
    basis, evidence = h.get("basis"), h.get("evidence")
    strength = {("store", "collective counts"): 4, ("store", "started counts"): 4, ("store", "completed counts"): 4,
                ("store", "device progress"): 3, ("store", "phases"): 2, ("local", "phases"): 1,
                ("store", "undecided"): 0}.get((evidence, basis), 1)  # fmt: skip
    where = f"step {h.get('step')}, phase {h.get('phase')}"
    state = "recovered" if h.get("recovered") else "not recovered"
    says = (f"ranks {h['culprit_ranks']} stuck at {where} ({state}); victims {h.get('victim_ranks', [])}"
            + (f"; silent {h['silent_ranks']}" if h.get("silent_ranks") else "")
            + f" [evidence: {evidence}, {basis or 'shutdown shape'}]")  # fmt: skip
    return {"source": "stragglerwatch watchdog", "culprit_ranks": list(h.get("culprit_ranks", [])),
            "collective": None, "basis": f"{evidence}/{basis}" if basis else evidence, "says": says,
            "strength": strength, "recovered": bool(h.get("recovered")), "unknown": h.get("silent_ranks", []),
            "step": h.get("step"), "phase": h.get("phase")}  # fmt: skip


_LOG_BEHIND = ("desync report", "collective mismatch", "behind", "monitored barrier")  # name who is behind


def _from_logs(first: dict[str, Any] | None) -> dict[str, Any] | None:
    if not first or first.get("rank") is None and not first.get("ranks"):
        return None
    rule = str(first.get("rule") or "first message")
    ranks = sorted(first.get("ranks") or [first["rank"]])
    # a fingerprint's SequenceNumber is another counter (from 0) than Flight Recorder's and WorkNCCL's
    seq = first.get("seq") if rule != "collective mismatch" else None
    coll = {"group": first.get("pg"), "seq": seq, "op": first.get("op")} if seq is not None else None
    says = f"rank(s) {ranks} by {rule} ({first.get('kind')}, line {first.get('line_no')}" + (
        f" of {first['file']})" if first.get("file") else ")") + (f"; it raised {first['error']}" if first.get("error")
                                                                  else "")  # fmt: skip
    return {"source": "pytorch logs", "culprit_ranks": ranks, "collective": coll, "basis": rule, "says": says,
            "strength": 3 if rule in _LOG_BEHIND else 2 if rule == "did not time out" else 1,
            "unknown": []}  # fmt: skip


def _explain(src: dict[str, Any], decided: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``src``'s difference from the deciding source is explained, and how."""
    named, culprits = set(src["culprit_ranks"]), set(decided["culprit_ranks"])
    entered = set(decided.get("entered") or [])
    name, dname = src["source"], decided["source"]
    if not named:
        if decided.get("recovered"):
            return True, f"{name} shows nothing pending: its records are from after the stall recovered"
        return False, (f"DISAGREEMENT: {name} shows no rank behind, {dname} names {sorted(culprits)}: were "
                       f"they recorded at different moments?")  # fmt: skip
    if src["source"] == "pytorch logs" and src["basis"] in ("first timeout", "first message") and (
            named <= entered or not entered):
        return True, (f"{name} name rank(s) {sorted(named)} because their timeout message comes first; {dname} "
                      f"shows them inside the collective, waiting: a victim's watchdog fires first, the culprit is "
                      f"not in the collective to time out")  # fmt: skip
    if src["source"] == "pytorch logs" and src["basis"] == "root cause":
        return True, (f"torchrun's root cause (rank(s) {sorted(named)}) is the first process to exit, which is "
                      f"usually a victim whose collective timed out; {dname} decides who was behind")  # fmt: skip
    extra, unheard, unrecorded = named - culprits, set(src.get("unknown") or []), set(decided.get("unknown") or [])
    if named and named <= unheard and culprits:
        return True, (f"{name} could only name rank(s) {sorted(named)} as silent (no record from them); {dname} "
                      f"has their data and names {sorted(culprits)}")  # fmt: skip
    if culprits <= named and extra <= unheard:
        return True, (f"{name} also names rank(s) {sorted(extra)} because it heard nothing from them (silent); "
                      f"{dname} has their records and does not blame them")  # fmt: skip
    if culprits <= named | unheard and extra <= unrecorded:
        return True, (f"{name} also names rank(s) {sorted(extra)}, of which {dname} has no record: unknown "
                      f"there, not cleared")  # fmt: skip
    if src.get("recovered"):
        return True, (f"{name}'s stall recovered: the job moved on after it, so a later hang or the dumps' "
                      f"moment can differ")  # fmt: skip
    if src["strength"] <= 2 and "phases" in str(src["basis"]):
        return True, (f"{name} decided by phases only (no per-group counts from every rank); {dname}'s "
                      f"counts decide")  # fmt: skip
    return False, (f"DISAGREEMENT: {name} names rank(s) {sorted(named)}, {dname} names {sorted(culprits)}, and "
                   f"nothing known explains it: check both")  # fmt: skip


def _collective_note(sources: list[dict[str, Any]]) -> list[str]:
    """Do the sources that name a collective name the same one?"""
    named = [s for s in sources if s.get("collective") and s["collective"].get("seq") is not None]
    notes = []
    for a in named[1:]:
        b, ca, cb = named[0], a["collective"], named[0]["collective"]
        same_group = ca.get("group") is None or cb.get("group") is None or str(ca["group"]) == str(cb["group"])
        ops = (_norm_op(ca.get("op")), _norm_op(cb.get("op")))
        if same_group and ca["seq"] == cb["seq"] and (None in ops or ops[0] == ops[1]):
            notes.append(f"{a['source']} and {b['source']} name the same collective (#{ca['seq']})")
        elif same_group and ca["seq"] > cb["seq"]:
            notes.append(f"{a['source']} name collective #{ca['seq']}, {b['source']} #{cb['seq']}: ranks that entered "
                         f"#{cb['seq']} went on to issue later collectives before blocking (asynchronous "
                         f"collectives), so the first one not entered by every rank is #{cb['seq']}")  # fmt: skip
        else:
            notes.append(f"DISAGREEMENT on the collective: {a['source']} say #{ca['seq']} {ca.get('op') or ''}"
                         f" (group {ca.get('group')}), {b['source']} #{cb['seq']} {cb.get('op') or ''} (group "
                         f"{cb.get('group')})")  # fmt: skip
    return notes


def reconcile(hangs: list[dict[str, Any]], fr: dict[str, Any] | None,
              first_failure: dict[str, Any] | None) -> dict[str, Any] | None:  # fmt: skip
    """The hang verdict from our watchdog's hangs, the Flight Recorder analysis and the logs' first
    failure; None when no source says anything about a hang."""
    sources = [s for s in (_from_fr(fr), _from_watchdog(hangs), _from_logs(first_failure)) if s is not None]
    if not any(s["culprit_ranks"] for s in sources):
        return None
    decided = max(sources, key=lambda s: (s["strength"], bool(s["culprit_ranks"])))
    notes, agree, explained = [], [], True
    for s in sources:
        if s is decided:
            continue
        if set(s["culprit_ranks"]) == set(decided["culprit_ranks"]):
            agree.append(s["source"])
            continue
        ok, text = _explain(s, decided)
        explained &= ok
        notes.append(text)
    notes += _collective_note([decided] + [s for s in sources if s is not decided])
    if any(n.startswith("DISAGREEMENT") for n in notes):
        explained = False
    watchdog = next((s for s in sources if s["source"] == "stragglerwatch watchdog"), None)
    return {
        "culprit_ranks": decided["culprit_ranks"],
        "collective": decided.get("collective") or next((s["collective"] for s in sources if s.get("collective")),
                                                          None),
        "step": watchdog.get("step") if watchdog else None,
        "phase": watchdog.get("phase") if watchdog else None,
        "decided_by": decided["source"],
        "agreement": "all agree" if not notes or all("same collective" in n for n in notes) else
                     "differences explained" if explained else "disagreement",
        "agreeing": agree,
        "evidence": [{k: s[k] for k in ("source", "culprit_ranks", "collective", "basis", "says")} for s in sources],
        "notes": notes,
    }  # fmt: skip
