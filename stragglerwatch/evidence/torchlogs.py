"""Parse PyTorch distributed failure messages (NCCL watchdog, desync reports, DETAIL fingerprint mismatches,
Flight Recorder, NCCL and c10d store errors, gloo, monitored_barrier, torchrun) out of logs.

Design: a line-oriented, version-tolerant matcher; no torch import, no I/O beyond reading the given files.
Each message is recognised by a stable phrase ("collective operation timeout: WorkNCCL(", "last enqueued
... work:", ...), never by glog headers or ``.cpp`` line numbers, which move between releases. Payloads
such as ``WorkNCCL(SeqNum=.., OpType=.., NumelIn=.., Timeout(ms)=..)`` are read key by key, so fields an
older release does not print simply stay None. The rank and process group come from whichever tag the
line carries: ``[PG 1 Rank 0]``, ``[PG 0 (default_pg) Rank 7]``, ``[PG ID 0 PG GUID 0(default_pg) Rank 5]``,
``[Rank R]``, then the ``[rankN]:`` prefix torchrun adds (the tag inside the message wins).
torchrun's multi-line ``ChildFailedError`` summary is read by a small state machine that emits one
``child_failed`` event per ``[N]:`` entry (its ``text`` joins the entry's lines with `` | ``).
Lines that match nothing (unknown, garbage, undecodable bytes) are counted in ``LogParse.skipped``;
no input line raises.

Multi-line messages: the desync report (``desync_*`` kinds) and the ``collective_mismatch`` line are read in
:mod:`stragglerwatch.evidence.torchlogs_blocks`, which documents their shapes; a report's state is kept per
``[rankN]:`` stream. The frames (``#0 fn from file:line``) after ``Stack trace of the failed collective:``
go to that event's ``stack``; an ``ncclRemoteError: ...`` detail line right after an ``NCCL error`` line
fills that event's ``error`` instead of making another event.

Kinds and the fields they set beyond ``rank``/``pg`` (2.4-2.13 phrasing, older where it differs):
``nccl_timeout``, ``nccl_work_state`` (``peer_rank``: the rank whose timeout sent the dump signal, its own
rank for "this local rank"), ``nccl_failure``, ``heartbeat_timeout``; ``desync_timeout``/``desync_missing``/
``desync_lagging``/``desync_finished``/``desync_snapshot``; ``collective_mismatch`` (``peer_rank``,
``peer_seq``, ``peer_op``, ``differs``, ``detail`` shapes/dtypes/devices); ``dump_signal_observed``,
``dump_signal_sent``, ``dump_start``, ``dump_written``/``dump_error`` (``path``), ``stack_trace``
(``stack``), ``stack_trace_missing``, ``watchdog_exit``; ``nccl_error`` (``error`` as ncclResult name,
``detail["nccl_version"]``), ``nccl_aborted`` (``error``: the original reason); ``store_timeout``/
``store_error`` (``timeout_ms``, ``error``, ``detail`` keys or clients joined, ``peer_rank`` the
ncclUniqueId root); ``gloo_timeout``, ``gloo_peer_closed``, ``monitored_barrier``, ``worker_failed``,
``child_failed``; ``rank_exception`` (the line that ends a ``[rankN]:`` traceback: ``error`` the class,
``detail`` its message and whether it is one of torch's distributed errors).

Process-group normalisation: ``pg`` is the group's id token as printed, without its description:
``[PG 1 Rank 0]`` -> "1", ``[PG 0 (default_pg) Rank 7]`` -> "0", ``[PG ID 0 PG GUID 0(default_pg) Rank 5]``
-> "0" (the GUID, which is what releases before 2.4 print after "PG"). Lines with only ``[Rank R]`` get None.
"""

from __future__ import annotations

import os
import re
import signal as _signal
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO

from stragglerwatch.evidence.logevent import LogEvent
from stragglerwatch.evidence.torchlogs_blocks import (
    FRAME,
    DesyncReader,
    ExceptionReader,
    cause_of,
    desync_verdict,
    first_raised,
    match_mismatch,
    match_recent,
    mismatch_verdict,
)

