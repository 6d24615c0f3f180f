"""The newer PyTorch messages behind :mod:`stragglerwatch.evidence.torchlogs`: NCCL desync reports, collective
fingerprint mismatches, Flight Recorder / NCCL library / c10d store messages (``match_recent``), and the
verdicts ``LogParse.first_failure`` draws from desync reports and mismatches.

Desync report (``TORCH_NCCL_DESYNC_DEBUG=1``, ``retrieveDesyncReport`` in ``c10d/TraceUtils.h``): a block of
lines, each starting (after any ``[rankN]:``/glog prefix) with a tab and `` - ``::

    - [0] Timeout at collective: ALLREDUCE, #6                                      -> desync_timeout
    - To our best knowledge, ranks [1, 3] are the lagging ranks ... never joined    -> desync_missing
    - To our best knowledge, the lagging/dead/mismatched ranks ... desync are:      (header)
      - [47] joined but didn't finish collective #41207 (count from 1)              -> desync_lagging
        [0, 1] finished collective #41207, but didn't join collective #41208 ...    -> desync_finished
    - Snapshot of ranks' latest states:                                             (header)
      #41207 started ranks:                                                         (header)
        [47] started ALLREDUCE                                                      -> desync_snapshot

``#S`` counts from 1 like WorkNCCL's SeqNum. torch builds the report from each rank's latest state (the last
collective it started, and whether it finished it); the lines after the header describe the lowest such
collective, so every rank they name is behind the rest. A block's state is kept per ``[rankN]:`` stream, so
interleaved reports of several ranks stay apart.

Fingerprint mismatch (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, ``ProcessGroupWrapper``)::

    Detected mismatch between collectives on ranks. Rank 0 is running collective:
    CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float,
    TensorDeviceTypes=...), but Rank 1 is running collective: CollectiveFingerPrint(...).Collectives differ in
    the following aspects:   Op type: ALLREDUCEvs BROADCAST

(one line). The first releases with it (1.9/1.10) print ``is running inconsistent collective:`` and no
second rank; later ones, until SequenceNumber and the aspects were added, both fingerprints without them
(``differs`` is then worked out from the two). A collective without tensors prints
``SequenceNumber=5OpType=BARRIER`` (no comma). The SequenceNumber is the wrapped group's own counter (the
first collective is 0), not WorkNCCL's. When the two fingerprints differ in length torch decodes the peer's
from the wrong tensor, so the peer side can be nonsense (``SequenceNumber=0OpType=GATHER``); a rank's own
side is always right.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stragglerwatch.evidence.logevent import LogEvent

Fields = dict[str, Any]
CULPRIT_KINDS = ("desync_missing", "desync_lagging", "desync_finished")

_RANK_LIST = r"\[\s*(\d+(?:\s*,\s*\d+)*)?\s*\]"
_DIDNT = r"(?:didn.?t|did not)"
_D_TIMEOUT = re.compile(r"\[(\d+)\] Timeout at collective: ([^,\s]*),?\s*#(\d+)")
_D_MISSING = re.compile(r"ranks " + _RANK_LIST + r" are the lagging ranks that caused this timeout")
_D_HEADER = re.compile(r"lagging/dead/mismatched ranks that caused the desync are:?")
_D_LAGGING = re.compile(r"^(?:-\s*)?" + _RANK_LIST + rf" joined but {_DIDNT} finish collective #(\d+)")
_D_FINISHED = re.compile(
    r"^(?:-\s*)?" + _RANK_LIST + rf" finished collective #(\d+),? but {_DIDNT} join collective #(\d+)"
)
_D_SNAPSHOT = re.compile(r"Snapshot of ranks.{0,2} latest states:?")
_D_SNAP_SEQ = re.compile(r"^#(\d+) (started|finished) ranks:?$")
_D_SNAP_RANKS = re.compile(r"^" + _RANK_LIST + r" (started|finished) (\S+)$")

_MISMATCH = re.compile(r"Detected mismatch between collectives on ranks\.?\s*Rank (\d+) is running (?:inconsistent )?"
                       r"collective:\s*")  # fmt: skip
_PEER = re.compile(r",?\s*but Rank (\d+) is running collective:\s*")
_ASPECTS = re.compile(r"\.?\s*Collectives differ in the following aspects:")
_ASPECT_NAMES = {"Sequence number": "seq", "Op type": "op", "Tensor shapes": "shape", "Tensor dtypes": "dtype",
                 "Tensor devices": "device"}  # fmt: skip
_ASPECT = re.compile("(" + "|".join(_ASPECT_NAMES) + "):")
_FP_SEQ = re.compile(r"SequenceNumber=(\d+)")
_FP_OP = re.compile(r"OpType=(\w+)")
_FP_SHAPE = re.compile(r"TensorShape=(\[[^\]]*\])")
_FP_DTYPES = re.compile(r"TensorDtypes=(.*?)(?:,\s*TensorDeviceTypes=|\)|$)")
_FP_DEVICE = re.compile(r"TensorDeviceTypes=(?:TensorOptions\(.*?\bdevice=([\w:]+)|\[?([\w:]+))")


def ranks_of(text: str | None) -> list[int]:
    return [int(r) for r in re.findall(r"\d+", text or "")]


@dataclass
class _Report:
    """One rank's desync report being read."""

    rank: int | None = None
    pg: str | None = None
    seq: int | None = None
    op: str | None = None
    snap_seq: int | None = None  # the "#S started/finished ranks:" group being listed


