"""Reader of ``collectives-NNNNN.jsonl``: the collectives PyTorch recorded on each rank (written by
``runtime/collectives.py``), one row per collective: group name (with the attempt: ``NAME@RESTART``),
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
    files = collective_files(run_dir)
    if not files:
        return None
    frames, lost, bad = [], {}, 0
    for rank, path in files.items():
        groups_col: list[str] = []
        seq: list[int] = []
        created: list[int] = []
        training: list[int] = []
        ops: list[str] = []
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            bad += 1
            continue
        for line in text.splitlines():
            try:
                d = json.loads(line)
                attempt = int(d.get("restart") or 0)  # a restarted job's groups count their collectives anew
                names = [f"{n}@{attempt}" for n in d["groups"]]
                for g, s, c, t, op in d["rows"]:
                    groups_col.append(names[int(g)])
                    seq.append(int(s))
                    created.append(int(c))
                    training.append(int(t))
                    ops.append(str(op))
                lost[rank] = lost.get(rank, 0) + int(d.get("lost") or 0)
            except (ValueError, KeyError, TypeError, IndexError):
                bad += 1
        frames.append(pd.DataFrame({
            "rank": np.full(len(seq), rank, dtype=np.int64), "group": groups_col, "seq": np.asarray(seq, np.int64),
            "created": np.asarray(created, np.int64) / 1e9, "training": np.asarray(training, bool), "op": ops,
        }))  # fmt: skip
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(COLUMNS))
    return Collectives(rows.drop_duplicates(["rank", "group", "seq", "created"]), lost, bad)
