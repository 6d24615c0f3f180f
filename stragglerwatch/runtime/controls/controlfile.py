"""The run dir's control file: runtime control that works with every torch version.

Design: ``stragglerwatch control RUN_DIR --set K=V [--rank R]`` appends a numbered request to
``control.json`` (versioned; the latest 50 kept; an advisory lock keeps two operators from losing one).
One rank per host, the relay (``noderelay.py``), looks at the file once per ``control_interval_s`` (one
``stat``) and copies it, when it changes, into a node-local directory where the host's other ranks look;
so the shared file system sees one ``stat`` per host per interval, not one per rank. Where no rank can
share that directory, each rank looks at the shared file itself (said once). Every rank applies the
requests that are new since it attached and addressed to it through the same
:meth:`Controls.apply <stragglerwatch.runtime.controls.control.Controls.apply>` the debug server uses, and
writes what it did to ``control-ack-NNNNN.json``, which ``stragglerwatch control RUN_DIR`` reads back.
Requests made before a rank attached are not applied to it (a restarted job does not replay old commands).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from stragglerwatch.record.rundir import read_run_meta, write_json_atomic
from stragglerwatch.runtime.controls.controlspec import (
    ACK_FILE,
    CONTROL_FILE,
    CONTROL_KEYS,
    DEBUG_SERVER_FILE,
    MAX_ACKS,
    MAX_REQUESTS,
    VERSION,
    ControlError,
    ControlSurface,
    clean,
    parse_settings,
)
from stragglerwatch.runtime.controls.noderelay import NodeRelay
from stragglerwatch.runtime.log import Problems

# -- the control file ---------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ControlError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def read_requests(run_dir: Path) -> list[dict[str, Any]]:
    """The requests of a run dir's control file, oldest first ([] when there is none)."""
    return requests_in(Path(run_dir) / CONTROL_FILE)


