"""An interpreter that has imported torch once and forks the ranks of the suite's multi-rank jobs
(``conftest.launch``), so that each rank starts in milliseconds instead of the seconds that importing
torch takes (four ranks on two cores: several seconds of every job).

A forked rank is a real process that runs its script as ``python SCRIPT ARGS`` would: its own
environment, working directory, ``sys.argv``, output file on descriptors 1 and 2, ``__main__`` module,
exit status and the first steps of interpreter shutdown (:func:`finish`: the non-daemon threads joined,
then the ``atexit`` functions, then the standard streams flushed). The rest of the shutdown, freeing every
module's objects, is skipped: with torch loaded it takes a second or more of CPU per rank (four ranks on
two cores: two seconds of every job), and it saves nothing that a script or stragglerwatch has not closed
or flushed itself. Only what this interpreter imported before forking is shared, and nothing here reads
the environment at import time that a job may set differently:
``conftest.launch`` forks only jobs whose environment differs from this one's in variables read when
the job runs (the ranks' coordinates, stragglerwatch's own), and starts the others afresh.

Requests on stdin, one JSON object a line; one JSON answer a line on stdout:
``{"run": {"script", "args", "env", "cwd", "out"}}`` answers ``{"pid": N}``;
``{"poll": PID}`` answers ``{"code": None}`` while it runs, else its exit code as ``Popen.returncode``
gives it (minus the signal that ended it).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading

import numpy
import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - DistributedDataParallel imports it when made: seconds more of every rank
import torch.distributed  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.nn.parallel  # noqa: F401


def start(job: dict) -> int | None:
    """Fork a rank; in the parent its pid, in the rank ``None`` (after its descriptors are set)."""
    pid = os.fork()
    if pid:
        return pid
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))  # as python SCRIPT puts the script's folder
    numpy.random.seed()  # numpy's global generator seeds itself at import: a fresh one in each rank, as there
    return None


def run(script: str) -> int:
    """Run ``script`` as ``__main__``; its exit status as ``python SCRIPT`` would give it (an uncaught
    exception printed by ``sys.excepthook``: 1; ``sys.exit(x)``: ``x``, or 1 with ``x`` printed)."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return int(stop.code or 0)
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def finish() -> None:
    """What the interpreter does first when it exits, in its order: wait for the threads that are not
    daemons, run the ``atexit`` functions, flush the standard streams."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join of non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def serve() -> None:
    codes: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "run" in request:
            pid = start(request["run"])
            if pid is None:  # the rank: leave the loop, run the script, exit as python SCRIPT would
                code = run(request["run"]["script"])
                finish()
                os._exit(code)
            answer: dict = {"pid": pid}
        else:
            pid = int(request["poll"])
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            answer = {"code": codes.get(pid)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