class DesyncReader:
    """Reads desync report lines; one open report per output stream (the ``[rankN]:`` prefix, or None)."""

    def __init__(self) -> None:
        self._open: dict[str | None, _Report] = {}

    def close(self, stream: str | None) -> None:
        self._open.pop(stream, None)

    def match(self, body: str, stream: str | None, pg: str | None) -> tuple[str | None, Fields] | None:
        """``(kind, fields)`` for a report line (kind None: a header, recognised but no event), else None.
        ``body`` is the line without prefixes; ``pg`` is the process group of the line that led the block."""
        body = body.lstrip("- \t")
        rep = self._open.get(stream)
        if rep is None and "collective" not in body and "ranks" not in body:
            return None
        if m := _D_TIMEOUT.search(body):
            rep = self._open[stream] = _Report(int(m.group(1)), pg, int(m.group(3)), m.group(2) or None)
            return "desync_timeout", self._fields(rep, seq=rep.seq, op=rep.op)
        if m := _D_MISSING.search(body):
            rep = rep or self._open.setdefault(stream, _Report())
            return "desync_missing", self._fields(rep, failed_ranks=ranks_of(m.group(1)), seq=rep.seq, op=rep.op)
        if _D_HEADER.search(body) or _D_SNAPSHOT.search(body):
            self._open.setdefault(stream, _Report())
            return None, {}
        if m := _D_LAGGING.match(body):
            rep = rep or self._open.setdefault(stream, _Report())
            return "desync_lagging", self._fields(rep, failed_ranks=ranks_of(m.group(1)), seq=int(m.group(2)))
        if m := _D_FINISHED.match(body):
            rep = rep or self._open.setdefault(stream, _Report())
            return "desync_finished", self._fields(rep, failed_ranks=ranks_of(m.group(1)), seq=int(m.group(2)))
        if rep is None:
            return None
        if m := _D_SNAP_SEQ.match(body):
            rep.snap_seq = int(m.group(1))
            return None, {}
        if rep.snap_seq is not None and (m := _D_SNAP_RANKS.match(body)):
            return "desync_snapshot", self._fields(rep, ranks=ranks_of(m.group(1)), seq=rep.snap_seq,
                                                   op=m.group(3), detail={"state": m.group(2)})  # fmt: skip
        return None

    @staticmethod
    def _fields(rep: _Report, **fields: Any) -> Fields:
        """Fields of a line inside a report: the reporting rank and group come from its timeout line."""
        known = {"rank": rep.rank, "pg": rep.pg}
        return {**{k: v for k, v in known.items() if v is not None}, **fields}


def _fingerprint(text: str) -> Fields:
    seq, op, shape = _FP_SEQ.search(text), _FP_OP.search(text), _FP_SHAPE.search(text)
    dtypes, device = _FP_DTYPES.search(text), _FP_DEVICE.search(text)
    return {
        "seq": int(seq.group(1)) if seq else None,
        "op": op.group(1) if op else None,
        "shape": shape.group(1) if shape else None,
        "dtype": (dtypes.group(1).strip() or None) if dtypes else None,
        "device": (device.group(1) or device.group(2)) if device else None,
    }


