"""Parsing PyTorch distributed failure messages from torchrun / worker logs, across PyTorch versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stragglerwatch.evidence.logevent import LogEvent
from stragglerwatch.evidence.torchlogs import LogParse, parse_files, parse_lines

REAL = Path(__file__).resolve().parent / "data" / "pytorch-logs" / "real-excerpts.log"


def one(line: str) -> LogEvent:
    parsed = parse_lines([line])
    assert len(parsed.events) == 1, parsed
    assert parsed.skipped == 0
    return parsed.events[0]


# --- the real excerpts --------------------------------------------------------------------------------------------


@pytest.fixture
def real() -> LogParse:
    return parse_files([REAL])


def test_real_excerpts(real: LogParse) -> None:
    assert (real.lines, real.skipped) == (4, 0)
    assert [e.kind for e in real.events] == ["nccl_timeout", "nccl_work_state", "nccl_failure", "worker_failed"]
    timeout, state, failure, worker = real.events
    assert (timeout.rank, timeout.pg, timeout.seq, timeout.op) == (0, None, 1580, "ALLREDUCE")
    assert (timeout.numel_in, timeout.numel_out) == (466119168, 466119168)
    assert (timeout.timeout_ms, timeout.ran_for_ms, timeout.line_no) == (600000, 600060, 1)
    assert timeout.file == str(REAL) and timeout.text.startswith("[rank0]:[E321 02:07:08.408271257")
    assert (state.rank, state.pg, state.seq, state.last_enqueued, state.last_completed) == (0, "1", 1580, 1582, 1579)
    assert (failure.rank, failure.line_no) == (3, 3)
    assert (worker.exit_code, worker.signal, worker.local_rank, worker.pid, worker.rank) == (
        -6,
        "SIGABRT",
        0,
        970611,
        None,
    )
    assert real.first_failure() == {
        "rank": 0,
        "ranks": [0],
        "pg": "1",
        "seq": 1580,
        "op": "ALLREDUCE",
        "kind": "nccl_timeout",
        "rule": "first timeout",
        "line_no": 1,
        "file": str(REAL),
    }


# --- NCCL watchdog timeouts across versions -----------------------------------------------------------------------

WORK = "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000)"


@pytest.mark.parametrize(
    ("line", "rank", "pg", "seq", "op", "numel", "timeout", "ran_for"),
    [
        (  # 2.2+: glog header with nanoseconds, NumelIn/NumelOut
            f"[rank7]:[E1129 10:11:12.123456 ProcessGroupNCCL.cpp:563] [Rank 7] Watchdog caught collective "
            f"operation timeout: {WORK} ran for 882722 milliseconds before timing out.",
            7,
            None,
            42,
            "ALLREDUCE",
            1024,
            600000,
            882722,
        ),
        (  # 2.3: [PG N Rank R] tag, no [rankN]: prefix
            f"[E ProcessGroupNCCL.cpp:1316] [PG 1 Rank 0] Watchdog caught collective operation timeout: {WORK} "
            "ran for 600123 milliseconds before timing out.",
            0,
            "1",
            42,
            "ALLREDUCE",
            1024,
            600000,
            600123,
        ),
        (  # PG with description
            "[PG 0 (default_pg) Rank 7] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, "
            "OpType=BROADCAST, NumelIn=8, NumelOut=8, Timeout(ms)=1000) ran for 1001 milliseconds before timing out.",
            7,
            "0",
            3,
            "BROADCAST",
            8,
            1000,
            1001,
        ),
        (  # 2.4+: PG ID / PG GUID tag
            "[rank5]:[E1129 10:11:12.123456789 ProcessGroupNCCL.cpp:616] [PG ID 0 PG GUID 0(default_pg) Rank 5] "
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=_ALLGATHER_BASE, "
            "NumelIn=4, NumelOut=32, Timeout(ms)=30000) ran for 30086 milliseconds before timing out.",
            5,
            "0",
            9,
            "_ALLGATHER_BASE",
            4,
            30000,
            30086,
        ),
        (  # 1.12-2.1: no NumelIn/NumelOut, old glog header
            "[E ProcessGroupNCCL.cpp:828] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1805244 milliseconds before timing out.",
            1,
            None,
            5,
            "BROADCAST",
            None,
            1800000,
            1805244,
        ),
        (  # ~1.10: TensorShape with commas inside the payload
            "[E ProcessGroupNCCL.cpp:587] [Rank 2] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=11, OpType=ALLGATHER, TensorShape=[1024, 10], Timeout(ms)=60000) ran for 60410 "
            "milliseconds before timing out.",
            2,
            None,
            11,
            "ALLGATHER",
            None,
            60000,
            60410,
        ),
        (  # oldest: no SeqNum, rank only from the torchrun prefix
            "[rank3]:Caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE, Timeout(ms)=1800000) "
            "ran for 1806760 milliseconds before timing out.",
            3,
            None,
            None,
            "ALLREDUCE",
            None,
            1800000,
            1806760,
        ),
    ],
)
def test_nccl_timeout_variants(line, rank, pg, seq, op, numel, timeout, ran_for) -> None:
    e = one(line)
    assert e.kind == "nccl_timeout"
    assert (e.rank, e.pg, e.seq, e.op, e.numel_in, e.timeout_ms, e.ran_for_ms) == (
        rank,
        pg,
        seq,
        op,
        numel,
        timeout,
        ran_for,
    )


def test_blocking_wait_timeout() -> None:
    e = one(f"[PG 2 Rank 4] Work {WORK} timed out in blocking wait (TORCH_NCCL_BLOCKING_WAIT=1).")
    assert (e.kind, e.rank, e.pg, e.seq, e.op, e.timeout_ms, e.ran_for_ms) == (
        "nccl_timeout",
        4,
        "2",
        42,
        "ALLREDUCE",
        600000,
        None,
    )


@pytest.mark.parametrize(
    ("line", "rank", "pg", "seq", "enqueued", "completed"),
    [
        (  # ~2.2/2.3
            "[E ProcessGroupNCCL.cpp:1537] [Rank 2] Timeout at NCCL work: 77, last enqueued NCCL work: 78, "
            "last completed NCCL work: 76.",
            2,
            None,
            77,
            78,
            76,
        ),
        (  # ~2.4
            "[rank1]:[E1129 10:11:12.1 ProcessGroupNCCL.cpp:1664] [PG 0 (default_pg) Rank 1] Exception (either an "
            "error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 12, last completed NCCL "
            "work: 11.",
            1,
            "0",
            12,
            12,
            11,
        ),
        (  # 2.6+
            "[PG ID 0 PG GUID 0(default_pg) Rank 1]  failure detected by watchdog at work sequence id: 9 PG status: "
            "last enqueued work: 9, last completed work: 8",
            1,
            "0",
            9,
            9,
            8,
        ),
        (  # a rank that got the dump signal: PG status without a work sequence number
            "[PG ID 0 PG GUID 0(default_pg) Rank 3] Received a dump signal due to a collective timeout from rank 0 "
            "and we will try our best to dump the debug info. Last enqueued NCCL work: 41, last completed NCCL "
            "work: 41.This is most likely caused by incorrect usages of collectives",
            3,
            "0",
            None,
            41,
            41,
        ),
    ],
)
def test_nccl_work_state_variants(line, rank, pg, seq, enqueued, completed) -> None:
    e = one(line)
    assert e.kind == "nccl_work_state"
    assert (e.rank, e.pg, e.seq, e.last_enqueued, e.last_completed) == (rank, pg, seq, enqueued, completed)


def test_nccl_failure_and_heartbeat() -> None:
    failure = one("[E ProcessGroupNCCL.cpp:475] [Rank 6] Some NCCL operations have failed or timed out.")
    assert (failure.kind, failure.rank) == ("nccl_failure", 6)
    hb = one(
        "[rank0]:[E1129 10:11:12.1 ProcessGroupNCCL.cpp:1395] [PG 0 Rank 0] Heartbeat monitor timed out! "
        "Process will be terminated after dumping debug info. workMetaList_.size()=1"
    )
    assert (hb.kind, hb.rank, hb.pg, hb.timeout_ms) == ("heartbeat_timeout", 0, "0", None)
    stuck = one(
        "[PG ID 0 PG GUID 0(default_pg) Rank 2] ProcessGroupNCCL's watchdog got stuck for 480 seconds without "
        "making progress in monitoring enqueued collectives."
    )
    assert (stuck.kind, stuck.rank, stuck.timeout_ms) == ("heartbeat_timeout", 2, 480000)


# --- gloo and monitored_barrier -----------------------------------------------------------------------------------


def test_gloo() -> None:
    recv = one(
        "[rank1]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:84] "
        "Timed out waiting 1800000ms for recv operation to complete"
    )
    assert (recv.kind, recv.rank, recv.op, recv.timeout_ms) == ("gloo_timeout", 1, "recv", 1800000)
    send = one(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:136] "
        "Timed out waiting 5000ms for send operation to complete"
    )
    assert (send.op, send.timeout_ms, send.rank) == ("send", 5000, None)
    closed = one(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.1]:1234"
    )
    assert (closed.kind, closed.peer) == ("gloo_peer_closed", "[10.0.0.1]:1234")


def test_monitored_barrier() -> None:
    single = one("RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms")
    assert (single.kind, single.rank, single.failed_ranks, single.timeout_ms) == ("monitored_barrier", 0, [1], 2000)
    many = one("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 30000 ms")
    assert (many.rank, many.failed_ranks, many.timeout_ms) == (0, [1, 2], 30000)


# --- torchrun ------------------------------------------------------------------------------------------------------

CHILD_FAILED = """\
Traceback (most recent call last):
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2024-05-17_08:24:03
  host      : node-b
  rank      : 5 (local_rank: 1)
  exitcode  : 1 (pid: 970612)
  error_file: /tmp/torchelastic_x/error.json
  traceback : Traceback (most recent call last):
    File "/app/train.py", line 10, in main
      dist.all_reduce(t)
  RuntimeError: [Rank 5] Watchdog caught collective operation timeout: {WORK8}
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-17_08:24:03
  host      : node-a
  rank      : 4 (local_rank: 0)
  exitcode  : -6 (pid: 970611)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 970611
