"""stragglerwatch in PyTorch's debug server: every rank's live state and runtime controls on one page.

Design: recent torch releases (2.13 here) ship a debug server, ``torch.distributed.debug``. Each rank
runs a C++ worker server (``_WorkerServer``) that answers ``POST /handler/<name>`` with the handlers
registered in its process (``_register_handler``) and publishes its URL in the job's TCPStore under
``debug_server/rank<r>``; rank 0 runs an HTTP frontend (``FrontendServer``, in a child process) whose
pages are ``DebugHandler`` plugins that fan out to every rank's worker. We add:

- the worker handler ``stragglerwatch`` (:func:`register`; ``attach`` does it when the debug server
  is asked for, or torch's own already runs; it opens no port): this rank's ``Controls.state()`` as
  JSON; the request parameters ``recording``, ``watchdog_timeout_s`` and ``flush_interval_s`` change
  it (``rank=R``: only on rank R), and the answer carries the result or the errors (:func:`handle`);
- the frontend plugin (:func:`handler`, a ``DebugHandler``): the page ``/stragglerwatch`` (a table of all
  ranks, the job's verdict: the hang classification of ``hangs.classify`` over the ranks' live states
  when one is stalled, and the ranks of highest busy share (busy over step time); a form to change a
  setting on all ranks or one) and ``/stragglerwatch.json``. It fans out itself (stdlib ``urllib``,
  bounded timeouts, the store keys above), so it needs neither requests nor aiohttp: only jinja2, which
  torch requires anyway;
- starting the whole stack, opt-in and bound to loopback unless told otherwise, is ``debugstack.py``.

Every use of torch's internals is in this module, imported late and guarded: with a torch that lacks
them, one line says so, and the run dir's control file (``control.py``) still works. Nothing here
raises into training: a failure is one line in the ``stragglerwatch`` logger and a counter. The
frontend's pages are plain GETs (torch's frontend serves nothing else): like torch's own debug server,
it is meant for a trusted network, hence loopback by default.
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from stragglerwatch.analysis.hangs import classify
from stragglerwatch.runtime.controls.controlspec import CONTROL_KEYS, ControlSurface, clean, parse_settings, show

HANDLER = "stragglerwatch"  # the worker handler's name: /handler/stragglerwatch
STORE_PREFIX = "debug_server"  # torch's key layout: debug_server/rank<r> = the rank's worker URL
PARAMS = (*CONTROL_KEYS, "rank")
READY_TIMEOUT_S = 60.0  # the frontend process imports torch before it answers

_ACTIVE: list[weakref.ref[ControlSurface]] = []  # the open watches of this process; the latest answers
_REGISTERED = False
_LOCK = threading.Lock()
_HANDLER_CLASS: type | None = None


# -- what this torch has ----------------------------------------------------------------------------------


def missing(frontend: bool = False) -> str | None:
    """Why this torch cannot serve (the worker side; with ``frontend``, rank 0's page too), or None."""
    import torch

    version = torch.__version__
    try:
        from torch._C._distributed_c10d import _register_handler, _WorkerServer  # noqa: F401
    except ImportError:
        return (f"this torch ({version}) has no debug server; use the run dir's control file instead: "
                "stragglerwatch control RUN_DIR --set KEY=VALUE")  # fmt: skip
    if frontend:
        import importlib.util

        import torch.distributed

        if not (Path(torch.distributed.__file__).parent / "debug" / "_frontend.py").is_file():
            return f"this torch ({version}) has no debug server frontend (torch.distributed.debug._frontend)"
        if importlib.util.find_spec("jinja2") is None:
            return "the debug server's frontend needs jinja2: pip install jinja2"
    return None


# -- the worker side: this rank's handler -------------------------------------------------------------------


def register(controls: ControlSurface) -> bool:
    """Make ``controls`` the one this process's ``stragglerwatch`` worker handler answers for, and
    register the handler (once per process). False when this torch has no debug server."""
    global _REGISTERED
    with _LOCK:
        _ACTIVE[:] = [r for r in _ACTIVE if r() is not None and r() is not controls]
        _ACTIVE.append(weakref.ref(controls))
        if _REGISTERED:
            return True
        try:
            from torch._C._distributed_c10d import _register_handler
        except ImportError:
            return False
        try:
            _register_handler(HANDLER, _serve)
            _keep_forever(_serve)
        except ValueError:  # "already registered": by an earlier copy of this module
            pass
        _REGISTERED = True
        return True


def _keep_forever(handler: Any) -> None:
    """torch's handler registry is a C++ static that drops its references after the interpreter has
    finalized; a handler freed then ends the process with "Fatal Python error: PyThreadState_Get"
    (seen at the exit of a pytest session). One reference, never released, keeps it from being freed:
    the registry holds it for the life of the process anyway."""
    try:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handler))
    except Exception:
        pass


