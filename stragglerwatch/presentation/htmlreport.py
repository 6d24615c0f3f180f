"""Self-contained HTML report: verdict, verdict table, the load imbalance where work per step was
recorded, and the figures of ``figures.py`` (plotly.js inlined once, so the file opens offline)."""

from __future__ import annotations

import html
from typing import Any

from stragglerwatch._extras import require

# plotly is the extra ``dashboard``'s: without it, one clear line instead of a traceback
require("the HTML report (analyze --format html)", "plotly")

from stragglerwatch.analysis.report import Analysis  # noqa: E402
from stragglerwatch.presentation import figures  # noqa: E402
from stragglerwatch.presentation.ctxfigure import context_figure  # noqa: E402
from stragglerwatch.presentation.hangrender import (  # noqa: E402
    action_line,
    flight_recorder_lines,
    hang_verdict_lines,
)
from stragglerwatch.presentation.render import (  # noqa: E402
    code_text,
    context_text,
    hang_line,
    verdict_lines,
    work_text,
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } .verdict { background: #fff4e5; border-left: 4px solid #ff7f0e; padding: .6em 1em; }
.verdict.ok { background: #eef7ee; border-color: #2ca02c; } .verdict p { margin: .3em 0; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: .25em .6em; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
"""


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key)
            num = isinstance(value, (int, float)) and not isinstance(value, bool)
            text = "still slow" if value is None and key == "last_step" else ("" if value is None else value)
            cells.append(f"<td class='num'>{text}</td>" if num else f"<td>{html.escape(str(text))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(analysis: Analysis) -> str:
    report, mat, verdict = analysis.report, analysis.matrix, analysis.verdict
    imbalance = report.get("imbalance")
    ok = not (report["stragglers"] or report["hangs"] or report["group_imbalance"] or report.get("busy_unavailable")
              or (imbalance and imbalance["detected"]) or report.get("actions"))  # fmt: skip
    verdict_html = "".join(f"<p>{html.escape(line)}</p>" for line in verdict_lines(report))
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>stragglerwatch: {html.escape(str(report.get('run_id')))}</title><style>{STYLE}</style></head><body>",
        f"<h1>stragglerwatch report: run {html.escape(str(report.get('run_id')))}</h1>",
        f"<p>{report['ranks_seen']} of {report['world_size']} ranks, {report['steps']} steps, "
        f"job slowdown S = {'unavailable' if report['job_slowdown'] is None else report['job_slowdown']}</p>",
        f"<div class='verdict{' ok' if ok else ''}'>{verdict_html}</div>",
    ]
    if report["stragglers"]:
        parts.append("<h2>Stragglers</h2>")
        parts.append(
            _table(
                [{**s, "why": context_text(s), "code": code_text(s), "try": "; ".join(s.get("hints") or []),
                  "cause": s["cause"] + (
                    f" ({s['where']})" if s.get("where") else "")} for s in report["stragglers"]],
                [
                    ("rank", "rank"),
                    ("host", "host"),
                    ("cause", "cause"),
                    ("slowdown", "slowdown (its flagged steps)"),
                    ("first_step", "since step"),
                    ("last_step", "until step"),
                    ("detected_step", "detected at"),
                    ("lost_seconds", "time lost (s)"),
                    ("lost_gpu_seconds", "GPU-s lost"),
                    ("saves_seconds", "fixing it saves (s)"),
                    ("why", "host and GPU context"),
                    ("code", "where in the code"),
                    ("try", "what to try"),
                ],
            )  # fmt: skip
        )
    if report["hangs"]:
        parts.append("<h2>Hangs</h2>")
        for h in report["hangs"]:
            parts.append(f"<p>{html.escape(hang_line(h))}</p>")
            for rank, stacks in (h.get("stacks") or {}).items():
                for thread, stack in stacks.items():
                    parts.append(f"<details><summary>rank {rank}: {html.escape(thread)}</summary>")
                    parts.append(f"<pre>{html.escape(stack)}</pre></details>")
    if report.get("actions"):
        parts.append("<h2>Actions of the policies</h2>")
        parts += [f"<p>{html.escape(action_line(a))}</p>" for a in report["actions"]]
    evidence = hang_verdict_lines(report) + flight_recorder_lines(report)
    if evidence:
        parts.append("<h2>Hang verdict and PyTorch's evidence</h2>")
        parts.append("<pre>" + html.escape("\n".join(evidence).strip("\n")) + "</pre>")
    if "attribution" in report:
        parts.append(f"<h2>What-if replay: S = {report['job_slowdown']} ({html.escape(report['whatif_verdict'])})</h2>")
        for key, cols in (("workers", [("rank", "rank"), ("dp_rank", "dp rank"), ("stage", "stage"),
                                       ("slowdown", "S with only its durations real")]),
                          ("stages", [("stage", "stage"), ("slowdown", "S with only its durations real")]),
                          ("optypes", [("optype", "op type"), ("slowdown", "S with only it real")])):  # fmt: skip
            parts.append(_table(report["attribution"][key], cols))
    if report["group_imbalance"]:
        parts.append("<h2>Group imbalance</h2>")
        parts.append(_table(report["group_imbalance"], [("group", "group"), ("slowdown", "busy vs other groups")]))
    arrived = (report.get("arrivals") or {}).get("ranks") or []
    if arrived:
        parts.append("<h2>Arrival order at the collectives</h2>")
        parts.append(_table(arrived, [("rank", "rank"), ("collectives_per_step", "compared a step"),
                                      ("last_share", "entered last"), ("wait_ms", "waited for later arrivals (ms)")]))
    if imbalance:
        parts += imbalance_html(imbalance)
    figs = [figures.heatmap(mat, verdict), figures.breakdown(mat, verdict, report["ranks"])]
    if report["stragglers"]:
        figs.append(figures.busy_band(mat, verdict))
        if analysis.context is not None:
            rank = report["stragglers"][0]["rank"]
            spans = [tuple(s["time_span"]) for s in report["stragglers"] if s["rank"] == rank and s["time_span"]]
            figs.append(context_figure(analysis.context, rank, spans))
    if figures.has_work(mat):
        unit = (imbalance or {}).get("unit") or None  # None: the unit of the column shown
        figs += [figures.work_heatmap(mat, unit, verdict), figures.busy_vs_work(mat, verdict, unit)]
    for i, fig in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False))
    parts.append("<h2>Per rank</h2>")
    parts.append(
        _table(
            report["ranks"][:1024],
            [
                ("rank", "rank"),
                ("host", "host"),
                ("role", "role"),
                ("steps", "steps"),
                ("step_ms", "step ms"),
                ("busy_ms", "busy ms"),
                ("data_wait_ms", "data"),
                ("forward_ms", "fwd"),
                ("backward_ms", "bwd"),
                ("allreduce_wait_ms", "all-reduce wait"),
                ("collective_wait_ms", "other collectives"),
                ("eval_ms", "eval"),
                ("optimizer_ms", "opt"),
                ("other_ms", "other"),
                ("busy_vs_peers", "busy vs peers (median step)"),
                *work_columns(report),
                ("flagged", "flagged"),
            ],
        )  # fmt: skip
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def work_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The per-rank table's columns of work, when any rank has them."""
    if not any(r.get("work") is not None or r.get("busy_per_work_us") is not None for r in report["ranks"]):
        return []
    unit = (report.get("imbalance") or {}).get("unit") or "units"
    return [("work", f"{unit}/step"), ("busy_per_work_us", f"busy µs/{unit.removesuffix('s') or unit}")]


def imbalance_html(imb: dict[str, Any]) -> list[str]:
    """The load imbalance section: detected or not, its cost, what work explains, the hints, the note."""
    unit = html.escape(imb["unit"])
    if not imb["detected"]:
        s = f" (S {imb['slowdown']:.2f}x)" if imb.get("slowdown") is not None else ""
        out = ["<h2>Load imbalance</h2>",
               f"<p>Work per step recorded ({unit}): no load imbalance worth reporting{s}.</p>"]  # fmt: skip
    else:
        rows = [("unit of work", imb["unit"]), ("steps with work on two ranks or more", imb["steps"]),
                ("time lost to unequal work (s)", imb.get("lost_seconds")),
                ("GPU-s lost", imb.get("lost_gpu_seconds")),
                ("job slowdown S from imbalance alone", imb.get("slowdown")),
                ("share of the spread of busy time across ranks that work explains",
                 None if imb.get("explained") is None else f"{imb['explained']:.0%}"),
                ("heaviest rank's work over the step's mean, median step",
                 None if imb.get("work_spread") is None else f"+{imb['work_spread']:.0%}"),
                ("busy µs one more unit costs a healthy rank",
                 None if imb.get("seconds_per_unit") is None else round(imb["seconds_per_unit"] * 1e6, 4)),
                ("ranks that drew the heaviest work most often", ", ".join(map(str, imb.get("heaviest_ranks") or [])))]
        out = ["<h2>Load imbalance</h2>",
               f"<p>Ranks got unequal {unit} in the same step: the heaviest batch holds the others up, a "
               "different rank each step. This is not a slow rank; the fix is in the data pipeline.</p>",
               _table([{"what": k, "value": v} for k, v in rows if v not in (None, "")],
                      [("what", ""), ("value", "")])]  # fmt: skip
        work = work_text(imb)
        if work:
            out.append(f"<p>{html.escape(work)}.</p>")
        hints = imb.get("hints") or []
        if hints:
            out.append("<p>Try:</p><ul>" + "".join(f"<li>{html.escape(h)}</li>" for h in hints) + "</ul>")
    if imb.get("note"):
        out.append(f"<p>Note: {html.escape(imb['note'])}</p>")
    return out
