"""The suite's forked ranks (``conftest.launch``, ``tests/workers/prefork.py``): forked in every test, and
ending as ``python SCRIPT`` ends."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from conftest import prefork

pytestmark = pytest.mark.distributed

SCRIPT = """
import atexit, os, sys, threading, time
from pathlib import Path

out = Path(sys.argv[1])
def late() -> None:  # a thread that is not a daemon: the interpreter waits for it before atexit
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
atexit.register(lambda: (out / "atexit").write_text(str((out / "thread").exists())))
print("to stdout", flush=False)
(out / "env").write_text(os.environ["RANK"] + " " + os.environ["PYTEST_CURRENT_TEST"])
sys.exit(int(sys.argv[2]))
"""


def test_every_test_forks_its_ranks_and_they_end_as_the_interpreter_would(tmp_path: Path) -> None:
    """pytest names the running test in ``PYTEST_CURRENT_TEST``: a job of any test is forked from the
    interpreter an earlier test started. The rank gets its own environment; its exit status, its
    non-daemon threads, its ``atexit`` functions and its unflushed output are as ``python SCRIPT`` gives."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    server = prefork()
    env = {**server.env, "RANK": "3", "PYTEST_CURRENT_TEST": "tests/test_other.py::test_later (call)"}
    assert server.forks(env), "a job of another test would start its ranks afresh"
    assert not server.forks({**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}), "torch may read it at import"
    for code in (0, 3):
        out = tmp_path / f"out{code}"
        out.mkdir()
        log = tmp_path / f"log{code}.txt"
        rank = server.start(script, (str(out), str(code)), env, str(log))
        assert rank.wait(timeout=60) == code
        assert (out / "env").read_text() == "3 tests/test_other.py::test_later (call)"
        assert (out / "thread").read_text() == "done"
        assert (out / "atexit").read_text() == "True", "atexit ran before the non-daemon thread ended"
        assert log.read_text() == "to stdout\n"
    assert os.environ.get("PYTEST_CURRENT_TEST"), "pytest sets it: the test above would prove nothing"