_TEXT_MAX = 500  # chars of the raw line kept in LogEvent.text
_SCAN_MAX = 20_000  # chars of a line that are matched at all: messages are short, longer lines are garbage
_READ_MAX = 1 << 20  # bytes of one line read from a file; the rest of an overlong line is discarded
_TIMEOUT_KINDS = ("nccl_timeout", "gloo_timeout", "desync_timeout")  # a rank that waited in a collective
_SEQ_KINDS = ("nccl_timeout", "nccl_work_state", "desync_timeout")
_STACK_MAX = 50  # frames kept in LogEvent.stack

# Context tags.
_PG_TAG = re.compile(r"\[PG (?:ID \S{1,64} PG GUID )?([^\s()\]]{1,64})\s*(?:\([^)]{0,200}\))?\s*Rank (\d+)\]")
_RANK_TAG = re.compile(r"\[Rank (\d+)\]")
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
_ROLE_PREFIX = re.compile(r"^\s*\[default(\d+)\]:")  # torchrun --tee before 2.2: [<role><local_rank>]:
_STREAM = re.compile(r"^\s*\[(?:rank|default)\d+\]:")  # whose output a line is, for multi-line messages
_GLOG = re.compile(r"\[[EWIF]\d{4} |\[[EWIF] |^\s*[EWIF]\d{4} ")
_BARE_TAG = re.compile(r"^(?:\[PG [^\]]*Rank \d+\]|\[Rank \d+\]|Rank \d+)$")  # a glog line that leads a block
_PREFIXES = re.compile(
    r"^(?:\s*(?:\[rank\d+\]:|\[default\d+\]:|\[[EWIF]\d{4} [\d:.]+ [^\]]*\]|\[[EWIF] [^\]]*\]"
    r"|[EWIF]\d{4} [\d:.]+ \d+ \S+:\d+\]))*"
)
# NCCL.
_NCCL_TIMEOUT = re.compile(r"collective operation timeout:\s*WorkNCCL\(", re.I)
_WORK = re.compile(r"WorkNCCL\(((?:[^()]|\([^()]*\))*)\)")
_BLOCKING = re.compile(r"\bWork\s+" + _WORK.pattern + r"\s*timed out in blocking wait")
_KV = re.compile(r"(\w+(?:\(ms\))?)=(\[[^\]]*\]|[^,]*)")
_WORK_KEYS = {
    "SeqNum": "seq",
    "OpType": "op",
    "NumelIn": "numel_in",
    "NumelOut": "numel_out",
    "Timeout(ms)": "timeout_ms",
}
_RAN_FOR = re.compile(r"\)\s*ran for (\d+)\s*milliseconds")
_STATE = re.compile(r"last enqueued (?:\w+ )?work:\s*(-?\d+),?\s*last completed (?:\w+ )?work:\s*(-?\d+)", re.I)
_DUMP_FROM = re.compile(r"Received a (?:dump|timeout) signal (?:due to a collective timeout )?from\s+(this local rank"
                        r"|rank\s+(-?\d+))")  # fmt: skip
_STATE_SEQ = re.compile(r"\bat (?:NCCL )?work(?: sequence id)?:\s*(\d+)", re.I)
_NCCL_FAILURE = re.compile(r"Some NCCL operations have failed or timed out")
_HEARTBEAT = re.compile(r"Heartbeat monitor timed out")
_STUCK = re.compile(r"watchdog got stuck for (\d+) seconds", re.I)
# gloo, monitored_barrier, torchrun.
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)\s*ms for (recv|send) operation to complete")
_GLOO_CLOSED = re.compile(
    r"Connection closed by peer (\[[^\]]+\]:\d+)|Read error (\[[^\]]+\]:\d+): Connection reset by peer"
)

