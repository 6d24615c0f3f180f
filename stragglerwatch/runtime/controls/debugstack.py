"""Starting stragglerwatch's debug server: worker servers on every rank, torch's frontend on rank 0.

Design: torch's own ``start_debug_server`` binds the workers on ``::`` and the frontend on all
interfaces. :func:`start` (opt-in: ``attach(debug_server_port=...)``) binds both to a configured host,
loopback by default: each rank starts torch's ``_WorkerServer`` on that host and publishes its URL in the
job's TCPStore under torch's key layout (``debug_server/rank<r>``); rank 0 runs torch's
``FrontendServer`` in a fresh Python process (not a fork of the training process) whose server class
binds that host, with our page (``debugserver.handler``) and torch's own pages. A worker server the user
already started with ``start_debug_server`` is reused. Everything runs on a thread of its own and never
raises into training: a failure is one line in the ``stragglerwatch`` logger and a counter.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stragglerwatch.record.rundir import write_json_atomic
from stragglerwatch.runtime.controls.controlspec import DEBUG_SERVER_FILE, ControlSurface
from stragglerwatch.runtime.controls.debugserver import (
    READY_TIMEOUT_S,
    _env_address,
    _store,
    handler,
    missing,
    register,
)
from stragglerwatch.runtime.hangs.peers import default_store_address
from stragglerwatch.runtime.log import LOGGER, Problems

# -- the stack: worker servers on every rank, the frontend process on rank 0 ------------------------------------


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _store_address() -> tuple[str, int] | None:
    """The job's TCPStore: torchrun's MASTER_ADDR/MASTER_PORT, else the default process group's store."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        try:
            return _env_address()
        except ValueError:
            pass
    return default_store_address()