def match_mismatch(line: str) -> Fields | None:
    """The fields of a ``Detected mismatch between collectives`` line, else None."""
    m = _MISMATCH.search(line)
    if m is None:
        return None
    rest = line[m.end() :]
    aspects = _ASPECTS.search(rest)
    fingerprints, diff = (rest[: aspects.start()], rest[aspects.end() :]) if aspects else (rest, "")
    peer = _PEER.search(fingerprints)
    mine = _fingerprint(fingerprints[: peer.start()] if peer else fingerprints)
    theirs = _fingerprint(fingerprints[peer.end() :]) if peer else {}
    if aspects:
        differs = list(dict.fromkeys(_ASPECT_NAMES[a] for a in _ASPECT.findall(diff)))
    else:  # an old release: compare what both sides printed
        differs = [k for k in _ASPECT_NAMES.values() if theirs and None not in (mine[k], theirs.get(k))
                   and mine[k] != theirs.get(k)]  # fmt: skip
    detail = {k: mine[k] for k in ("shape", "dtype", "device") if mine[k]}
    detail.update({f"peer_{k}": theirs[k] for k in ("shape", "dtype", "device") if theirs.get(k)})
    return {
        "rank": int(m.group(1)),
        "seq": mine["seq"],
        "op": mine["op"],
        "peer_rank": int(peer.group(1)) if peer else None,
        "peer_seq": theirs.get("seq"),
        "peer_op": theirs.get("op"),
        "differs": differs,
        "detail": detail,
    }


# --- other recent messages -----------------------------------------------------------------------------------------

_WATCHDOG_EXIT = re.compile(r"watchdog detected a collective timeout from (?:the )?([\w ]*?rank(?:\s+-?\d+)?)\b|"
                            r"Terminating the process after attempting to dump debug info, due to ([^.]*)")  # fmt: skip
# Flight Recorder (2.3+): who signalled the dump, where it went, the failed collective's stack.
_DUMP_OBSERVED = re.compile(r"Observed flight recorder dump signal from another rank", re.I)
_DUMP_SENT = re.compile(r"First PG on this rank to signal dumping")
_DUMP_START = re.compile(r"\bpreparing to dump debug info")
_DUMP_WRITTEN = re.compile(r"Finished writing (?:[\w ]*?)debug info to (\S+)")
_DUMP_ERROR = re.compile(r"Error (?:opening file for writing|writing|flushing) [\w ]*?debug info(?: to file)?:\s*(\S+)")
_STACK = re.compile(r"Stack trace of the failed collective(?: (not found))?")
FRAME = re.compile(r"^#\d+ \S.* from \S")  # a frame of that stack, on its own line
# NCCL library errors (NCCLUtils: "NCCL error in: <file>:<line>, <ncclGetErrorString>, NCCL version V").
_NCCL_ERROR = re.compile(r"NCCL error(?: in: (\S+?),|:)\s+(.+?)(?:, NCCL version ([\w.+-]+))?\.?\s*$")
_NCCL_RESULT = re.compile(r"\b(nccl(?:UnhandledCuda|System|Internal|Remote)Error|ncclInvalid(?:Argument|Usage)"
                          r"|ncclInProgress): ")  # fmt: skip
_NCCL_RESULTS = {"unhandled cuda error": "ncclUnhandledCudaError", "unhandled system error": "ncclSystemError",
                 "internal error": "ncclInternalError", "invalid argument": "ncclInvalidArgument",
                 "invalid usage": "ncclInvalidUsage", "remote process exited": "ncclRemoteError",
                 "NCCL operation in progress": "ncclInProgress"}  # fmt: skip
_NCCL_ABORTED = re.compile(r"NCCL communicator was aborted on rank (\d+)\.?\s*(?:Original reason for "
                           r"(?:failure|aborting|the abort) was:?\s*(.*))?")  # fmt: skip
# c10d store (TCPStore) timeouts and the NCCL rendezvous through it.
_UNIQUE_ID = re.compile(r"\[(\d+)\] is setting up NCCL communicator and retrieving ncclUniqueId from \[(\d+)\]"
                        r"(?:.*?got error:\s*(.*))?")  # fmt: skip
_CLIENTS = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
_STORE_WAIT = re.compile(r"\b(?:wait|barrier) timeout after (\d+)\s*ms, keys?: (.*)")
_CONNECT = re.compile(r"client socket has timed out after (\d+)\s*(ms|s)\b while trying to connect to "
                      r"\(([^,()]+), (\d+)\)")  # fmt: skip
_SOCKET_TIMEOUT = re.compile(r"\bSocket Timeout\b")


