"""Parsing PyTorch distributed failure messages from torchrun / worker logs, across PyTorch versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stragglerwatch.torchlogs import LogEvent, LogParse, parse_files, parse_lines

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
        "seq": 1580,
        "op": "ALLREDUCE",
        "kind": "nccl_timeout",
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
        "seq": None,
        "op": None,
        "kind": "child_failed",
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
        "seq": 42,
        "op": "ALLREDUCE",
        "kind": "nccl_work_state",
        "line_no": 7,
        "file": "job.log",
    }
    # without rank 3's status line, the earliest timed-out rank is the answer
    parsed = parse_lines(lines[:-1])
    assert parsed.first_failure() == {
        "rank": 0,
        "seq": 42,
        "op": "ALLREDUCE",
        "kind": "nccl_timeout",
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
    assert ff is not None and (ff["rank"], ff["kind"], ff["line_no"]) == (0, "monitored_barrier", 2)
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

    from stragglerwatch.cli import main as cli

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
    assert "first failure: rank 3, collective SeqNum 42 ALLREDUCE" in capsys.readouterr().out
    assert cli(["analyze", "--logs", str(tmp_path / "missing.log")]) == 2
    assert "missing.log" in capsys.readouterr().err