_BARRIER = re.compile(r"\bRanks? (\d+(?:\s*,\s*\d+)*) failed to pass monitoredBarrier in (\d+) ms")
_WORKER = re.compile(r"failed \(exitcode:\s*(-?\d+)\)\s*local_rank:\s*(\d+)\s*\(pid:\s*(\d+)\)")
# torchrun ChildFailedError summary (2.x and the 1.9-1.10 layout with "Root Cause:" first and "msg:").
_CHILD_START = re.compile(r"\bChildFailedError:")
_SEPARATOR = re.compile(r"^[=*-]{5,}$")
_SECTION = re.compile(r"^(?:(Root Cause)(?: \(first observed failure\))?|(?:Other )?Failures):$")
_TITLE = re.compile(r"^\S.* FAILED$|^<NO_OTHER_FAILURES>$")
_ENTRY = re.compile(r"^\[(\d+)\]:$")
_FIELD = re.compile(r"^(time|host|rank|exitcode|error_file|traceback|msg)\s*:\s?(.*)$")
_RANK_FIELD = re.compile(r"^(-?\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
_EXIT_FIELD = re.compile(r"^(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
_SIGNAL_TEXT = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")


@dataclass
class LogParse:
    events: list[LogEvent]
    lines: int  # lines read
    skipped: int  # lines that matched nothing

    def first_failure(self) -> dict | None:
        found = self._first_failure()
        if found is not None and (cause := cause_of(self.events, found["rank"])):
            found["error"] = cause
        return found

    def _first_failure(self) -> dict | None:
        """The first failing rank(s) and collective: ``{"rank", "ranks", "pg", "seq", "op", "kind", "line_no",
        "file"}``; ``ranks`` lists every culprit, ``rank`` is the first of them; ``pg`` the process group of
        ``seq`` when known.

        A desync report names the culprits outright (see ``torchlogs_blocks.desync_verdict``): ranks that
        never joined, else the ranks furthest behind. Then collective fingerprint mismatches (the rank most
        reporters name, ``mismatch_verdict``). Otherwise the lowest sequence number among ``nccl_timeout``/
        ``nccl_work_state``/``desync_timeout`` events is the collective that failed first. A rank whose
        highest reported ``last_enqueued`` (same pg, or pg unknown) is below it never launched it and is the
        culprit (the furthest behind, then the earliest). Otherwise the rank of the first event at that
        sequence number; without any sequence number the torchrun root cause, then the first rank to raise an
        exception that is not a communication failure, then the first event with a rank, then the first
        event. ``kind``/``line_no``/``file`` name the line that decided; ``error`` (when known) is the first
        such exception the culprit raised. None without events.
        """
        if not self.events:
            return None
        if found := desync_verdict(self.events):
            ev, ranks, seq, op = found
            return _verdict(ev, seq, op, ranks, rule="desync report")
        if found := mismatch_verdict(self.events):
            ev, ranks, seq, op = found
            return _verdict(ev, seq, op, ranks, rule="collective mismatch")
        timed = [e for e in self.events if e.kind in _SEQ_KINDS and e.seq is not None]
        if not timed:
            barrier = [e for e in self.events if e.kind == "monitored_barrier" and e.failed_ranks]
            if barrier:  # torch names the ranks that did not reach the barrier
                ranks = sorted({r for e in barrier for r in e.failed_ranks})
                return _verdict(barrier[0], None, "monitoredBarrier", ranks, rule="monitored barrier")
            if found := self._not_timed_out():
                return found
            root = next((e for e in self.events if e.kind == "child_failed" and e.root_cause), None)
            if root is None and (crash := first_raised(self.events)):
                return _verdict(crash, None, None, rule="exception")
            ev = root or next((e for e in self.events if e.rank is not None), self.events[0])
            return _verdict(ev, ev.seq, ev.op, rule="root cause" if root else "first message")
        seq = min(e.seq for e in timed if e.seq is not None)
        at_seq = [e for e in timed if e.seq == seq]
        op = next((e.op for e in at_seq if e.op), None)
        pg = next((e.pg for e in at_seq if e.pg is not None), None)
        issued: dict[int, tuple[int, LogEvent]] = {}  # rank -> highest sequence number it is known to have enqueued
        for e in self.events:
            if e.rank is None or (pg is not None and e.pg not in (None, pg)):
                continue
            known = [v for v in (e.last_enqueued, e.seq if e.kind in _SEQ_KINDS else None) if v is not None]
            if known and (e.rank not in issued or max(known) > issued[e.rank][0]):
                issued[e.rank] = (max(known), e)
        behind = [(n, e) for n, e in issued.values() if n < seq]  # dict order: first seen rank first
        if behind:
            return _verdict(min(behind, key=lambda item: item[0])[1], seq, op, pg=pg, rule="behind")
        if found := self._not_timed_out():
            return found
        return _verdict(next((e for e in at_seq if e.rank is not None), at_seq[0]), seq, op, pg=pg,
                        rule="first timeout")  # fmt: skip

    def _not_timed_out(self) -> dict | None:
        """Most of the job's ranks timed out waiting in a collective, and the logs show the job's other
        ranks (torchrun's summary lists every failed rank) without a timeout: those were not in the
        collective. Needs the world (ranks of ``child_failed`` entries) and more timed-out ranks than not."""
        timed_out = {e.rank for e in self.events if e.kind in _TIMEOUT_KINDS and e.rank is not None}
        world = {e.rank for e in self.events if e.kind == "child_failed" and e.rank is not None}
        rest = sorted(world - timed_out)
        if not timed_out or not world >= timed_out or not rest or len(rest) >= len(timed_out):
            return None
        ev = next(e for e in self.events if e.kind == "child_failed" and e.rank == rest[0])
        first = next(e for e in self.events if e.kind in _TIMEOUT_KINDS and e.rank is not None)
        op = first.op if first.kind != "gloo_timeout" else None  # gloo names its transport op (send, recv)
        return _verdict(ev, first.seq, op, rest, pg=first.pg, rule="did not time out")


def _verdict(ev: LogEvent, seq: int | None, op: str | None, ranks: list[int] | None = None,
             pg: str | None = None, rule: str = "first message") -> dict:  # fmt: skip
    """``rule`` says what decided: "desync report", "collective mismatch", "behind" (last enqueued work
    below the failed collective), "monitored barrier" (torch names who did not arrive) — evidence of
    who is behind —, "did not time out" (the ranks of the job that did not time out while most did),
    or "first timeout", "root cause", "exception", "first message" (only who failed first)."""
    if ranks is None:
        ranks = [ev.rank] if ev.rank is not None else []
    return {"rank": ranks[0] if ranks else ev.rank, "ranks": list(ranks), "pg": ev.pg if pg is None else pg,
            "seq": seq, "op": op, "kind": ev.kind, "rule": rule, "line_no": ev.line_no, "file": ev.file}  # fmt: skip


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _signal_name(exit_code: int | None) -> str | None:
    """torchrun reports death by signal N as exit code -N."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return _signal.Signals(-exit_code).name
    except ValueError:
        return None


def _work_fields(line: str) -> dict:
    m = _WORK.search(line)
    fields: dict = {}
    for key, value in _KV.findall(m.group(1) if m else ""):
        if key in _WORK_KEYS:
            value = value.strip()
            fields[_WORK_KEYS[key]] = (value or None) if key == "OpType" else _int(value)
    return fields


def _match_message(line: str) -> tuple[str, dict] | None:
    """The kind and fields of the message on ``line``, or None when it is not one we know."""
    if "WorkNCCL(" in line and (_NCCL_TIMEOUT.search(line) or _BLOCKING.search(line)):
        fields = _work_fields(line)
        if m := _RAN_FOR.search(line):
            fields["ran_for_ms"] = int(m.group(1))
        return "nccl_timeout", fields
    if m := _STATE.search(line):
        seq = _STATE_SEQ.search(line)
        fields = {
            "seq": int(seq.group(1)) if seq else None,
            "last_enqueued": int(m.group(1)),
            "last_completed": int(m.group(2)),
        }
        if sig := _DUMP_FROM.search(line):
            sender = _int(sig.group(2))
            fields["peer_rank"] = "self" if sig.group(2) is None else (sender if sender is not None and sender >= 0
                                                                       else None)  # fmt: skip
        return "nccl_work_state", fields
    if _NCCL_FAILURE.search(line):
        return "nccl_failure", {}
    if _HEARTBEAT.search(line):
        return "heartbeat_timeout", {}
    if m := _STUCK.search(line):
        return "heartbeat_timeout", {"timeout_ms": int(m.group(1)) * 1000}
    if m := _GLOO_TIMEOUT.search(line):
        return "gloo_timeout", {"timeout_ms": int(m.group(1)), "op": m.group(2)}
    if m := _GLOO_CLOSED.search(line):
        return "gloo_peer_closed", {"peer": m.group(1) or m.group(2)}
    if m := _BARRIER.search(line):
        return "monitored_barrier", {
            "failed_ranks": [int(r) for r in re.split(r"\s*,\s*", m.group(1))],
            "timeout_ms": int(m.group(2)),
        }
    if fields := match_mismatch(line):
        return "collective_mismatch", fields
    if m := _WORKER.search(line):
        code = int(m.group(1))
        return "worker_failed", {
            "exit_code": code,
            "signal": _signal_name(code),
            "local_rank": int(m.group(2)),
            "pid": int(m.group(3)),
        }
    return match_recent(line)


def _event(line: str, line_no: int, file: str | None, found: tuple[str, dict] | None = None) -> LogEvent | None:
    """The event of ``line`` (``found``: its kind and fields when already matched); None for no message."""
    found = found or _match_message(line)
    if found is None:
        return None
    kind, fields = found
    if m := _PG_TAG.search(line):
        fields.setdefault("pg", m.group(1))
        fields.setdefault("rank", int(m.group(2)))
    elif m := _RANK_TAG.search(line) or _RANK_PREFIX.search(line):
        fields.setdefault("rank", int(m.group(1)))
    if "local_rank" not in fields and (m := _ROLE_PREFIX.match(line)):
        fields["local_rank"] = int(m.group(1))
    if fields.get("peer_rank") == "self":  # "dump signal ... from this local rank"
        fields["peer_rank"] = fields.get("rank")
    return LogEvent(kind, line_no, file=file, text=line.strip()[:_TEXT_MAX], **fields)


class _Parser:
    """Accumulates events over one or more files; holds the state of multi-line messages: the ChildFailedError
    summary, desync reports, stack frames, NCCL error details."""

    def __init__(self) -> None:
        self.events: list[LogEvent] = []
        self.lines = 0
        self.skipped = 0
        self._file: str | None = None
        self._file_start = 0
        self._in_block = False
        self._sections: set[str] = set()
        self._root = False  # current section is the root cause
        self._entry: LogEvent | None = None
        self._entry_text: list[str] = []
        self._tb_open = False  # inside a (possibly multi-line) traceback/msg field
        self._desync = DesyncReader()
        self._exceptions = ExceptionReader()
        self._heads: dict[str | None, tuple[int, str | None, bool]] = {}  # stream -> line that may lead a report
        self._stack: tuple[LogEvent, int] | None = None  # the stack_trace event taking frames, its last line
        self._last: tuple[LogEvent, int, str | None] | None = None  # the last event, its line and stream
        self._last_error_at: tuple[int, str | None] = (-1, None)  # an NCCL error's "Last error:" line, stream

    def begin_file(self, file: str | None) -> None:
        self._file, self._file_start = file, len(self.events)
        self._desync, self._heads, self._stack, self._last = DesyncReader(), {}, None, None
        self._exceptions = ExceptionReader()
        self._last_error_at = (-1, None)

    def end_file(self) -> None:
        self._end_block()
        self.events[self._file_start :] = sorted(self.events[self._file_start :], key=lambda e: e.line_no)

    def result(self) -> LogParse:
        return LogParse(self.events, self.lines, self.skipped)

    def feed(self, raw: str | bytes, line_no: int) -> None:
        self.lines += 1
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        line = raw.rstrip("\r\n")[:_SCAN_MAX]
        prefix = _PREFIXES.match(line)
        cut = prefix.end() if prefix else 0
        body = line[cut:].strip()
        stream = m.group(0).strip() if (m := _STREAM.match(line)) else None
        if self._in_block and self._block_line(line, body, stream, line_no):
            return
        if self._consume(line, body, stream, line_no):
            self._exceptions.close(body, stream)
            return
        if found := self._exceptions.match(body, stream, line_no):
            self._add(_event(line, line_no, self._file, found), line_no, stream)
            return
        if _CHILD_START.search(line) or (_SECTION.match(body) and body.startswith("Root Cause")):
            self._start_block()
            self._block_line(line, body, stream, line_no)
            return
        self.skipped += 1
        if _BARE_TAG.match(body) and _GLOG.search(line[:cut]):  # "[E.. ProcessGroupNCCL.cpp:N] [PG 0 Rank 3]"
            tag = _PG_TAG.search(body)
            self._heads[stream] = (line_no, tag.group(1) if tag else None, True)

    def _consume(self, line: str, body: str, stream: str | None, line_no: int) -> bool:
        """Record the message on ``line``, if it is one (or part of one): True when recognised."""
        if self._stack is not None:
            ev, last = self._stack
            if last == line_no - 1 and FRAME.match(body):
                if len(ev.stack) < _STACK_MAX:
                    ev.stack.append(body[:_TEXT_MAX])
                self._stack = ev, line_no
                return True
            self._stack = None
        if self._nccl_error_detail(body, stream, line_no):
            return True
        head = self._heads.pop(stream, None)
        lead = head is not None and head[0] == line_no - 1  # the line before leads this one
        found = self._desync.match(body, stream, head[1] if head and lead else None)
        if found is not None:
            if head and lead and head[2]:
                self.skipped -= 1  # the bare tag line was the report's first line after all
            if found[0] is not None:
                self._add(_event(line, line_no, self._file, (found[0], found[1])), line_no, stream)
            return True
        self._desync.close(stream)
        ev = _event(line, line_no, self._file)
        if ev is None:
            return False
        if ev.kind == "nccl_error_detail":
            if (last := self._last_nccl_error(stream, line_no)) is not None:
                if last.error is None or not last.error.startswith("nccl"):
                    last.error = ev.error
                self._last = last, line_no, stream
                return True  # the detail line of that NCCL error
            ev.kind = "nccl_error"
        self._add(ev, line_no, stream)
        if ev.kind == "nccl_timeout":  # before 2.0 the desync report follows the watchdog's message
            self._heads[stream] = (line_no, ev.pg, False)
        elif ev.kind == "stack_trace":
            self._stack = ev, line_no
        return True

    def _last_nccl_error(self, stream: str | None, line_no: int) -> LogEvent | None:
        """The nccl_error event of the line before, in the same stream."""
        last = self._last
        return last[0] if last and last[0].kind == "nccl_error" and last[1:] == (line_no - 1, stream) else None

    def _nccl_error_detail(self, body: str, stream: str | None, line_no: int) -> bool:
        """NCCLUtils' ``Last error:`` line after an NCCL error, and the line after it (into ``detail``)."""
        if body == "Last error:" and (last := self._last_nccl_error(stream, line_no)) is not None:
            self._last, self._last_error_at = (last, line_no, stream), (line_no, stream)
            return True
        if self._last_error_at == (line_no - 1, stream) and self._last is not None and body:
            self._last[0].detail["last_error"] = body[:_TEXT_MAX]
            self._last_error_at = (-1, None)
            return True
        return False

    def _add(self, ev: LogEvent | None, line_no: int, stream: str | None) -> None:
        if ev is not None:
            self.events.append(ev)
            self._last = ev, line_no, stream

    def _block_line(self, line: str, body: str, stream: str | None, line_no: int) -> bool:
        """Consume one line of a ChildFailedError summary; False (block closed) when it is not part of it."""
        if _SEPARATOR.match(body):
            self._close_entry()
            if {"root", "failures"} <= self._sections:
                self._end_block()
            return True
        if m := _SECTION.match(body):
            self._close_entry()
            self._root = m.group(1) is not None
            self._sections.add("root" if self._root else "failures")
            return True
        if _CHILD_START.search(line):
            self._start_block()
            return True
        if _TITLE.match(body):
            return True
        if _ENTRY.match(body):
            self._close_entry()
            self._open_entry(body, line_no)
            return True
        if (m := _FIELD.match(body)) and (self._entry is not None or self._sections):
            if self._entry is None:
                self._open_entry(body, line_no)
            else:
                self._entry_text.append(body)
            self._set_field(m.group(1), m.group(2).strip())
            return True
        if self._consume(line, body, stream, line_no):
            if not self._tb_open:
                self._end_block()
            return True
        if self._tb_open:
            return True
        self._end_block()
        return False

    def _start_block(self) -> None:
        self._end_block()
        self._in_block, self._sections, self._root = True, set(), False

    def _open_entry(self, body: str, line_no: int) -> None:
        self._entry = LogEvent("child_failed", line_no, root_cause=self._root, file=self._file)
        self._entry_text = [body]

    def _set_field(self, name: str, value: str) -> None:
        entry = self._entry
        assert entry is not None
        self._tb_open = name in ("traceback", "msg")
        if name == "host":
            entry.host = value or None
        elif name == "rank" and (m := _RANK_FIELD.match(value)):
            entry.rank, entry.local_rank = int(m.group(1)), _int(m.group(2))
        elif name == "exitcode" and (m := _EXIT_FIELD.match(value)):
            entry.exit_code, entry.pid = int(m.group(1)), _int(m.group(2))
            entry.signal = entry.signal or _signal_name(entry.exit_code)
        elif self._tb_open and (m := _SIGNAL_TEXT.search(value)):
            entry.signal = m.group(2)
            entry.pid = entry.pid if entry.pid is not None else int(m.group(3))

    def _close_entry(self) -> None:
        self._tb_open = False
        if self._entry is not None:
            self._entry.text = " | ".join(self._entry_text)[:_TEXT_MAX]
            self.events.append(self._entry)
            self._entry = None

    def _end_block(self) -> None:
        self._close_entry()
        self._in_block = False


def parse_lines(lines: Iterable[str], file: str | None = None) -> LogParse:
    """Parse log lines (with or without line endings); ``file`` is recorded on every event."""
    if isinstance(lines, str | bytes):
        lines = lines.splitlines()
    parser = _Parser()
    parser.begin_file(file)
    for line_no, line in enumerate(lines, 1):
        parser.feed(line, line_no)
    parser.end_file()
    return parser.result()


def _read_lines(fh: IO[bytes]) -> Iterator[str]:
    """Lines split on b"\\n" only, decoded leniently; an overlong line is cut at _READ_MAX bytes."""
    while raw := fh.readline(_READ_MAX):
        if not raw.endswith(b"\n"):
            while (rest := fh.readline(_READ_MAX)) and not rest.endswith(b"\n"):
                pass
        yield raw.decode("utf-8", "replace")


def parse_files(paths: Sequence[str | os.PathLike]) -> LogParse:
    """Parse several log files in order into one :class:`LogParse`; ValueError names an unreadable file."""
    parser = _Parser()
    for path in paths:
        name = os.fsdecode(path)
        parser.begin_file(name)
        try:
            with open(name, "rb") as fh:
                for line_no, line in enumerate(_read_lines(fh), 1):
                    parser.feed(line, line_no)
        except OSError as exc:
            raise ValueError(f"cannot read log file {name}: {exc.strerror or exc}") from None
        parser.end_file()
    return parser.result()