def match_recent(line: str) -> tuple[str, Fields] | None:
    """Flight Recorder, NCCL library and c10d store messages (mostly 2.3 and later)."""
    if m := _NCCL_ABORTED.search(line):
        return "nccl_aborted", {"rank": int(m.group(1)), "error": (m.group(2) or "").strip()[:200] or None}
    if m := _UNIQUE_ID.search(line):
        error = (m.group(3) or "").strip()[:200] or None
        wait = _STORE_WAIT.search(error or "")
        kind = "store_timeout" if error and re.search(r"time ?out|timed out", error, re.I) else "store_error"
        return kind, {"rank": int(m.group(1)), "peer_rank": int(m.group(2)), "error": error,
                      "timeout_ms": int(wait.group(1)) if wait else None}  # fmt: skip
    if m := _NCCL_ERROR.search(line):
        desc = m.group(2).strip()
        name = next((n for d, n in _NCCL_RESULTS.items() if desc.startswith(d)), None)
        detail = {k: v for k, v in (("where", m.group(1)), ("nccl_version", m.group(3))) if v}
        return "nccl_error", {"error": name or desc[:200], "detail": detail}
    if m := _NCCL_RESULT.search(line):  # NCCLUtils' explanation line, e.g. "ncclRemoteError: A call failed ..."
        return "nccl_error_detail", {"error": m.group(1)}
    if m := _CLIENTS.search(line):
        return "store_timeout", {"timeout_ms": int(m.group(1)) * 1000, "error": "waiting for clients",
                                 "detail": {"clients_joined": int(m.group(2)), "clients": int(m.group(3))}}  # fmt: skip
    if m := _STORE_WAIT.search(line):
        keys = [k.strip() for k in m.group(2).split(", ") if k.strip()][:20]
        return "store_timeout", {"timeout_ms": int(m.group(1)), "error": "wait timeout", "detail": {"keys": keys}}
    if m := _CONNECT.search(line):
        ms = int(m.group(1)) * (1 if m.group(2) == "ms" else 1000)
        return "store_timeout", {"timeout_ms": ms, "error": "connect timeout", "peer": f"{m.group(3)}:{m.group(4)}"}
    if _SOCKET_TIMEOUT.search(line):
        return "store_timeout", {"error": "Socket Timeout"}
    if _DUMP_OBSERVED.search(line):
        return "dump_signal_observed", {}
    if _DUMP_SENT.search(line):
        return "dump_signal_sent", {}
    if _DUMP_START.search(line):
        return "dump_start", {}
    if m := _DUMP_WRITTEN.search(line):
        return "dump_written", {"path": m.group(1)}
    if m := _DUMP_ERROR.search(line):
        return "dump_error", {"path": m.group(1)}
    if m := _STACK.search(line):
        return ("stack_trace_missing", {}) if m.group(1) else ("stack_trace", {})
    if m := _WATCHDOG_EXIT.search(line):
        return "watchdog_exit", {"error": (m.group(1) or m.group(2) or "").strip() or None}
    return None


# --- verdicts ----------------------------------------------------------------------------------------------------

Verdict = tuple["LogEvent", list[int], int | None, str | None]  # deciding event, culprits, seq, op


def desync_verdict(events: list[LogEvent]) -> Verdict | None:
    """The ranks a desync report blames. Never-joined ranks first; else the ranks furthest behind over all
    reports: still inside #S (``desync_lagging``) is behind finished #S but never joined #S+1
    (``desync_finished``). ``seq`` is the collective the culprits did not complete: #S for lagging ranks,
    #S+1 (where the others wait) for finished ones, the reporter's for missing ones; ``op`` its type."""
    named = [e for e in events if e.kind in CULPRIT_KINDS and e.failed_ranks]
    if not named:
        return None
    missing = [e for e in named if e.kind == "desync_missing"]
    if missing:
        ev = missing[0]
        return ev, ev.failed_ranks, ev.seq, ev.op or _op_at(events, ev.seq, ev.failed_ranks)
    staged = [e for e in named if e.seq is not None]
    if not staged:
        return named[0], named[0].failed_ranks, None, None
    ev = min(staged, key=lambda e: (e.seq, e.kind == "desync_finished"))  # first of the furthest behind
    seq = ev.seq if ev.kind == "desync_lagging" or ev.seq is None else ev.seq + 1
    return ev, ev.failed_ranks, seq, _op_at(events, seq, ev.failed_ranks if ev.kind == "desync_lagging" else None)


