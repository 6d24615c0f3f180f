"""The ``stragglerwatch dashboard`` command: the live dashboard over a run dir or a Prometheus server,
in this process (:class:`DashboardServer` is also the demo's), and the one-line error when an optional
dependency it needs is missing (:func:`lacking`).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from stragglerwatch._extras import message, missing


class DashboardServer:
    """The Dash app of ``source`` served on ``host:port`` from a background thread."""

    def __init__(self, source: Any, host: str = "127.0.0.1", port: int = 8050, refresh_ms: int = 250):
        from werkzeug.serving import make_server  # dash's; imported here so the command line loads without it

        from stragglerwatch.presentation.dashboard import create_app

        self.source = source.start()
        self.app = create_app(source, refresh_ms=refresh_ms)
        self.server = make_server(host, port, self.app.server, threaded=True)  # OSError if the port is taken
        self.url = f"http://{host}:{self.server.server_port}/"
        self._thread = threading.Thread(target=self.server.serve_forever, name="stragglerwatch-dashboard", daemon=True)

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.source.stop()


def wait_forever(message: str) -> None:
    print(message, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)


def run_dashboard(args: Any) -> int:
    if lacking("stragglerwatch dashboard", "dash", "plotly"):
        return 2
    from stragglerwatch.presentation.dashboard import PrometheusSource, RunDirSource

    if args.prometheus:
        if not args.run:
            print("stragglerwatch: error: --prometheus needs --run RUN_ID", file=sys.stderr)
            return 2
        source: Any = PrometheusSource(args.prometheus, args.run)
    elif args.run_dir:
        if not Path(args.run_dir).is_dir():
            print(f"stragglerwatch: error: {args.run_dir}: not a directory", file=sys.stderr)
            return 2
        source = RunDirSource(args.run_dir, window=args.window)
    else:
        print("stragglerwatch: error: give a RUN_DIR, or --prometheus URL --run RUN_ID", file=sys.stderr)
        return 2
    try:
        server = DashboardServer(source, args.host, args.port, args.refresh_ms).start()
    except OSError as exc:
        print(f"stragglerwatch: error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    wait_forever(f"dashboard of {source.label}: {server.url}  (Ctrl-C to stop)")
    server.stop()
    return 0


def lacking(what: str, *modules: str) -> bool:
    """Print one error line and return True when an optional dependency ``what`` needs is missing."""
    absent = missing(*modules)
    if absent:
        print(f"stragglerwatch: error: {message(what, absent)}", file=sys.stderr)
    return bool(absent)
