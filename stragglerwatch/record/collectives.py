"""Reader of ``collectives-NNNNN.jsonl``: the collectives PyTorch recorded on each rank (written by
``runtime/capture/collectives.py``), one row per collective: group name (with the attempt: ``NAME@RESTART``),
sequence number in the group,
created (Unix seconds), issued on the training thread, operation. Lines that are not ours are
skipped and counted, never raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

COLUMNS = ("rank", "group", "seq", "created", "training", "op")


@dataclass
class Collectives:
    rows: pd.DataFrame  # COLUMNS
    lost: dict[int, int] = field(default_factory=dict)  # entries the ring overwrote unread, by rank
    bad_lines: int = 0


def collective_files(run_dir: Path) -> dict[int, Path]:
    out = {}
    for p in sorted(Path(run_dir).glob("collectives-*.jsonl")):
        try:
            out[int(p.stem.split("-")[1])] = p
        except (IndexError, ValueError):
            continue
    return out


def load_collectives(run_dir: Path) -> Collectives | None:
    """Every rank's recorded collectives; None when the run dir has none."""
    return CollectiveReader(Path(run_dir)).read()


class CollectiveReader:
    """Reads the run dir's files incrementally (the live path): each :meth:`read` parses only the bytes
    appended since the last one (whole lines), and returns every row read so far."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._offsets: dict[int, int] = {}
        self._frames: list[pd.DataFrame] = []
        self._lost: dict[int, int] = {}
        self._bad = 0
        self._rows: pd.DataFrame | None = None

    def read(self) -> Collectives | None:
        files = collective_files(self.run_dir)
        if not files:
            return None
        changed = False
        for rank, path in files.items():
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets.get(rank, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            if end == 0:
                continue
            self._offsets[rank] = self._offsets.get(rank, 0) + end
            frame = self._parse(rank, data[:end].decode("utf-8", errors="replace"))
            if len(frame):
                self._frames.append(frame)
                changed = True
        if changed or self._rows is None:
            rows = pd.concat(self._frames, ignore_index=True) if self._frames else pd.DataFrame(columns=list(COLUMNS))
            self._rows = rows.drop_duplicates(["rank", "group", "seq", "created"])
            self._frames = [self._rows]
        return Collectives(self._rows, dict(self._lost), self._bad)

    def keep_since(self, t: float) -> None:
        """Forget the rows created before ``t`` (Unix seconds), for a reader that follows a window of the
        run in bounded memory (``analysis.policyfeed``)."""
        rows = pd.concat(self._frames, ignore_index=True) if len(self._frames) > 1 else self._rows
        if rows is not None:
            self._rows = rows[rows["created"] >= t].reset_index(drop=True)
            self._frames = [self._rows]

    def _parse(self, rank: int, text: str) -> pd.DataFrame:
        groups_col: list[str] = []
        seq: list[int] = []
        created: list[int] = []
        training: list[int] = []
        ops: list[str] = []
        for line in text.splitlines():
            try:
                d = json.loads(line)
                attempt = int(d.get("restart") or 0)  # a restarted job's groups count their collectives anew
                names = [f"{n}@{attempt}" for n in d["groups"]]
                parsed = [(names[int(g)], int(s), int(c), int(t), str(op)) for g, s, c, t, op in d["rows"]]
                lost = int(d.get("lost") or 0)
            except (ValueError, KeyError, TypeError, IndexError):
                self._bad += 1
                continue
            for g, s, c, t, op in parsed:
                groups_col.append(g)
                seq.append(s)
                created.append(c)
                training.append(t)
                ops.append(op)
            self._lost[rank] = self._lost.get(rank, 0) + lost
        return pd.DataFrame({
            "rank": np.full(len(seq), rank, dtype=np.int64), "group": groups_col, "seq": np.asarray(seq, np.int64),
            "created": np.asarray(created, np.int64) / 1e9, "training": np.asarray(training, bool), "op": ops,
        })  # fmt: skip