============================================================
some unrelated line after the summary
""".replace(
    "{WORK8}", "WorkNCCL(SeqNum=8, OpType=ALLREDUCE, Timeout(ms)=100) ran for 101 milliseconds before timing out."
)


def test_child_failed_summary() -> None:
    parsed = parse_lines(CHILD_FAILED.splitlines(), file="torchrun.log")
    kinds = [(e.kind, e.line_no) for e in parsed.events]
    assert kinds == [("child_failed", 8), ("nccl_timeout", 17), ("child_failed", 20)]
    failure, timeout, root = parsed.events
    assert (failure.root_cause, failure.rank, failure.local_rank, failure.host) == (False, 5, 1, "node-b")
    assert (failure.exit_code, failure.pid, failure.signal) == (1, 970612, None)
    assert (timeout.rank, timeout.seq) == (5, 8)
    assert (root.root_cause, root.rank, root.local_rank, root.host) == (True, 4, 0, "node-a")
    assert (root.exit_code, root.pid, root.signal, root.file) == (-6, 970611, "SIGABRT", "torchrun.log")
    assert root.text.startswith("[0]: | time")
    assert parsed.skipped == 3  # the two traceback lines before the summary and the unrelated line
    assert parsed.lines == len(CHILD_FAILED.splitlines())


def test_child_failed_no_other_failures_and_old_layout() -> None:
    new = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-17_08:24:03
  host      : gpu-7
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 42)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 42
============================================================"""
    parsed = parse_lines(new.splitlines())
    assert parsed.skipped == 0 and len(parsed.events) == 1
    (root,) = parsed.events
    assert (root.root_cause, root.rank, root.host, root.exit_code, root.signal, root.line_no) == (
        True,
        3,
        "gpu-7",
        -9,
        "SIGKILL",
        9,
    )
    assert parsed.first_failure() == {
        "rank": 3,
        "ranks": [3],
        "pg": None,
        "seq": None,
        "op": None,
        "kind": "child_failed",
        "rule": "root cause",
        "line_no": 9,
        "file": None,
    }
    old = """\
*****************************************
               train.py FAILED
=========================================
Root Cause:
[0]:
  time: 2021-10-01_12:00:00
  rank: 0 (local_rank: 0)
  exitcode: 1 (pid: 123)
  error_file: <N/A>
  msg: "Process failed with exitcode 1"
=========================================
Other Failures:
[1]:
  time: 2021-10-01_12:00:01
  rank: 1 (local_rank: 1)
  exitcode: -15 (pid: 124)
  error_file: <N/A>
  msg: "Signal 15 (SIGTERM) received by PID 124"
*****************************************"""
    parsed = parse_lines(old.splitlines())
    assert [(e.rank, e.root_cause, e.exit_code, e.signal) for e in parsed.events] == [
        (0, True, 1, None),
        (1, False, -15, "SIGTERM"),
    ]
    assert parsed.skipped == 3  # the banner before "Root Cause:" is not recognisable on its own