def _op_at(events: list[LogEvent], seq: int | None, ranks: list[int] | None) -> str | None:
    """The collective type at ``seq``: a snapshot group holding ``ranks`` (any, when None), then a timeout."""
    if seq is None:
        return None
    for e in events:
        if e.kind == "desync_snapshot" and e.seq == seq and e.op and (ranks is None or set(ranks) & set(e.ranks)):
            return e.op
    return next((e.op for e in events if e.kind in ("desync_timeout", "nccl_timeout") and e.seq == seq and e.op),
                None)  # fmt: skip


def mismatch_verdict(events: list[LogEvent]) -> Verdict | None:
    """The odd rank out of fingerprint mismatches: every rank reports the first rank that differs from it, so
    the rank named by most reporters (at least two, and more than any other) is the culprit. Otherwise (two
    ranks naming each other, a single report, a tie) every rank so named, with its reporters when alone.
    ``seq``/``op``: the culprit's own fingerprint when it reported one, else what others saw of it."""
    reports: dict[int, LogEvent] = {}
    for e in events:
        if e.kind == "collective_mismatch" and e.rank is not None:
            reports.setdefault(e.rank, e)  # one vote per reporting rank
    if not reports:
        return None
    votes = Counter(e.peer_rank for e in reports.values() if e.peer_rank is not None)
    if not votes:  # the oldest form names no second rank: nothing to tell the odd one by
        return None
    top = max(votes.values())
    named = sorted(r for r, n in votes.items() if n == top)
    if top >= 2 or len(named) > 1:
        culprits = named
    else:  # one report: either side may be the odd one
        culprits = sorted({*named, *(r for r, e in reports.items() if e.peer_rank in named)})
    ev = next((e for e in reports.values() if e.peer_rank in culprits), None) or next(iter(reports.values()))
    own = reports.get(culprits[0])
    if own is not None:
        return ev, culprits, own.seq, own.op
    seen = next((e for e in reports.values() if e.peer_rank == culprits[0]), ev)
    return ev, culprits, seen.peer_seq, seen.peer_op


# A rank's Python exception: the line that ends a traceback in that rank's ``[rankN]:`` stream
# ("[rank2]: RuntimeError: CUDA error: ..."). torchrun's summary names the first rank to exit; this says why.
_TB_START = "Traceback (most recent call last):"
_TB_END = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Failure|Timeout))(?::\s*(.*))?$")
_TB_SPAN = 500  # lines after its start a traceback may end on
_COMM_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")  # torch.distributed's


class ExceptionReader:
    """Tracebacks per output stream: :meth:`match` gives ``rank_exception`` at the exception line that ends one
    (``error``: the exception's class, ``detail["message"]``, ``detail["communication"]`` for torch's
    distributed errors, which a rank raises as a victim of a peer)."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # stream -> line of its open traceback

    def match(self, body: str, stream: str | None, line_no: int) -> tuple[str, Fields] | None:
        if stream is None:
            return None  # whose exception it is is unknown without torchrun's prefix
        if body == _TB_START:
            self._open[stream] = line_no
            return None
        start = self._open.get(stream)
        m = _TB_END.match(body)
        if start is None or m is None or line_no - start > _TB_SPAN:
            return None
        del self._open[stream]
        name = m.group(1).rsplit(".", 1)[-1]
        return "rank_exception", {
            "error": name,
            "detail": {"message": (m.group(2) or "")[:300], "communication": name in _COMM_ERRORS},
        }

    def close(self, body: str, stream: str | None) -> None:
        """A line another matcher took: if it ends the stream's traceback, the traceback is over."""
        if stream in self._open and _TB_END.match(body):
            del self._open[stream]


def first_raised(events: list[LogEvent], rank: int | None = None) -> LogEvent | None:
    """The first exception that is not a communication failure (of ``rank``, when given)."""
    return next((e for e in events if e.kind == "rank_exception" and not e.detail.get("communication")
                 and (rank is None or e.rank == rank)), None)  # fmt: skip


def cause_of(events: list[LogEvent], rank: int | None) -> str | None:
    """:func:`first_raised` of ``rank`` as ``Class: message``."""
    if (e := first_raised(events, rank)) is None:
        return None
    message = e.detail.get("message")
    return f"{e.error}: {message}" if message else e.error