def unregister(controls: ControlSurface) -> None:
    with _LOCK:
        _ACTIVE[:] = [r for r in _ACTIVE if r() is not None and r() is not controls]


def _active() -> ControlSurface | None:
    with _LOCK:
        live = [c for c in (r() for r in _ACTIVE) if c is not None and c.watched]
    return live[-1] if live else None


def handle(params: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """A worker request: the HTTP status and the JSON body. ``params``: the request's parameters
    (``""``: not given). Changes apply when ``rank`` is empty, ``all`` or this rank."""
    controls = _active()
    if controls is None:
        return 503, {"error": "no watched model in this process (attach not called yet, or closed)"}
    rank = controls.rank
    changes = {k: params[k] for k in CONTROL_KEYS if params.get(k, "") != ""}
    target = (params.get("rank") or "").strip().lower()
    result = None
    if changes:
        if target in ("", "all"):
            result = controls.apply(changes, source="debug server")
        elif not target.isdigit():
            result = {"applied": {}, "errors": [f"rank must be a rank number or 'all', not {target!r}"]}
        elif int(target) == rank:
            result = controls.apply(changes, source="debug server")
    return 200, {"rank": rank, "result": result, "state": controls.state()}


def _serve(req: Any, resp: Any) -> None:
    """The ``stragglerwatch`` handler, called by the rank's worker server (a C++ thread)."""
    try:
        status, body = handle({k: req.get_param(k) for k in PARAMS})
        text = json.dumps(clean(body))
    except Exception as exc:
        status, text = 500, json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    resp.set_content(text, "application/json")
    resp.set_status(status)


# -- the job's view: every rank's state, fetched from their worker servers ------------------------------------


def _store(address: tuple[str, int], timeout_s: float) -> Any:
    """A client of the job's TCPStore with torch's debug-server prefix (our own connection, short timeout)."""
    import torch.distributed as dist

    host, port = address
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(STORE_PREFIX, store)


def _env_address() -> tuple[str, int]:
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def worker_urls(world_size: int, timeout_s: float = 5.0) -> list[str | None]:
    """Each rank's worker URL from the store (None where a rank has published none)."""
    store = _store(_env_address(), timeout_s)
    keys = [f"rank{r}" for r in range(world_size)]
    if store.check(keys):
        return [v.decode() for v in store.multi_get(keys)]
    return [store.get(k).decode() if store.check([k]) else None for k in keys]


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy


def _fetch_one(rank: int, url: str | None, query: str, timeout_s: float) -> dict[str, Any]:
    if url is None:
        return {"rank": rank, "url": None, "error": "no worker server published in the store"}
    request = urllib.request.Request(f"{url}/handler/{HANDLER}?{query}", data=b"", method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as f:
            body = json.loads(f.read())
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read()).get("error") or str(exc)
        except Exception:
            error = f"HTTP {exc.code} (no stragglerwatch handler in this rank's process?)"
        return {"rank": rank, "url": url, "error": error}
    except Exception as exc:  # refused, timed out (a rank holding the GIL cannot answer), garbage
        reason = getattr(exc, "reason", exc)
        return {"rank": rank, "url": url, "error": f"no answer: {type(reason).__name__}: {reason}"}
    if not isinstance(body, dict):
        return {"rank": rank, "url": url, "error": "not a stragglerwatch answer"}
    return {**body, "rank": rank, "url": url}


def job_view(params: Mapping[str, str] | None = None, timeout_s: float = 5.0,
             world_size: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Every rank's state (after applying ``params`` where addressed) and the job's verdict."""
    world = world_size or int(os.environ["WORLD_SIZE"])
    urls = worker_urls(world, timeout_s)
    query = urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v not in ("", None)})
    with ThreadPoolExecutor(max_workers=max(1, min(32, world))) as pool:
        ranks = list(pool.map(lambda r: _fetch_one(r, urls[r], query, timeout_s), range(world)))
    states = {r["rank"]: r.get("state") for r in ranks}
    return clean({"time": time.time(), "world_size": world, "request": dict(params or {}) or None,
                  "verdict": verdict(states, world), "ranks": ranks})  # fmt: skip


def _busy_share(state: Mapping[str, Any]) -> float | None:
    x = (state.get("recent") or {}).get("busy_share_median")
    if x is None:
        x = (state.get("latest") or {}).get("busy_share")
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def verdict(states: Mapping[int, Mapping[str, Any] | None], world_size: int) -> dict[str, Any]:
    """The job now, from the ranks' live states (None: no answer): which ranks are stalled and, when
    one is, ``hang``: ``hangs.classify`` over every rank's step, phase and collectives issued (a rank
    that does not answer is silent); ``slowest``: the ranks of highest busy share (median of their
    recent steps' busy over step time), against the median of all. Pure."""
    alive = {int(r): s for r, s in states.items() if s}
    unreachable = sorted(r for r in range(world_size) if not alive.get(r))
    stalled = sorted(r for r, s in alive.items() if (s.get("stall") or {}).get("stalled"))
    hang = None
    if stalled:
        published = {r: {"step": int(s.get("step") or 0), "phase": s.get("phase"), "collectives": s.get("collectives")}
                     for r, s in alive.items()}  # fmt: skip
        hang = classify({r: published.get(r) for r in range(world_size)}, world_size)
    ratios = {r: x for r, s in alive.items() if (x := _busy_share(s)) is not None}
    median = statistics.median(ratios.values()) if ratios else None
    order = sorted(ratios, key=lambda r: (-ratios[r], r))
    slowest = [{"rank": r, "busy_share": ratios[r], "vs_median": ratios[r] / median if median else None}
               for r in order[:3]]  # fmt: skip
    lines = []
    if hang is not None:
        mismatch = "; a collective the others never issue?" if hang.get("mismatch_suspected") else ""
        lines.append(f"stalled: rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}; hang: culprit "
                     f"{hang['culprit_ranks']}, victims {hang['victim_ranks']} at step {hang['step']} "
                     f"({hang['phase']}; by {hang['basis']}){mismatch}")  # fmt: skip
    else:
        lines.append("no rank is stalled")
    if slowest and median:
        top = slowest[0]
        lines.append(f"highest busy share: rank {top['rank']} {top['busy_share']:.2f} "
                     f"({top['vs_median']:.2f}x the median {median:.2f})")  # fmt: skip
    if unreachable:
        lines.append(f"no answer from rank{'s' if len(unreachable) > 1 else ''} {', '.join(map(str, unreachable))}")
    return {"stalled_ranks": stalled, "unreachable_ranks": unreachable, "hang": hang, "slowest": slowest,
            "busy_share_median": median, "summary": lines}  # fmt: skip


# -- the frontend plugin ----------------------------------------------------------------------------------------

PAGE_TEMPLATE = """
{% extends "base.html" %}
{% block header %}<h1>{% block title %}stragglerwatch{% endblock %}</h1>{% endblock %}
{% block content %}{{ content | safe }}{% endblock %}
"""
_STYLE = ("<style>table.sw{border-collapse:collapse;font-size:.9rem}table.sw td,table.sw th{border:1px solid #ccc;"
          "padding:2px 6px;text-align:right}.bad{color:#b00020;font-weight:600}.ok{color:#1b5e20}</style>")  # fmt: skip


def request_params(query: Mapping[str, Sequence[str]]) -> tuple[dict[str, str], str | None]:
    """A page's query (``setting=K&value=V&rank=R``, or ``K=V``...) as worker parameters, or a one-line
    error (then nothing is changed)."""
    first = {k: (v[0] if v else "") for k, v in query.items()}
    changes = {k: first[k] for k in CONTROL_KEYS if first.get(k, "") != ""}
    if first.get("setting"):
        changes[first["setting"]] = first.get("value", "")
    if not changes:
        return {}, None
    _, errors = parse_settings(changes)
    rank = first.get("rank", "").strip().lower()
    if rank not in ("", "all") and not rank.isdigit():
        errors.append(f"rank must be a rank number or 'all', not {rank!r}")
    if errors:
        return {}, "; ".join(errors)
    return {**changes, "rank": rank or "all"}, None


def _cell(value: Any, fmt: str = "{}") -> str:
    if value is None:
        return "&ndash;"
    return html.escape(fmt.format(value))


def _ms(value: Any) -> str:
    return _cell(value * 1000 if isinstance(value, (int, float)) else None, "{:.1f}")


def render_page(view: Mapping[str, Any], error: str | None = None) -> str:
    """The body of ``/stragglerwatch`` (every value escaped)."""
    out = [_STYLE]
    if error:
        out.append(f"<p class='bad'>not changed: {html.escape(error)}</p>")
    request = view.get("request")
    if request:
        changes = ", ".join(f"{k}={v}" for k, v in request.items() if k != "rank")
        done = [r["rank"] for r in view["ranks"] if (r.get("result") or {}).get("applied")]
        out.append(f"<p>change {html.escape(changes)} (rank {html.escape(str(request.get('rank', 'all')))}): "
                   f"<span class='ok'>applied on rank{'s' if len(done) != 1 else ''} "
                   f"{html.escape(', '.join(map(str, done)) or 'none')}</span></p>")  # fmt: skip
        for r in view["ranks"]:
            errors = (r.get("result") or {}).get("errors")
            if errors:
                out.append(f"<p class='bad'>rank {r['rank']}: {html.escape('; '.join(errors))}</p>")
        out.append("<p><a href='/stragglerwatch'>back to the live view</a></p>")
    v = view["verdict"]
    out.append("<h2>Job</h2><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in v["summary"]) + "</ul>")
    head = ("rank", "host", "step", "phase", "in phase (s)", "last step (ms)", "busy (ms)", "busy share",
            "busy share, recent", "stalled", "latest stall", "recording", "watchdog (s)", "flush (s)",
            "steps written", "problems")  # fmt: skip
    out.append("<h2>Ranks</h2><table class='sw'><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    for r in view["ranks"]:
        s = r.get("state")
        if not s:
            out.append(f"<tr><td>{r['rank']}</td><td colspan='{len(head) - 1}' class='bad' style='text-align:left'>"
                       f"{html.escape(str(r.get('error') or 'no answer'))}</td></tr>")  # fmt: skip
            continue
        latest, recent, stall, st = s.get("latest") or {}, s.get("recent") or {}, s.get("stall") or {}, s["settings"]
        last = stall.get("latest")
        if last:
            diag = last.get("diagnosis") or {}
            text = f"step {last.get('step')} {last.get('phase')}, {last.get('waited_s')} s"
            if diag:
                text += f"; culprit {diag.get('culprit_ranks')}, victims {diag.get('victim_ranks')}"
            text += "; recovered" if last.get("recovered") else ""
        else:
            text = None
        mode = st.get("watchdog_timeout_s")
        threshold = st.get("watchdog_threshold_s")
        watchdog = ("off" if st.get("watchdog", "").startswith("off")
                    else f"{'auto' if mode is None else mode} &rarr; {_cell(threshold)}")  # fmt: skip
        recording = show("recording", st.get("recording"))
        if st.get("recording") != st.get("recording_now"):
            recording += " (at the next step end)"
        problems = sum((s.get("stats") or {}).get("problems", {}).values())
        cells = [
            _cell(r["rank"]), _cell(s.get("host")), _cell(s.get("step")), _cell(s.get("phase")),
            _cell(s.get("phase_s"), "{:.1f}"), _ms(latest.get("step_s")), _ms(latest.get("busy_s")),
            _cell(latest.get("busy_share"), "{:.2f}"), _cell(recent.get("busy_share_median"), "{:.2f}"),
            "<span class='bad'>yes</span>" if stall.get("stalled") else "no", _cell(text), _cell(recording),
            watchdog, _cell(st.get("flush_interval_s")), _cell((s.get("stats") or {}).get("steps_written")),
            _cell(problems),
        ]  # fmt: skip
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    options = "".join(f"<option value='{k}'>{k}</option>" for k in CONTROL_KEYS)
    ranks = "<option value='all'>all ranks</option>" + "".join(
        f"<option value='{r}'>rank {r}</option>" for r in range(int(view.get("world_size") or 0))
    )
    out.append(
        "<h2>Change a setting</h2><form action='/stragglerwatch' method='get'>"
        f"<select name='setting'>{options}</select> <input name='value' size='8' placeholder='value'> on "
        f"<select name='rank'>{ranks}</select> <input type='submit' value='apply'></form>"
        "<p>recording: on or off (from the next step end); watchdog_timeout_s: seconds, or auto (adaptive); "
        "flush_interval_s: seconds. <a href='/stragglerwatch.json'>JSON</a></p>"
    )
    return "".join(out)


def _handler_class() -> type:
    """The ``DebugHandler`` subclass, made on first use: defining it imports torch's frontend, which only
    rank 0's frontend process (or a user of :func:`handler`) needs."""
    global _HANDLER_CLASS
    if _HANDLER_CLASS is not None:
        return _HANDLER_CLASS
    from torch.distributed.debug._frontend import DebugHandler, NavLink, Route

    class StragglerwatchHandler(DebugHandler):
        """``/stragglerwatch`` (the page) and ``/stragglerwatch.json`` in torch's debug server frontend."""

        def __init__(self, index: bool = False):
            self.index = index  # also serve the page at "/" (when torch's own pages are not there)

        def routes(self) -> list[Any]:
            routes = [Route("/stragglerwatch", self._page), Route("/stragglerwatch.json", self._json)]
            return routes + ([Route("/", self._page)] if self.index else [])

        def nav_links(self) -> list[Any]:
            return [NavLink("/stragglerwatch", "stragglerwatch"), NavLink("/stragglerwatch.json", "(JSON)")]

        def templates(self) -> dict[str, str]:
            return {"stragglerwatch.html": PAGE_TEMPLATE}

        def _view(self, req: Any) -> tuple[dict[str, Any] | None, str | None]:
            params, error = request_params(req.get_query())
            try:
                return job_view(params, self.fetch_timeout), error
            except Exception as exc:  # the store does not answer, no WORLD_SIZE...
                return None, f"cannot reach the ranks: {type(exc).__name__}: {exc}"

        def _page(self, req: Any) -> bytes:
            view, error = self._view(req)
            try:
                content = render_page(view, error) if view is not None else f"<p>{html.escape(str(error))}</p>"
            except Exception as exc:
                content = f"<p>stragglerwatch: cannot show the ranks: {html.escape(f'{type(exc).__name__}: {exc}')}</p>"
            return req.frontend.render_template("stragglerwatch.html", content=content)

        def _json(self, req: Any) -> bytes:
            view, error = self._view(req)
            body = view if view is not None else {"error": error}
            if view is not None and error:
                body = {**view, "error": error}
            return json.dumps(body, indent=1).encode()

        def dump(self) -> str | None:
            return json.dumps(job_view(None, self.fetch_timeout), indent=1)

        def dump_filename(self) -> str:
            return "stragglerwatch"

    StragglerwatchHandler.__module__ = __name__  # picklable by name (torch's "spawn" start method)
    StragglerwatchHandler.__qualname__ = "StragglerwatchHandler"
    _HANDLER_CLASS = StragglerwatchHandler
    return StragglerwatchHandler


def __getattr__(name: str) -> Any:
    if name == "StragglerwatchHandler":
        return _handler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def handler(index: bool = False) -> Any:
    """The frontend plugin, for a debug server you start yourself::

        torch.distributed.debug.start_debug_server(
            handlers=[*default_handlers(), stragglerwatch.runtime.controls.debugserver.handler()])

    on every rank after ``attach`` (whose worker handler answers it). ``index``: also at ``/``."""
    return _handler_class()(index=index)