def test_worker_failed_variants() -> None:
    old = one(
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 2 (pid: 77) "
        "of binary: /usr/bin/python"
    )
    assert (old.kind, old.exit_code, old.signal, old.local_rank, old.pid) == ("worker_failed", 1, None, 2, 77)
    sig = one(
        "E0101 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:881] failed (exitcode: -9) "
        "local_rank: 1 (pid: 5) of binary: python"
    )
    assert sig.signal == "SIGKILL"


# --- first_failure ------------------------------------------------------------------------------------------------


def test_first_failure_names_the_rank_that_never_issued_the_collective() -> None:
    lines = [
        f"[rank{r}]:[E1129 10:11:12.1 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation "
        f"timeout: {WORK} ran for 600100 milliseconds before timing out."
        for r in range(3)
    ]
    lines += [
        f"[rank{r}]:[E1129 10:11:12.2 ProcessGroupNCCL.cpp:1664] [PG 0 (default_pg) Rank {r}] Exception (either an "
        "error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41."
        for r in range(3)
    ]
    lines.append(
        "[rank3]:[E1129 10:11:13.0 ProcessGroupNCCL.cpp:1400] [PG 0 (default_pg) Rank 3] Received a dump signal due "
        "to a collective timeout from rank 0 and we will try our best to dump the debug info. Last enqueued NCCL "
        "work: 41, last completed NCCL work: 41."
    )
    parsed = parse_lines(lines, file="job.log")
    assert parsed.skipped == 0
    assert parsed.first_failure() == {
        "rank": 3,
        "ranks": [3],
        "pg": "0",
        "seq": 42,
        "op": "ALLREDUCE",
        "kind": "nccl_work_state",
        "rule": "behind",
        "line_no": 7,
        "file": "job.log",
    }
    # without rank 3's status line, the earliest timed-out rank is the answer
    parsed = parse_lines(lines[:-1])
    assert parsed.first_failure() == {
        "rank": 0,
        "ranks": [0],
        "pg": "0",
        "seq": 42,
        "op": "ALLREDUCE",
        "kind": "nccl_timeout",
        "rule": "first timeout",
        "line_no": 1,
        "file": None,
    }


def test_first_failure_lowest_seq_and_fallbacks() -> None:
    msg = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum={}, OpType={}, Timeout(ms)=1) ran for 2 ms"
    later = "[Rank 1] " + msg.format(50, "BROADCAST").replace(" ms", " milliseconds before timing out.")
    earlier = "[Rank 2] " + msg.format(49, "REDUCE").replace(" ms", " milliseconds before timing out.")
    ff = parse_lines([later, earlier]).first_failure()
    assert ff is not None and (ff["rank"], ff["seq"], ff["op"], ff["line_no"]) == (2, 49, "REDUCE", 2)
    ff = parse_lines(["noise", "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms"]).first_failure()
    assert ff is not None and (ff["ranks"], ff["kind"], ff["rule"]) == ([1], "monitored_barrier", "monitored barrier")
    assert parse_lines(["nothing to see", ""]).first_failure() is None
    assert parse_lines([]).first_failure() is None


# --- robustness ---------------------------------------------------------------------------------------------------


def test_garbage_is_skipped_never_fatal(tmp_path: Path) -> None:
    junk = tmp_path / "junk.log"
    junk.write_bytes(
        b"\x00\xff\xfe binary \x80\x81\n"
        + b"A" * 3_000_000
        + b"\n"
        + b"[rank1]:[E ProcessGroupNCCL.cpp:1] [Rank 1] Some NCCL operations have failed or timed out.\xff\r\n"
        + b"[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=x, OpType=, Timeout(ms)=) ran for"
        + b"\n"
        + b"Timed out waiting ms for recv operation\n"
        + b"Root Cause (first observed failure):\n"
        + b"   \n"
    )
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    parsed = parse_files([junk, empty])
    assert parsed.lines == 7
    assert [e.kind for e in parsed.events] == ["nccl_failure", "nccl_timeout"]
    assert parsed.events[0].rank == 1 and parsed.events[0].line_no == 3
    broken = parsed.events[1]
    assert (broken.seq, broken.op, broken.timeout_ms, broken.ran_for_ms) == (None, None, None, None)
    assert parsed.skipped == 4  # binary, the 3 MB line, the half gloo line, the blank line (the header is consumed)
    long = parse_lines(["x" * 10_000 + " [Rank 9] Heartbeat monitor timed out!"])
    assert long.events[0].rank == 9 and len(long.events[0].text) == 500
    assert parse_lines("line one\nline two").lines == 2  # a plain string is split, not iterated by character
    assert parse_files([empty]).events == []


