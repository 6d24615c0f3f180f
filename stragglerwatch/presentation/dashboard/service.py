"""The dashboard as a long-running service (``gunicorn dashboard.app:server``): its configuration from
the environment, the runs under a root directory (a run picker), a source per run made on demand.

Design: nothing starts a thread when the app is made. A worker makes the source a request needs, and
starts it, at that request: gunicorn forks its workers after importing the app (``--preload``) or
before, and a thread does not survive a fork; a source a parent process did start is forgotten in
the child (``os.register_at_fork``). At most ``max_runs`` sources are kept (the least recently used
is stopped). A run named by a URL is one plain path component, resolved (symlinks included) and
kept only inside the root. No endpoint writes anything.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from stragglerwatch._memory import for_analysis
from stragglerwatch.analysis.live import window_problem
from stragglerwatch.presentation.dashboard.app import RunRefused, create_app, url_run
from stragglerwatch.presentation.dashboard.sources import PrometheusSource, RunDirSource

SOURCE_HELP = "a run dir, a directory of run dirs, or a Prometheus URL with its run (http://HOST:9090/?run=RUN_ID)"
#: A run's name: one plain path component (no separator, not hidden, not "." or "..").
RUN_NAME = re.compile(r"[A-Za-z0-9_+@=,-][A-Za-z0-9_.+@=,-]{0,127}")
#: What makes a directory a run dir rather than a directory of runs.
RUN_FILE = re.compile(r"(run\.json|(rank|context)-\d+(\.\d+)?\.(json|arrows|parquet)|events-.*\.jsonl)")


class ConfigError(ValueError):
    """A setting the service cannot use; the message is one line."""


def _number(env: Mapping[str, str], name: str, default: float, lo: float, hi: float, kind: type = int) -> Any:
    text = env.get(name, "").strip()
    if not text:
        return kind(default)
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: not {'an integer' if kind is int else 'a number'}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={text}: must be in {lo:g}..{hi:g}")
    return value


def _window(env: Mapping[str, str]) -> int:
    steps = _number(env, "STRAGGLERWATCH_WINDOW_STEPS", 0, 0, 10**9)
    problem = window_problem(steps) if steps else None
    if problem:
        raise ConfigError(f"STRAGGLERWATCH_WINDOW_STEPS={steps}: {problem} (0: every step)")
    return steps


@dataclass(frozen=True)
class ServiceConfig:
    source: str = ""  # STRAGGLERWATCH_SOURCE
    host: str = "127.0.0.1"  # STRAGGLERWATCH_HOST: loopback unless configured
    port: int = 8050  # STRAGGLERWATCH_PORT
    refresh_ms: int = 250  # STRAGGLERWATCH_REFRESH_MS: the page's refresh period
    poll_s: float = 0.25  # STRAGGLERWATCH_POLL_S: how often a source looks for new records
    max_runs: int = 8  # STRAGGLERWATCH_MAX_RUNS: sources kept at once in a worker
    workers: int = 1  # STRAGGLERWATCH_WORKERS: gunicorn's processes (each reads and analyses its runs)
    threads: int = 8  # STRAGGLERWATCH_THREADS: requests a worker serves at once
    window_steps: int = 0  # STRAGGLERWATCH_WINDOW_STEPS: a run dir's last steps followed (0: every step)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServiceConfig:
        env = os.environ if env is None else env
        return cls(
            source=env.get("STRAGGLERWATCH_SOURCE", "").strip(),
            host=env.get("STRAGGLERWATCH_HOST", "").strip() or "127.0.0.1",
            port=_number(env, "STRAGGLERWATCH_PORT", 8050, 0, 65535),
            refresh_ms=_number(env, "STRAGGLERWATCH_REFRESH_MS", 250, 200, 3_600_000),
            poll_s=_number(env, "STRAGGLERWATCH_POLL_S", 0.25, 0.1, 3600, float),
            max_runs=_number(env, "STRAGGLERWATCH_MAX_RUNS", 8, 1, 1000),
            workers=_number(env, "STRAGGLERWATCH_WORKERS", 1, 1, 64),
            threads=_number(env, "STRAGGLERWATCH_THREADS", 8, 1, 256),
            window_steps=_window(env),
        )

    @property
    def bind(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_prometheus(spec: str) -> tuple[str, str]:
    """``http://HOST:9090/?run=RUN_ID`` -> (the server's URL, the run)."""
    parts = urlsplit(spec)
    try:
        run = url_run(parts.query)
    except RunRefused as exc:
        raise ConfigError(f"STRAGGLERWATCH_SOURCE={spec}: {exc}") from None
    if not parts.netloc or not run:
        raise ConfigError(f"STRAGGLERWATCH_SOURCE={spec}: a Prometheus source is http(s)://HOST:PORT/?run=RUN_ID")
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", "")), run