class DebugServer:
    """This rank's part of the debug server: its worker server, and on rank 0 the frontend process.
    Started on a thread of its own (the store and the frontend take seconds); never raises."""

    def __init__(self, controls: ControlSurface, port: int | None, host: str = "127.0.0.1", *,
                 handlers: Sequence[Any] = (), fetch_timeout_s: float = 5.0, torch_pages: bool = True,
                 problems: Problems | None = None):  # fmt: skip
        info = controls._watch.info
        self.rank = info.rank if info is not None else int(os.environ.get("RANK", 0))
        self.world_size = info.world_size if info is not None else int(os.environ.get("WORLD_SIZE", 1))
        self.run_dir = info.run_dir if info is not None else None
        self.port, self.host = port, host
        self.handlers = list(handlers)
        self.fetch_timeout_s = fetch_timeout_s
        self.torch_pages = torch_pages
        self.problems = problems or controls.problems
        self.errors = 0
        self.worker: Any = None
        self.worker_url: str | None = None
        self.frontend_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._start, name=f"stragglerwatch-debugserver-{self.rank}",
                                        daemon=True)  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Block until the start-up is over (done or failed); False after ``timeout_s``."""
        return self._ready.wait(timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"host": self.host, "worker_url": self.worker_url, "frontend_url": self.frontend_url,
                "errors": self.errors}  # fmt: skip

    def _fail(self, message: str) -> None:
        self.errors += 1
        self.problems.report("debug-server", f"debug server: {message}; training goes on")

    def _start(self) -> None:
        try:
            if self._start_worker() and self.rank == 0 and self.port is not None:
                self._start_frontend()
        except Exception as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()

    def _start_worker(self) -> bool:
        reason = missing()
        if reason:
            self._fail(reason)
            return False
        theirs = getattr(sys.modules.get("torch.distributed.debug"), "_WORKER_SERVER", None)
        if theirs is not None:  # the user's start_debug_server: it serves our handler too
            self.worker_url = f"http://{socket.gethostname()}:{theirs.port}"
            return True
        address = _store_address()
        if address is None:
            self._fail("no TCPStore to publish in (run under torchrun, or attach after init_process_group)")
            return False
        from torch._C._distributed_c10d import _WorkerServer

        with self._lock:
            if self._closed:
                return False
            self.worker = _WorkerServer(self.host, 0)
        url = f"http://{_url_host(self.host)}:{self.worker.port}"
        _store(address, self.fetch_timeout_s).set(f"rank{self.rank}", url)
        self.worker_url = url
        return True

    def _start_frontend(self) -> None:
        reason = missing(frontend=True)
        if reason:
            self._fail(reason)
            return
        address = _store_address()
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join([package_root, *[p for p in sys.path if p and os.path.isdir(p)]])
        if address is None:
            self._fail("no TCPStore for the frontend to find the ranks in")
            return
        env = {**os.environ, "MASTER_ADDR": address[0], "MASTER_PORT": str(address[1]),
               "WORLD_SIZE": str(self.world_size), "RANK": "0", "PYTHONPATH": path}  # fmt: skip
        extra = base64.b64encode(pickle.dumps(self.handlers)).decode() if self.handlers else None
        header = {"host": self.host, "port": self.port, "fetch_timeout": self.fetch_timeout_s,
                  "torch_pages": self.torch_pages, "extra": extra}  # fmt: skip
        code = "from stragglerwatch.runtime.controls.debugstack import _frontend_main; _frontend_main()"
        with self._lock:
            if self._closed:
                return
            self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          env=env, close_fds=True)  # fmt: skip
        proc = self._proc
        proc.stdin.write((json.dumps(header) + "\n").encode())  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        answer = self._read_answer(proc)
        if not answer.get("ok"):
            self._fail(str(answer.get("error") or "the frontend did not start"))
            self._stop_frontend()
            return
        self.frontend_url = f"http://{_url_host(self.host)}:{answer['port']}/stragglerwatch"
        if answer.get("note"):
            LOGGER.info("stragglerwatch: debug server: %s", answer["note"])
        if self.run_dir is not None:
            try:
                write_json_atomic(self.run_dir / DEBUG_SERVER_FILE, {"url": self.frontend_url, "host": self.host,
                                  "port": answer["port"], "pid": proc.pid, "started": time.time()})  # fmt: skip
            except OSError:
                pass
        LOGGER.info("stragglerwatch: debug server: %s (bound to %s)", self.frontend_url, self.host)

    def _read_answer(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        """The frontend process's first line (``{"ok": ..., "port": ...}``), waiting at most
        ``READY_TIMEOUT_S`` and no longer than a ``close()``."""
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        deadline, data = time.monotonic() + READY_TIMEOUT_S, b""
        while b"\n" not in data:
            if self._closed:
                return {"ok": False, "error": "closed while starting"}
            if time.monotonic() > deadline:
                return {"ok": False, "error": f"the frontend did not answer within {READY_TIMEOUT_S:.0f} s"}
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return {"ok": False, "error": f"the frontend process ended (status {proc.wait(5)})"}
                data += chunk
        try:
            return json.loads(data.split(b"\n", 1)[0])
        except ValueError:
            return {"ok": False, "error": f"the frontend process said {data[:200]!r}"}

    def _stop_frontend(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def close(self) -> None:
        """Stop the frontend process and the worker server (``Watch.close``)."""
        with self._lock:
            self._closed = True
        self._stop_frontend()
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown()
        if self.frontend_url and self.run_dir is not None:
            try:
                (self.run_dir / DEBUG_SERVER_FILE).unlink()
            except OSError:
                pass


def start(watch: Any, port: int | None = None, host: str = "127.0.0.1", *, handlers: Sequence[Any] = (),
          fetch_timeout_s: float = 5.0, torch_pages: bool = True) -> DebugServer | None:  # fmt: skip
    """Serve ``watch``'s rank (a ``Watch`` or its ``Controls``) in a debug server: a worker server on
    every rank (bound to ``host``, published in the job's store), and on rank 0, when ``port`` is given,
    torch's frontend with the ``/stragglerwatch`` page, bound to ``host:port`` (0: an ephemeral port),
    with torch's own pages when they can load (``torch_pages``) and ``handlers`` (more ``DebugHandler``
    plugins, picklable). Starts in the background; ``Watch.close()`` stops it. Never raises."""
    controls = watch.controls if hasattr(watch, "controls") else watch
    if controls.debug_server is not None:
        controls.problems.report("debug-server", "debug server: already started for this watch")
        return controls.debug_server
    register(controls)
    server = DebugServer(controls, port, host, handlers=handlers, fetch_timeout_s=fetch_timeout_s,
                         torch_pages=torch_pages)  # fmt: skip
    controls.debug_server = server
    server.start()
    return server


# -- the frontend process ---------------------------------------------------------------------------------------


def _answer(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _watch_parent() -> None:
    """End this process when the training process is gone (its pipe closes, or we are re-parented)."""
    parent = os.getppid()

    def stdin_closed() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        os._exit(0)

    def reparented() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=stdin_closed, daemon=True).start()
    threading.Thread(target=reparented, daemon=True).start()


def _frontend_main() -> None:
    """Rank 0's frontend process: torch's ``FrontendServer`` with our page, bound to the configured host."""
    header = json.loads(sys.stdin.readline())
    host, port = str(header["host"]), int(header["port"])
    try:
        from http.server import ThreadingHTTPServer

        from torch.distributed.debug import _frontend
    except Exception as exc:
        _answer(ok=False, error=f"cannot load torch's debug server frontend ({type(exc).__name__}: {exc})")
        return

    class BoundServer(ThreadingHTTPServer):
        """torch's frontend server class, bound to ``host`` instead of every interface."""

        daemon_threads = True
        request_queue_size = 1024

        def __init__(self, address: Any, handler_class: Any, bind_and_activate: bool = True):
            self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            super().__init__((host, address[1]), handler_class, bind_and_activate)

    _frontend._IPv6HTTPServer = BoundServer  # type: ignore[attr-defined,misc]
    note = None
    handlers: list[Any] = []
    if header.get("torch_pages", True):
        try:
            from torch.distributed.debug._debug_handlers import default_handlers

            handlers = default_handlers()
        except Exception as exc:
            note = f"torch's own pages are not served ({type(exc).__name__}: {exc})"
    handlers.append(handler(index=not handlers))
    if header.get("extra"):
        handlers += pickle.loads(base64.b64decode(header["extra"]))
    for h in handlers:
        h.fetch_timeout = float(header.get("fetch_timeout") or 5.0)
    try:
        server = _frontend.FrontendServer(port=port, handlers=handlers)
    except OSError as exc:
        _answer(ok=False, error=f"cannot listen on {host}:{port} ({exc.strerror or exc})")
        return
    except Exception as exc:
        _answer(ok=False, error=f"{type(exc).__name__}: {exc}")
        return
    _answer(ok=True, port=server._server.server_port, note=note)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nobody reads our stdout any more
    _watch_parent()
    server.join()