def test_unreadable_file_raises_value_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-rank.log"
    with pytest.raises(ValueError, match="no-such-rank.log"):
        parse_files([missing])
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        parse_files([tmp_path])  # a directory


def test_to_dict_and_multiple_files(tmp_path: Path) -> None:
    a, b = tmp_path / "rank0.log", tmp_path / "rank1.log"
    a.write_text("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms\n")
    b.write_text("hello\nConnection closed by peer [::1]:29500\n")
    parsed = parse_files([a, str(b)])
    assert (parsed.lines, parsed.skipped) == (3, 1)
    first, second = (e.to_dict() for e in parsed.events)
    assert first["failed_ranks"] == [1, 2] and first["file"] == str(a) and first["line_no"] == 1
    assert second["peer"] == "[::1]:29500" and second["file"] == str(b) and second["line_no"] == 2
    assert set(first) >= {"kind", "rank", "pg", "seq", "op", "numel_in", "numel_out", "timeout_ms", "ran_for_ms"}


def test_gloo_connection_reset_as_seen_in_a_gloo_job() -> None:
    line = (
        "[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:38553: Connection reset by peer. This is typically caused by a remote worker"
    )
    (ev,) = parse_lines([line]).events
    assert (ev.kind, ev.rank, ev.peer) == ("gloo_peer_closed", 1, "[127.0.0.1]:38553")