def check_name(name: str) -> None:
    if not RUN_NAME.fullmatch(name):
        raise RunRefused(f"refused: {name[:60]!r} is not a run name (one plain path component)", 400)


def run_path(root: Path, name: str) -> Path:
    """``root/name``, symlinks resolved, if ``name`` is one plain path component and that is a directory
    inside ``root``; :class:`RunRefused` otherwise (400 a bad name, 403 outside the root, 404 none)."""
    check_name(name)
    real_root = root.resolve()
    try:
        real = (real_root / name).resolve(strict=True)
    except (OSError, RuntimeError):
        raise RunRefused(f"no run {name} in {root}", 404) from None
    if real == real_root or not real.is_relative_to(real_root):
        raise RunRefused(f"refused: run {name} leads outside {root}", 403)
    if not real.is_dir():
        raise RunRefused(f"no run {name} in {root}", 404)
    return real


def is_run_dir(path: Path) -> bool:
    """A run dir (what a job writes), or a directory with no run in it yet (a job about to write)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return True
    if any(RUN_FILE.fullmatch(e.name) for e in entries):
        return True
    return not any(RUN_NAME.fullmatch(e.name) and e.is_dir() for e in entries)


class SourcePool:
    """At most ``size`` sources, made on demand by key and started; the least recently used stopped."""

    def __init__(self, size: int, make: Callable[[str], Any]):
        self.size, self.make = size, make
        self._forget()
        if hasattr(os, "register_at_fork"):  # a child process has none of its parent's threads
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._sources: OrderedDict[str, Any] = OrderedDict()

    def get(self, key: str) -> Any:
        with self._lock:
            source = self._sources.get(key)
            if source is not None:
                self._sources.move_to_end(key)
                return source
            source = self._sources[key] = self.make(key)
            evicted = [self._sources.popitem(last=False)[1] for _ in range(len(self._sources) - self.size)]
        for old in evicted:
            old.stop()
        return source.start()  # its first load, outside the lock: other runs' pages go on meanwhile


def _forget_in_child(ref: weakref.ref[SourcePool]) -> None:
    pool = ref()
    if pool is not None:
        pool._forget()


class Service:
    """The runs ``STRAGGLERWATCH_SOURCE`` names, each page's source, and the reason (if any) it has none."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.error: str | None = None  # a configuration that cannot work until it is changed
        self.root: Path | None = None
        self.prometheus: tuple[str, str] | None = None
        if not config.source:
            self.error = f"STRAGGLERWATCH_SOURCE is not set: give {SOURCE_HELP}"
        elif urlsplit(config.source).scheme in ("http", "https"):
            try:
                self.prometheus = parse_prometheus(config.source)
            except ConfigError as exc:
                self.error = str(exc)
        else:
            self.root = Path(config.source).expanduser().absolute()
        self.pool = SourcePool(config.max_runs, self._make)

    def problem(self) -> str | None:
        """Why no run can be shown now (checked again at each request: a root may appear later)."""
        if self.error or self.root is None or self.root.is_dir():
            return self.error
        return f"STRAGGLERWATCH_SOURCE={self.config.source}: no such directory"

    def multi(self) -> bool:
        """Whether the root is a directory of runs (with a run picker) rather than one run."""
        return self.root is not None and not self.problem() and not is_run_dir(self.root)

    def runs(self) -> list[str]:
        """The runs of a directory of runs, the most recently changed first; none otherwise."""
        if self.root is None or not self.multi():
            return []
        found = []
        for entry in os.scandir(self.root):
            try:
                found.append((run_path(self.root, entry.name).stat().st_mtime, entry.name))
            except (RunRefused, OSError):
                continue
        return [name for _, name in sorted(found, key=lambda t: (-t[0], t[1]))]

    def locate(self, run: str | None) -> str:
        """The pool key of the run a page names (None: the only run, or the newest); RunRefused if none."""
        problem = self.problem()
        if problem:
            raise RunRefused(problem, 503)
        if self.prometheus is not None:
            if run not in (None, self.prometheus[1]):
                raise RunRefused(f"no run {run[:60]!r} here: this service shows run {self.prometheus[1]}", 404)
            return ""
        assert self.root is not None
        if not self.multi():
            if run is not None and run != self.root.name:
                check_name(run)
                raise RunRefused(f"no run {run} here: this service shows {self.root}", 404)
            return ""
        if run is None:
            names = self.runs()
            if not names:
                raise RunRefused(f"no run yet in {self.root}", 404)
            run = names[0]
        run_path(self.root, run)
        return run

    def pick(self, run: str | None) -> Any:
        """The started source of the run a page names; RunRefused for one this service will not show."""
        return self.pool.get(self.locate(run))

    def _make(self, key: str) -> Any:
        if self.prometheus is not None:
            return PrometheusSource(*self.prometheus)
        assert self.root is not None
        path = run_path(self.root, key) if key else self.root
        return RunDirSource(path, interval_s=self.config.poll_s, window=self.config.window_steps or None)