def requests_in(path: Path, text: str | bytes | None = None) -> list[dict[str, Any]]:
    """The requests of the control file at ``path`` (or of its ``text``, read from there), oldest first."""
    if text is None:
        data = _read_json(path)
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ControlError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if data is None:
        return []
    if not isinstance(data, dict) or data.get("schema") != "stragglerwatch-control":
        raise ControlError(f"{path}: not a stragglerwatch control file")
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ControlError(f"{path}: version {version!r}, newer than this stragglerwatch reads ({VERSION})")
    out = []
    for req in data.get("requests") or []:
        if (isinstance(req, dict) and isinstance(req.get("seq"), int) and isinstance(req.get("settings"), dict)
                and (req.get("rank") is None or isinstance(req.get("rank"), int))):  # fmt: skip
            out.append(req)
    return sorted(out, key=lambda r: r["seq"])


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """Two operators writing requests at once do not lose one (an advisory lock where there is one)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    with open(run_dir / ".control.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _world_size(run_dir: Path) -> int | None:
    meta = read_run_meta(run_dir)
    return int(meta["world_size"]) if meta else None


def write_request(run_dir: str | os.PathLike[str], settings: Mapping[str, str], rank: int | None = None) -> dict:
    """Append a request to the run dir's control file (validated first: :class:`ControlError`, one
    line); every rank addressed applies it within its ``control_interval_s``. Returns the request."""
    run = Path(run_dir)
    _, errors = parse_settings(settings)
    if errors:
        raise ControlError("; ".join(errors))
    world = _world_size(run)
    if world is None:
        raise ControlError(f"{run}: not a stragglerwatch run dir (no readable run.json)")
    if rank is not None and not 0 <= rank < world:
        raise ControlError(f"rank {rank} is not a rank of this run (world size {world})")
    with _locked(run):
        requests = read_requests(run)
        seq = max((r["seq"] for r in requests), default=0) + 1
        request = {"seq": seq, "rank": rank, "settings": {str(k): str(v) for k, v in settings.items()},
                   "issued_at": time.time(), "by": f"{socket.gethostname()}:{os.getpid()}"}  # fmt: skip
        requests = [*requests, request][-MAX_REQUESTS:]
        write_json_atomic(run / CONTROL_FILE, {"schema": "stragglerwatch-control", "version": VERSION,
                                               "requests": requests})  # fmt: skip
    return request


def read_acks(run_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """What each rank did with each request: ``{rank: {seq: ack}}`` (unreadable ack files skipped)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(run_dir).glob("control-ack-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            out[int(data["rank"])] = {int(a["seq"]): a for a in data.get("acks") or [] if isinstance(a, dict)}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def status(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The requests of a run dir, each with the ranks that applied it, refused it (and why) or have not
    answered yet; and the debug server's URL while rank 0 serves one."""
    run = Path(run_dir)
    world = _world_size(run)
    if world is None:
        raise ControlError(f"{run}: not a stragglerwatch run dir (no readable run.json)")
    acks = read_acks(run)
    out = []
    for req in read_requests(run):
        targets = [req["rank"]] if req.get("rank") is not None else list(range(world))
        answered = {r: acks[r][req["seq"]] for r in targets if req["seq"] in acks.get(r, {})}
        out.append({**req, "applied": sorted(r for r, a in answered.items() if not a.get("errors")),
                    "refused": {r: a["errors"] for r, a in sorted(answered.items()) if a.get("errors")},
                    "pending": [r for r in targets if r not in answered]})  # fmt: skip
    server = None
    with contextlib.suppress(ControlError):
        server = _read_json(run / DEBUG_SERVER_FILE)
    return {"world_size": world, "requests": out, "debug_server": server if isinstance(server, dict) else None}


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def render_status(st: dict[str, Any], now: float | None = None, last: int = 10) -> str:
    """The text ``stragglerwatch control RUN_DIR`` prints."""
    now = time.time() if now is None else now
    lines = []
    server = st.get("debug_server")
    if server and server.get("url"):
        lines.append(f"debug server: {server['url']} (rank 0's frontend)")
    requests = st["requests"]
    if not requests:
        lines.append("no control request yet: stragglerwatch control RUN_DIR --set watchdog_timeout_s=3 ...")
    for req in requests[-last:]:
        who = "all ranks" if req.get("rank") is None else f"rank {req['rank']}"
        ago = max(0.0, now - float(req.get("issued_at") or now))
        what = " ".join(f"{k}={v}" for k, v in req["settings"].items())
        lines.append(f"request {req['seq']} ({who}, {ago:.0f} s ago): {what}")
        if req["applied"]:
            lines.append(f"  applied by rank{'s' if len(req['applied']) > 1 else ''} {_ranks(req['applied'])}")
        for rank, errors in req["refused"].items():
            lines.append(f"  refused by rank {rank}: {'; '.join(errors)}")
        if req["pending"]:
            lines.append(f"  not answered (yet) by rank{'s' if len(req['pending']) > 1 else ''} "
                         f"{_ranks(req['pending'])}")  # fmt: skip
    return "\n".join(lines)


def command(run_dir: str, sets: list[str], rank: int | None, wait_s: float,
            out: Callable[[str], None] = print) -> int:  # fmt: skip
    """``stragglerwatch control``: write a request (``sets``: ``KEY=VALUE``) and wait up to ``wait_s``
    for the ranks to answer, or (no ``sets``) show the requests and who answered. Returns 0 when every
    rank addressed applied it (or ``wait_s`` is 0: not checked, and said), 1 when some refused it or did
    not answer. Raises :class:`ControlError` (one line) for a request that cannot be made, and when no
    rank addressed answered within ``wait_s`` (no job is running to control)."""
    if not sets:
        out(render_status(status(run_dir)))
        return 0
    settings: dict[str, str] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ControlError(f"--set takes KEY=VALUE, not {item!r} (keys: {', '.join(CONTROL_KEYS)})")
        settings[key.strip()] = value.strip()
    request = write_request(run_dir, settings, rank)
    wait_s = max(0.0, wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        st = status(run_dir)
        mine = next((r for r in st["requests"] if r["seq"] == request["seq"]), None)
        if mine is None or not mine["pending"] or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if mine is None:  # pruned already: 50 newer requests within the wait
        raise ControlError(f"request {request['seq']} is no longer in {Path(run_dir) / CONTROL_FILE}")
    pending = mine["pending"]
    if wait_s and pending and not mine["applied"] and not mine["refused"]:
        who = "no rank answered" if rank is None else f"rank {rank} did not answer"
        raise ControlError(f"{who} request {mine['seq']} within {wait_s:g} s: the job is not running, or its "
                           "ranks do not look at the control file (control_interval_s=0) or look less often than "
                           "that (try a longer --wait)")  # fmt: skip
    if not wait_s:
        st["requests"] = [mine]
        out(render_status(st))
        out(f"not checked (--wait 0): see who applied it with: stragglerwatch control {run_dir}")
        return 0
    st["requests"] = [{**mine, "pending": []}]
    out(render_status(st))
    if pending:
        out(f"  no answer within {wait_s:g} s from rank{'s' if len(pending) > 1 else ''} {_ranks(pending)} "
            "(stopped, or not looking at the control file)")  # fmt: skip
    return 1 if mine["refused"] or pending else 0


class ControlFile:
    """One rank's follower of the run dir's control file: a daemon thread that looks every ``interval_s``
    (at the shared file as its host's relay or alone, else at the relay's node-local copy) and applies the
    new requests addressed to this rank through :class:`Controls`. ``node_dir``: where the ranks of this
    host meet (default :func:`~stragglerwatch.runtime.controls.noderelay.node_base`); ``relay=False``: look
    at the shared file without a relay."""

    def __init__(self, controls: ControlSurface, run_dir: Path, rank: int, interval_s: float, problems: Problems,
                 *, run_id: str = "", node_dir: Path | None = None, relay: bool = True):  # fmt: skip
        self.controls = controls
        self.path = Path(run_dir) / CONTROL_FILE
        self.ack_path = Path(run_dir) / ACK_FILE.format(rank=rank)
        self.rank = rank
        self.interval_s = interval_s
        self.problems = problems
        self.applied = 0
        self.shared_looks = 0  # stats of the shared control file after attach
        self.local_looks = 0  # stats of the relay's node-local copy
        self.node: NodeRelay | None = None
        if relay:
            try:
                self.node = NodeRelay(self.path.parent, run_id, node_dir)
            except (OSError, ImportError) as exc:
                problems.report("control", f"control file: no node-local directory to share it with this host's "
                                f"other ranks ({type(exc).__name__}: {exc}); rank {rank} looks at {self.path} "
                                "itself")  # fmt: skip
        self._signature = self._stat(self.path)  # of the shared file, for the relay or a rank alone
        self._copy_signature: tuple[int, int, int] | None = None  # of the node-local copy, for the others
        self._attached_ns = time.time_ns()
        try:  # requests made before this attach are not for it
            self._seen = max((r["seq"] for r in read_requests(self.path.parent)), default=0)
        except ControlError:
            self._seen = 0
        self._lead()
        self._acks: list[dict[str, Any]] = []
        with contextlib.suppress(ControlError):
            old = _read_json(self.ack_path)  # an earlier process of this rank: its answers stay readable
            if isinstance(old, dict) and isinstance(old.get("acks"), list):
                self._acks = [a for a in old["acks"] if isinstance(a, dict)][-MAX_ACKS:]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stragglerwatch-control-{rank}", daemon=True)

    @property
    def role(self) -> str:
        """``relay`` (looks at the shared file for its host), ``follower`` (at the relay's copy) or ``alone``
        (at the shared file, without a relay)."""
        if self.node is None:
            return "alone"
        return "relay" if self.node.leader else "follower"

    def describe(self) -> dict[str, Any]:
        return {"role": self.role, "interval_s": self.interval_s, "shared_looks": self.shared_looks,
                "local_looks": self.local_looks, "applied": self.applied}  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        node, self.node = self.node, None
        if node is not None:
            try:
                node.leave()
            except OSError as exc:
                self.problems.report("control", f"control file: leaving {node.dir}: {exc}")

    @staticmethod
    def _stat(path: Path) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
            return (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            return None

    def _lead(self) -> None:
        """Become the host's relay when there is none (the first rank, or the relay left)."""
        node = self.node
        if node is None or node.leader:
            return
        try:
            if node.lead():
                self._signature = None  # read the shared file at the next look, and copy it for the others
        except OSError as exc:
            self.problems.report("control", f"control file: relay lock in {node.dir}: {exc}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except ControlError as exc:
                self.problems.report("control", f"control file: {exc}")
            except Exception as exc:  # never let the thread die of our own bug
                self.problems.report("control", f"control file: {type(exc).__name__}: {exc}")

    def poll(self) -> int:
        """Apply the requests that are new since the last look; how many were for this rank."""
        self._lead()
        node = self.node
        if node is not None and not node.leader:
            return self._poll_copy(node)
        self.shared_looks += 1
        signature = self._stat(self.path)
        if signature is None or signature == self._signature:
            return 0
        try:
            text = self.path.read_bytes()
        except OSError as exc:
            raise ControlError(f"{self.path}: unreadable ({type(exc).__name__}: {exc})") from None
        requests = requests_in(self.path, text)
        self._signature = signature
        if node is not None:
            try:
                node.publish(text)
            except OSError as exc:
                self.problems.report("control", f"control file: cannot copy it for this host's other ranks ({exc})")
        return self._apply(requests)

    def _poll_copy(self, node: NodeRelay) -> int:
        self.local_looks += 1
        signature = self._stat(node.copy)
        # a copy older than this attach is at most what the rank saw then (or an earlier job's: not for it)
        if signature is None or signature == self._copy_signature or signature[2] < self._attached_ns - 10**9:
            return 0
        requests = requests_in(node.copy)
        self._copy_signature = signature
        return self._apply(requests)

    def _apply(self, requests: list[dict[str, Any]]) -> int:
        done = 0
        for req in requests:
            if req["seq"] <= self._seen:
                continue
            self._seen = req["seq"]
            if req.get("rank") is not None and req["rank"] != self.rank:
                continue
            result = self.controls.apply(req["settings"], source=f"control file request {req['seq']}")
            self._acks.append({"seq": req["seq"], "at": time.time(), "applied": result["applied"],
                               "errors": result["errors"]})  # fmt: skip
            done += 1
        if done:
            self.applied += done
            self._acks = self._acks[-MAX_ACKS:]
            try:
                write_json_atomic(self.ack_path, clean({"schema": "stragglerwatch-control-ack", "version": VERSION,
                                                        "rank": self.rank, "pid": os.getpid(),
                                                        "acks": self._acks}))  # fmt: skip
            except OSError as exc:
                self.problems.report("control", f"control file: cannot write {self.ack_path} ({exc})")
        return done