def test_analyze_cli_reads_pytorch_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from stragglerwatch.cli.commands import main as cli

    log = tmp_path / "job.log"
    log.write_text(
        "\n".join(
            [
                "random banner \x00 garbage",
                "[rank0]:[E1129 10:00:01.000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
                "timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=10, NumelOut=10, Timeout(ms)=600000) "
                "ran for 600021 milliseconds before timing out.",
                "[rank3]:[E1129 10:00:02.000 ProcessGroupNCCL.cpp:1400] [PG 0 (default_pg) Rank 3] Received a dump "
                "signal due to a collective timeout from rank 0 and we will try our best to dump the debug info. "
                "Last enqueued NCCL work: 41, last completed NCCL work: 41.",
            ]
        )
    )
    assert cli(["analyze", "--logs", str(log), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["first_failure"]["rank"] == 3 and report["first_failure"]["seq"] == 42
    assert report["first_failure"]["op"] == "ALLREDUCE"
    assert report["log_skipped_lines"] == 1 and len(report["log_events"]) == 2
    for e in report["log_events"]:
        assert {"kind", "rank", "pg", "seq", "op", "timeout_ms", "ran_for_ms", "line_no"} <= set(e)
    assert cli(["analyze", "--logs", str(log)]) == 0
    assert "first failure: rank(s) 3, collective SeqNum 42 ALLREDUCE" in capsys.readouterr().out
    assert cli(["analyze", "--logs", str(tmp_path / "missing.log")]) == 2
    assert "missing.log" in capsys.readouterr().err


# --- TORCH_DISTRIBUTED_DEBUG=DETAIL fingerprint mismatches (real output, see the fixtures' README) ------------------

DATA = REAL.parent
GENERATE = DATA / "generate.py"


def test_real_mismatch_4_ranks_names_the_odd_rank_out() -> None:
    log = DATA / "detail-mismatch-op-4ranks.log"
    parsed = parse_files([log])
    assert (parsed.lines, parsed.skipped) == (103, 62)  # the ranks' and torchrun's tracebacks, one SIGTERM warning
    mismatches = [e for e in parsed.events if e.kind == "collective_mismatch"]
    assert [(e.rank, e.peer_rank, e.op, e.peer_op) for e in mismatches] == [
        (1, 3, "ALLREDUCE", "BROADCAST"),
        (0, 3, "ALLREDUCE", "BROADCAST"),
        (2, 3, "ALLREDUCE", "BROADCAST"),
        (3, 0, "BROADCAST", "ALLREDUCE"),
    ]
    for e in mismatches:
        assert (e.seq, e.peer_seq, e.differs) == (1, 1, ["op"])
        assert e.detail == {"shape": "[4]", "dtype": "Float", "device": "cpu", "peer_shape": "[4]",
                            "peer_dtype": "Float", "peer_device": "cpu"}  # fmt: skip
    assert [e.kind for e in parsed.events[4:]] == ["worker_failed"] + ["child_failed"] * 4
    # torchrun's root cause is rank 0, but three ranks name rank 3 as the one running another collective
    assert parsed.first_failure() == {"rank": 3, "ranks": [3], "pg": None, "seq": 1, "op": "BROADCAST",
                                      "kind": "collective_mismatch", "rule": "collective mismatch",
                                      "line_no": 12, "file": str(log)}  # fmt: skip
    assert "/work/" not in log.read_text() and "/tmp/" not in log.read_text()


def test_real_mismatch_shape_dtype_and_barrier_lines() -> None:
    lines = (DATA / "detail-mismatch-excerpts.log").read_text().splitlines()
    shape, dtype, barrier = (parse_lines(lines[i : i + 2]) for i in (0, 2, 4))
    a, b = shape.events
    assert (a.rank, a.peer_rank, a.seq, a.op, a.differs) == (1, 0, 1, "ALLREDUCE", ["shape"])
    assert (a.detail["shape"], a.detail["peer_shape"], b.detail["shape"]) == ("[4, 5]", "[4, 3]", "[4, 3]")
    # two ranks naming each other: either may be the odd one, both are listed
    ff = shape.first_failure()
    assert ff is not None and (ff["rank"], ff["ranks"], ff["kind"], ff["op"]) == (0, [0, 1], "collective_mismatch",
                                                                                  "ALLREDUCE")  # fmt: skip
    x, y = dtype.events
    assert (x.rank, x.differs, x.detail["dtype"], x.detail["peer_dtype"]) == (0, ["dtype"], "Float", "Double")
    assert (y.rank, y.detail["dtype"]) == (1, "Double")
    # barrier() has no tensors: "SequenceNumber=1OpType=BARRIER"; the peer side is decoded from the wrong tensor
    reduce_side, barrier_side = barrier.events
    assert (barrier_side.rank, barrier_side.seq, barrier_side.op, barrier_side.peer_op) == (1, 1, "BARRIER", "GATHER")
    assert barrier_side.differs == ["seq", "op"] and barrier_side.detail == {}
    assert (reduce_side.op, reduce_side.peer_op, reduce_side.peer_seq) == ("ALLREDUCE", "REDUCE", 0)
    assert reduce_side.differs == ["seq", "op", "shape", "dtype", "device"]
    assert shape.skipped == dtype.skipped == barrier.skipped == 0


@pytest.mark.parametrize(
    ("line", "rank", "peer", "seq", "op", "peer_op", "differs"),
    [
        (  # about 1.11-2.0: both fingerprints, no SequenceNumber, no aspects (from a user's report)
            "RuntimeError: Detected mismatch between collectives on ranks. Rank 3 is running collective: "
            "CollectiveFingerPrint(OpType=BARRIER), but Rank 0 is running collective: "
            "CollectiveFingerPrint(OpType=ALLGATHER_COALESCED).",
            3, 0, None, "BARRIER", "ALLGATHER_COALESCED", ["op"],
        ),
        (  # the same era with tensors and TensorOptions devices
            "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "OpType=ALLGATHER, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float "
            "(default), device=cuda, layout=Strided (default))), but Rank 2 is running collective: "
            "CollectiveFingerPrint(OpType=ALLGATHER, TensorShape=[8], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda, layout=Strided (default))).",
            0, 2, None, "ALLGATHER", "ALLGATHER", ["shape"],
        ),
        (  # 1.9/1.10: one fingerprint, no second rank
            "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running inconsistent "
            "collective: CollectiveFingerPrint(OpType=ALLREDUCE, TensorShape=[20, 10], TensorDtypes=Float, "
            "TensorDeviceTypes=CPU",
            1, None, None, "ALLREDUCE", None, [],
        ),
    ],
)  # fmt: skip
def test_mismatch_older_releases(line, rank, peer, seq, op, peer_op, differs) -> None:
    e = one(line)
    assert e.kind == "collective_mismatch"
    assert (e.rank, e.peer_rank, e.seq, e.op, e.peer_op, e.differs) == (rank, peer, seq, op, peer_op, differs)


def test_real_monitored_barrier_under_detail() -> None:
    parsed = parse_files([DATA / "detail-monitored-barrier-hang.log"])
    barriers = [e for e in parsed.events if e.kind == "monitored_barrier"]
    assert [(e.rank, e.failed_ranks, e.timeout_ms) for e in barriers] == [(0, [1], 20000)] * 3
    late = next(e for e in parsed.events if e.kind == "child_failed" and not e.root_cause)
    assert (late.rank, late.exit_code, late.signal) == (1, -15, "SIGTERM")


@pytest.mark.distributed
def test_mismatch_from_this_torch(tmp_path: Path) -> None:
    """The installed torch still prints a mismatch this module reads (2 gloo ranks, DETAIL)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(GENERATE),
           "worker", "op"]  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode != 0
    parsed = parse_lines(run.stderr.splitlines() + run.stdout.splitlines())
    mismatches = {e.rank: e for e in parsed.events if e.kind == "collective_mismatch"}
    assert set(mismatches) == {0, 1}, run.stderr[-3000:]
    assert (mismatches[1].op, mismatches[1].peer_rank, mismatches[1].peer_op) == ("BROADCAST", 0, "ALLREDUCE")
    assert mismatches[0].differs == ["op"] and mismatches[0].seq == mismatches[0].peer_seq is not None


# --- NCCL desync report (TORCH_NCCL_DESYNC_DEBUG=1) ----------------------------------------------------------------

DESYNC = [  # rank 5 times out in #41208; rank 47 is stuck in #41207; ranks 0-2 finished it but never went on
    "\t - [5] Timeout at collective: ALLREDUCE, #41208",
    "\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
    "\t   - [47] joined but didn't finish collective #41207 (count from 1)",
    "\t     [0, 1, 2] finished collective #41207, but didn't join collective #41208 (count from 1)",
    "\t - Snapshot of ranks' latest states:",
    "\t   #41207 started ranks:",
    "\t     [47] started ALLREDUCE",
    "\t   #41207 finished ranks:",
    "\t     [0, 1, 2] finished ALLREDUCE",
    "\t   #41208 started ranks:",
    "\t     [3, 4, 5, 6] started ALLREDUCE",
]
MISSING = [
    "\t - [0] Timeout at collective: ALLREDUCE, #6",
    "\t - To our best knowledge, ranks [1, 3] are the lagging ranks that caused this timeout. They never joined "
    "any collectives",
]


def _prefixed(style: str, lines: list[str], rank: int) -> list[str]:
    if style == "torchrun":
        return [f"[rank{rank}]:{line}" for line in lines]
    if style == "glog":
        return [f"[E1129 10:11:12.123456789 ProcessGroupNCCL.cpp:1750] {line}" for line in lines]
    if style == "glog-google":
        return [f"E1129 10:11:12.123456 4242 ProcessGroupNCCL.cpp:1750] {line}" for line in lines]
    if style == "torchrun+glog":
        return [f"[rank{rank}]:[E1129 10:11:12.1 ProcessGroupNCCL.cpp:1750] {line}" for line in lines]
    if style == "stripped":
        return [line.strip() for line in lines]
    return list(lines)


STYLES = ["raw", "torchrun", "glog", "glog-google", "torchrun+glog", "stripped"]


@pytest.mark.parametrize("style", STYLES)
def test_desync_report_lagging_ranks(style: str) -> None:
    parsed = parse_lines(["garbage before"] + _prefixed(style, DESYNC, 5) + ["garbage after"])
    assert parsed.skipped == 2, [e.kind for e in parsed.events]
    summary = [(e.kind, e.rank, e.seq, e.op, e.failed_ranks, e.ranks) for e in parsed.events]
    assert summary == [
        ("desync_timeout", 5, 41208, "ALLREDUCE", [], []),
        ("desync_lagging", 5, 41207, None, [47], []),
        ("desync_finished", 5, 41207, None, [0, 1, 2], []),
        ("desync_snapshot", 5, 41207, "ALLREDUCE", [], [47]),
        ("desync_snapshot", 5, 41207, "ALLREDUCE", [], [0, 1, 2]),
        ("desync_snapshot", 5, 41208, "ALLREDUCE", [], [3, 4, 5, 6]),
    ]
    assert [e.detail for e in parsed.events[3:]] == [{"state": "started"}, {"state": "finished"}, {"state": "started"}]
    # the rank still inside #41207 is the furthest behind: it, not rank 5 that timed out, is the culprit
    assert parsed.first_failure() == {"rank": 47, "ranks": [47], "pg": None, "seq": 41207, "op": "ALLREDUCE",
                                      "kind": "desync_lagging", "rule": "desync report",
                                      "line_no": 4, "file": None}  # fmt: skip


@pytest.mark.parametrize("style", STYLES)
def test_desync_report_missing_ranks(style: str, tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes("\r\n".join(_prefixed(style, MISSING, 0)).encode() + b"\r\n")  # CRLF
    parsed = parse_files([log])
    assert (parsed.lines, parsed.skipped) == (2, 0)
    timeout, missing = parsed.events
    assert (timeout.kind, timeout.rank, timeout.seq, timeout.op) == ("desync_timeout", 0, 6, "ALLREDUCE")
    assert (missing.kind, missing.rank, missing.failed_ranks, missing.seq, missing.op) == (
        "desync_missing", 0, [1, 3], 6, "ALLREDUCE")  # fmt: skip
    assert parsed.first_failure() == {"rank": 1, "ranks": [1, 3], "pg": None, "seq": 6, "op": "ALLREDUCE",
                                      "kind": "desync_missing", "rule": "desync report",
                                      "line_no": 2, "file": str(log)}  # fmt: skip


def test_desync_first_failure_among_other_messages() -> None:
    timeouts = [
        f"[rank{r}]:[E1129 10:11:12.1 ProcessGroupNCCL.cpp:1690] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Watchdog "
        f"caught collective operation timeout: WorkNCCL(SeqNum=100, OpType=ALLGATHER, NumelIn=8, NumelOut=32, "
        f"Timeout(ms)=600000) ran for 600{r}00 milliseconds before timing out."
        for r in (2, 0, 1)
    ]
    report = [  # rank 0's report, led by a glog line that carries only its tag
        "[rank0]:[E1129 10:11:12.2 ProcessGroupNCCL.cpp:1750] [PG ID 0 PG GUID 0(default_pg) Rank 0]",
        "[rank0]:\t - [0] Timeout at collective: ALLGATHER, #100",
        "[rank0]:\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
        "[rank0]:\t     [3] finished collective #99, but didn't join collective #100 (count from 1)",
        "[rank0]:\t - Snapshot of ranks' latest states:",
        "[rank0]:\t   #99 finished ranks:",
        "[rank0]:\t     [3] finished ALLREDUCE",
        "[rank0]:\t   #100 started ranks:",
        "[rank0]:\t     [0, 1, 2] started ALLGATHER",
    ]
    lines = ["\x00 noise", *timeouts, "[rank1]: some unrelated line", *report, "[rank3]: Epoch 3 done", ""]
    parsed = parse_lines(lines, file="job.log")
    assert parsed.skipped == 4  # noise, the unrelated line, the epoch line, the blank line (the tag line led a report)
    assert [e.rank for e in parsed.events if e.kind == "nccl_timeout"] == [2, 0, 1]
    finished = next(e for e in parsed.events if e.kind == "desync_finished")
    assert (finished.rank, finished.pg, finished.seq, finished.failed_ranks) == (0, "0", 99, [3])
    # rank 2 timed out first, but rank 3 never joined #100: the report names it
    assert parsed.first_failure() == {"rank": 3, "ranks": [3], "pg": "0", "seq": 100, "op": "ALLGATHER",
                                      "kind": "desync_finished", "rule": "desync report",
                                      "line_no": 9, "file": "job.log"}  # fmt: skip
    without = parse_lines([*timeouts, report[0], report[1]])
    ff = without.first_failure()  # no verdict lines: the earliest timeout, as before
    assert ff is not None and (ff["rank"], ff["kind"], ff["seq"]) == (2, "nccl_timeout", 100)
    assert without.skipped == 0


def test_desync_reports_of_two_ranks_interleaved() -> None:
    a = _prefixed("torchrun", DESYNC, 5)
    b = _prefixed("torchrun", MISSING[:1] + DESYNC[1:4], 6)
    b[0] = b[0].replace("[0] Timeout at collective: ALLREDUCE, #6", "[6] Timeout at collective: ALLREDUCE, #41208")
    b[2] = b[2].replace("[47] joined but didn't finish collective #41207", "[47] joined but didn't finish "
                        "collective #41206")  # fmt: skip
    lines = [x for pair in zip(a, b, strict=False) for x in pair] + a[len(b) :]
    parsed = parse_lines(lines)
    assert parsed.skipped == 0
    lagging = [(e.rank, e.seq) for e in parsed.events if e.kind == "desync_lagging"]
    assert lagging == [(5, 41207), (6, 41206)]
    assert all(e.rank == 5 for e in parsed.events if e.kind == "desync_snapshot")
    ff = parsed.first_failure()  # the report that sees rank 47 furthest behind decides
    assert ff is not None and (ff["ranks"], ff["seq"], ff["line_no"]) == ([47], 41206, 6)


def test_desync_lines_without_a_report_and_garbage() -> None:
    parsed = parse_lines([
        "[47] started ALLREDUCE",  # a snapshot line outside a report means nothing
        "#41207 started ranks:",
        "\t     [2, 9] finished collective #7, but didn't join collective #8 (count from 1)",
        "\t - [x] Timeout at collective: ALLREDUCE, #",
        "ranks [] are the lagging ranks that caused this timeout.",
    ])  # fmt: skip
    assert [e.kind for e in parsed.events] == ["desync_finished", "desync_missing"]
    assert parsed.events[0].failed_ranks == [2, 9] and parsed.events[1].failed_ranks == []
    assert parsed.skipped == 3
    ff = parsed.first_failure()
    assert ff is not None and (ff["ranks"], ff["seq"], ff["kind"]) == ([2, 9], 8, "desync_finished")


# --- Flight Recorder, NCCL library and c10d store messages ---------------------------------------------------------

PG3 = "[rank3]:[E709 17:05:38.482119928 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank 3] "


@pytest.mark.parametrize(
    ("line", "kind", "fields"),
    [
        (PG3 + "Received a dump signal due to a collective timeout from  rank 7 and we will try our best to dump "
         "the debug info. Last enqueued NCCL work: 56116, last completed NCCL work: 56116.This is most likely caused",
         "nccl_work_state", {"rank": 3, "peer_rank": 7, "last_enqueued": 56116, "last_completed": 56116}),
        (PG3 + "Received a dump signal due to a collective timeout from this local rank and we will try our best to "
         "dump the debug info. Last enqueued NCCL work: 20589, last completed NCCL work: 20584.",
         "nccl_work_state", {"rank": 3, "peer_rank": 3, "last_completed": 20584}),
        (PG3 + "Observed flight recorder dump signal from another rank via TCPStore.", "dump_signal_observed",
         {"rank": 3, "pg": "0"}),
        (PG3 + "First PG on this rank to signal dumping.", "dump_signal_sent", {"rank": 3}),
        (PG3 + "ProcessGroupNCCL preparing to dump debug info. Include stack trace: 1, only active collectives: 0",
         "dump_start", {"rank": 3}),
        ("[rank3]:I0709 17:05:39.1 4242 NCCLUtils.cpp:300] Finished writing Flight Recorder debug info to "
         "/tmp/nccl_trace_rank_3", "dump_written", {"rank": 3, "path": "/tmp/nccl_trace_rank_3"}),
        ("[E NCCLUtils.cpp:280] Error opening file for writing Flight Recorder debug info: /ro/nccl_trace_rank_0",
         "dump_error", {"path": "/ro/nccl_trace_rank_0"}),
        ("[rank0]:[E709 17:05:38.162832798 ProcessGroupNCCL.cpp:670] Stack trace of the failed collective not "
         "found, potentially because FlightRecorder is disabled. You can enable it by setting "
         "TORCH_NCCL_TRACE_BUFFER_SIZE to a non-zero value.", "stack_trace_missing", {"rank": 0}),
        ("[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 1] ProcessGroupNCCL's watchdog detected a collective timeout "
         "from the local rank. This is most likely caused by incorrect usages of collectives",
         "watchdog_exit", {"rank": 1, "error": "local rank"}),
        (PG3 + "Terminating the process after attempting to dump debug info, due to collective timeout or "
         "exception.", "watchdog_exit", {"rank": 3, "error": "collective timeout or exception"}),
        ("[rank2]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 2. Original reason "
         "for failure was: NCCL error: unhandled system error", "nccl_aborted",
         {"rank": 2, "error": "NCCL error: unhandled system error"}),
        ("[rank3]: torch.distributed.DistBackendError: [3] is setting up NCCL communicator and retrieving "
         "ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: Socket Timeout",
         "store_timeout", {"rank": 3, "peer_rank": 0, "error": "Socket Timeout"}),
        ("[5] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key "
         "'0', but store->get('0') got error: wait timeout after 300000ms, keys: /default_pg//cuda//0",
         "store_timeout", {"rank": 5, "peer_rank": 0, "timeout_ms": 300000}),
        ("[rank1]: torch.distributed.DistBackendError: [1] is setting up NCCL communicator and retrieving "
         "ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: Connection "
         "reset by peer", "store_error", {"rank": 1, "peer_rank": 0, "error": "Connection reset by peer"}),
        ("RuntimeError: Socket Timeout", "store_timeout", {"error": "Socket Timeout", "rank": None}),
        ("[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
         "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.20.5",
         "nccl_error", {"rank": 1, "error": "ncclRemoteError", "detail": {
             "where": "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970", "nccl_version": "2.20.5"}}),
        ("[rank4]: ncclInternalError: Internal check failed.", "nccl_error", {"rank": 4, "error": "ncclInternalError"}),
    ],
)  # fmt: skip
def test_recent_messages(line: str, kind: str, fields: dict) -> None:
    e = one(line).to_dict()
    assert e["kind"] == kind
    assert {k: e[k] for k in fields} == fields


def test_stack_trace_frames_and_nccl_error_details() -> None:
    lines = [
        "[rank2]:[E606 09:09:08.170255835 ProcessGroupNCCL.cpp:801] Stack trace of the failed collective:",
        "#0 _verify_param_shape_across_processes from /opt/venv/lib/python3.13/site-packages/torch/distributed/"
        "utils.py:286",
        "#1 __init__ from /opt/venv/lib/python3.13/site-packages/torch/nn/parallel/distributed.py:1020",
        "#2 main from /workspace/train.py:692",
        "",
        "[E ProcessGroupNCCL.cpp:852] [Rank 16] NCCL watchdog thread terminated with exception: NCCL error: remote "
        "process exited or there was a network error, NCCL version 2.19.3",
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
        "Last error:",
        "NET/IB : Got completion from peer 10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244",
        "terminate called after throwing an instance of 'std::runtime_error'",
        "#3 not a frame: the stack ended at the blank line",
    ]
    parsed = parse_lines(lines)
    stack, error = parsed.events
    assert (stack.kind, stack.rank, len(stack.stack)) == ("stack_trace", 2, 3)
    assert stack.stack[2] == "#2 main from /workspace/train.py:692"
    assert (error.kind, error.rank, error.error) == ("nccl_error", 16, "ncclRemoteError")
    assert error.detail == {"nccl_version": "2.19.3", "last_error": lines[8]}
    assert parsed.skipped == 3  # the blank line, "terminate called ...", the last line


def test_real_store_timeouts() -> None:
    parsed = parse_files([DATA / "store-timeouts.log"])
    assert (parsed.lines, parsed.skipped) == (7, 2)  # the two socket.cpp waitForInput warnings
    clients, wait, *connect = parsed.events
    assert (clients.kind, clients.timeout_ms, clients.detail) == ("store_timeout", 3000,
                                                                  {"clients_joined": 1, "clients": 2})  # fmt: skip
    assert (wait.timeout_ms, wait.error, wait.detail) == (2000, "wait timeout", {"keys": ["/missing_key", "/other"]})
    assert [(e.kind, e.timeout_ms, e.peer) for e in connect] == [("store_timeout", 2000, "127.0.0.1:54869")] * 3


def test_new_fields_in_to_dict() -> None:
    e = one("[rank4]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed").to_dict()
    assert {"ranks", "peer_rank", "peer_seq", "peer_op", "differs", "path", "error", "stack", "detail"} <= set(e)
    assert (e["ranks"], e["stack"], e["detail"], e["differs"]) == ([], [], {}, [])


def test_the_rank_that_did_not_time_out_in_a_real_gloo_hang() -> None:
    """Ranks 0, 1, 3 time out in gloo while rank 2 never entered the collective; torchrun's root cause is
    rank 0. torchrun's summary lists all four ranks, so the one without a timeout is named."""
    parsed = parse_files([DATA / "gloo-hang-4ranks.log"])
    assert sorted(e.rank for e in parsed.events if e.kind == "gloo_timeout") == [0, 1, 3]
    ff = parsed.first_failure()
    assert ff is not None and ff["ranks"] == [2] and ff["rule"] == "did not time out" and ff["op"] is None
    # one rank's log alone does not show the job's ranks: no inference, the first failure is all it says
    lines = [line for line in (DATA / "gloo-hang-4ranks.log").read_text().splitlines() if line.startswith("[rank0]")]
    ff = parse_lines(lines).first_failure()
    assert ff is not None and ff["ranks"] == [0] and ff["rule"] == "first message"


def test_a_real_crash_names_the_rank_and_its_exception() -> None:
    """Rank 1 raises (a shape error) while ranks 0, 2, 3 all-reduce: their gloo connections close, torchrun
    tears the job down and names rank 1. The verdict carries rank 1's own exception, not the victims'."""
    parsed = parse_files([DATA / "gloo-crash-4ranks.log"])
    raised = [e for e in parsed.events if e.kind == "rank_exception"]
    assert [(e.rank, e.error, e.detail["communication"]) for e in raised] == [(1, "RuntimeError", False)]
    assert sorted(e.rank for e in parsed.events if e.kind == "gloo_peer_closed") == [0, 2, 3]
    cause = "RuntimeError: inconsistent tensor size, expected tensor [4] and src [3]"
    ff = parsed.first_failure()
    assert ff is not None and (ff["ranks"], ff["rule"]) == ([1], "root cause") and ff["error"].startswith(cause)
    # the ranks' own output alone (no torchrun summary): the rank whose exception is not a peer's failure
    lines = [line for line in (DATA / "gloo-crash-4ranks.log").read_text().splitlines() if line.startswith("[rank")]
    ff = parse_lines(lines).first_failure()
    assert ff is not None and (ff["ranks"], ff["rule"], ff["kind"]) == ([1], "exception", "rank_exception")
    assert ff["error"].startswith(cause)


def test_exceptions_of_tracebacks_only() -> None:
    """An exception line counts only as the end of that rank's traceback; torch's distributed errors are a
    victim's; a chained traceback gives both exceptions, and lines without a rank prefix give none."""
    lines = [
        "[rank0]: RuntimeError: not after a traceback",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 3, in <module>',
        "[rank1]: ValueError: another stream's traceback is not open",
        "[rank0]: torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
        "[rank3]: Traceback (most recent call last):",
        "[rank3]: KeyError: 'labels'",
        "[rank3]: ",
        "[rank3]: The above exception was the direct cause of the following exception:",
        "[rank3]: Traceback (most recent call last):",
        "[rank3]: mylib.errors.DataLoaderFailure",
        "Traceback (most recent call last):",
        "ValueError: whose?",
    ]
    events = [e for e in parse_lines(lines).events if e.kind == "rank_exception"]
    got = [(e.line_no, e.rank, e.error, e.detail["message"], e.detail["communication"]) for e in events]
    assert got == [(5, 0, "DistNetworkError", "failed to recv, got 0 bytes", True),
                   (7, 3, "KeyError", "'labels'", False), (11, 3, "DataLoaderFailure", "", False)]  # fmt: skip
    ff = parse_lines(lines).first_failure()
    assert ff is not None and (ff["ranks"], ff["rule"], ff["error"]) == ([3], "exception", "KeyError: 'labels'")