def create_server(service: Service, title: str = "stragglerwatch") -> Any:
    """The Flask (WSGI) app of the service: the Dash app, a guard on the run a URL names, safe headers."""
    from flask import Response, redirect, request

    def extend(server: Any) -> None:
        server.config["MAX_CONTENT_LENGTH"] = 1 << 20  # a callback's request is a few kB

        @server.before_request
        def guard() -> Any:
            if request.path.startswith(("/_dash-", "/assets/", "/_favicon")):
                return None  # the callbacks check the run themselves
            try:
                run = url_run(request.query_string.decode("utf-8", "replace"))
            except RunRefused as exc:
                return Response(f"stragglerwatch: {exc}\n", exc.status, mimetype="text/plain")
            try:
                key = service.locate(run)
            except RunRefused as exc:
                if run is None or exc.status == 503:
                    return None  # no run yet, or a source to fix: the page says so, and follows when it appears
                return Response(f"stragglerwatch: {exc}\n", exc.status, mimetype="text/plain")
            if run is None and key and request.path == "/":  # a directory of runs: the newest one's page
                return redirect(f"?run={quote(key, safe='')}", 302)
            return None

        @server.after_request
        def headers(response: Any) -> Any:
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
            response.headers.setdefault("X-Frame-Options", "DENY")
            response.headers.setdefault("Referrer-Policy", "same-origin")
            return response

    app = create_app(service.pick, service.config.refresh_ms, title, runs=service.runs, extend=extend)
    return app.server


def server_from_env(env: Mapping[str, str] | None = None) -> Any:
    """The service's WSGI app as the environment configures it. A configuration that cannot work is one
    line on stderr, and the page says it (and follows once a missing root appears) instead of failing."""
    for_analysis()  # the process is ours: no stall on its memory (stragglerwatch/_memory.py)
    try:
        service = Service(ServiceConfig.from_env(env))
    except ConfigError as exc:
        service = Service(ServiceConfig())
        service.error = str(exc)
    problem = service.problem()
    if problem:
        print(f"stragglerwatch: error: {problem}", file=sys.stderr, flush=True)
    return create_server(service)


__all__ = ["ConfigError", "Service", "ServiceConfig", "create_server", "run_path", "server_from_env"]
