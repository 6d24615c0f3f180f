"""One message of PyTorch's own failure logs, as both parsers read it (:class:`LogEvent`): the rank,
the process group, the collective and its sequence number, and what the message says happened.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LogEvent:
    """One recognised failure message; every field but ``kind`` and ``line_no`` may be absent."""

    kind: str
    line_no: int
    rank: int | None = None
    pg: str | None = None
    seq: int | None = None
    op: str | None = None
    numel_in: int | None = None
    numel_out: int | None = None
    timeout_ms: int | None = None
    ran_for_ms: int | None = None
    last_enqueued: int | None = None
    last_completed: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    pid: int | None = None
    host: str | None = None
    local_rank: int | None = None
    peer: str | None = None
    failed_ranks: list[int] = field(default_factory=list)  # ranks the message blames
    ranks: list[int] = field(default_factory=list)  # ranks it names otherwise (a desync snapshot group)
    peer_rank: int | None = None  # the other rank it names: mismatching rank, dump signaller, store root
    peer_seq: int | None = None
    peer_op: str | None = None
    differs: list[str] = field(default_factory=list)  # collective_mismatch: seq, op, shape, dtype, device
    path: str | None = None  # a Flight Recorder dump file
    error: str | None = None  # ncclResult name, abort reason, store error
    stack: list[str] = field(default_factory=list)  # frames of the failed collective
    detail: dict[str, Any] = field(default_factory=dict)  # kind-specific extras
    root_cause: bool = False
    file: str | None = None
    text: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
