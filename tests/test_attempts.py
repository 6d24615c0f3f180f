"""The attempts of a run (``analysis/attempts.py``): which attempts are another world, where detection
cuts a rank's series, and what each attempt is told: its ranks, who left or joined, why it ended, its cost."""

from __future__ import annotations

import numpy as np

from stragglerwatch.analysis.attempts import describe, world_cuts, worlds
from stragglerwatch.analysis.stages import intervals

ATTEMPTS = [{"restart": 0, "attach": 0, "first_step": 0, "last_step": 99},
            {"restart": 1, "attach": 0, "first_step": 100, "last_step": 199},
            {"restart": 2, "attach": 0, "first_step": 200, "last_step": 299}]  # fmt: skip


def meta(*where: tuple[int, str, int | None, int | None]) -> dict:
    """A rank's metadata: (restart, host, agent, world size) per attempt it ran in."""
    return {"attempts": [{"restart": r, "attach": 0, "host": h, "local_rank": 0, "agent": a, "world_size": w}
                         for r, h, a, w in where]}  # fmt: skip


def test_a_plain_restart_is_one_world_a_resize_or_a_move_is_another() -> None:
    same = {r: meta((0, f"n{r // 2}", 10 + r // 2, 4), (1, f"n{r // 2}", 10 + r // 2, 4)) for r in range(4)}
    assert worlds(ATTEMPTS[:2], same) == [0, 0] and world_cuts(ATTEMPTS[:2], same) == ()
    shrunk = {r: meta((0, "n0", 10 + r // 2, 4), *([(1, "n0", 10, 2)] if r < 2 else [])) for r in range(4)}
    assert world_cuts(ATTEMPTS[:2], shrunk) == (100,)
    # same size, but the rendezvous gave rank 1 to the other node's agent: another GPU
    swapped = {r: meta((0, "n0", 10 + r // 2, 4), (1, "n0", 11 - r // 2, 4)) for r in range(4)}
    assert world_cuts(ATTEMPTS[:2], swapped) == (100,)
    # files of an earlier release (no agent, no world size) on the same hosts: no cut is made up
    old = {r: {"attempts": [{"restart": a, "attach": 0, "host": "n0"} for a in (0, 1)]} for r in range(2)}
    assert world_cuts(ATTEMPTS[:2], old) == ()


def test_a_flag_across_a_new_world_is_cut_and_a_flag_clearing_there_is_dropped() -> None:
    flag = np.zeros(300, dtype=bool)
    flag[40:130] = True  # slow in world 0; the flag clears 30 steps into world 1
    flag[150:260] = True  # slow again in world 1 (a stretch of its own)
    cuts = np.array([100])
    assert intervals(flag) == [(40, 130, 0), (150, 260, 130)]
    assert intervals(flag, cuts, carry=83) == [(40, 100, 0), (150, 260, 130)]
    flag[100:150] = True  # slow right on: the piece in world 1 lasts, its onset not before the cut
    assert intervals(flag, cuts, carry=83) == [(40, 100, 0), (100, 260, 100)]
    gone = np.where(np.arange(300) < 100, 1.0, np.nan)  # the rank left the job at the cut
    assert intervals(flag, cuts, gone, carry=83) == [(40, 100, 0)]


def test_each_attempt_says_who_ran_who_left_why_it_ended_and_what_it_cost() -> None:
    rank_meta = {r: meta((0, f"n{r // 2}", 10 + r // 2, 4), *([(2, "n0", 10, 2)] if r < 2 else [])) for r in range(4)}
    attempts = [ATTEMPTS[0], ATTEMPTS[2]]  # restart 1 failed before attach: no record of it
    last_own = {(0, 0): {0: 99, 1: 99, 2: 80, 3: 81}, (2, 0): {0: 299, 1: 299}}
    events = [{"kind": "exception", "rank": 0, "restart": 0, "attach": 0,
               "reason": "RuntimeError: [/x/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:5. More text"},
              *[{"kind": "closed", "rank": r, "restart": 2, "attach": 0} for r in (0, 1)]]  # fmt: skip
    steps = np.arange(300)
    lost = np.where(steps >= 200, 0.01, 0.002)
    first, second = describe(attempts, rank_meta, events, last_own, np.full(300, 0.1), lost, steps)
    assert (first["world_size"], first["ranks"], first["nodes"], first["world"]) == (4, 4, 2, 0)
    assert first["ended"] == ("ranks 2-3 left no record after step 81 and no word (killed, or their node was lost: "
                              "n1); then rank 0 failed (RuntimeError: Connection closed by peer [127.0.0.1]:5)")
    assert (second["world_size"], second["left"], second["joined"], second["nodes_left"], second["world"]) == (
        2, [2, 3], [], ["n1"], 1)
    assert second["ended"] == "finished (every rank closed)"
    assert first["lost_seconds"] == 0.2 and first["lost_gpu_seconds"] == 0.8  # 100 steps x 2 ms x 4 GPUs
    assert second["lost_seconds"] == 1.0 and second["lost_gpu_seconds"] == 2.0  # 100 steps x 10 ms x 2 GPUs
